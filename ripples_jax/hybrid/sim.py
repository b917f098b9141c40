"""executor=hybrid: the hybrid's clock (hybrid/clock.py), then exact numerics of its events.

Every replica holds its own K-stage pipeline state (the pipeline package's method: its ticks, rings and
optimizer states), stacked on a leading replica axis R; replica r walks its own shard of the training
set (data.batch_indices, worker r), so with R=1 its batches are the pipeline's. The clock's events are
packed into rounds, each one masked tick of the ticking replicas (the method's step, vmapped) followed by
the averages: stage k's parameters and model state averaged among each group's members' stage k, and
nothing else (rings, FIFOs and optimizer states are each replica's own, as a Ripples worker's optimizer
state is). A record's time is the clock's virtual time; its step is the replicas' ticks over R.

Invariants (tests/test_hybrid.py): R=1 is the pipeline's run; K=1 is Ripples' numerics over the same
events; the stages never mix; a resumed run equals an uninterrupted one.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from ripples_jax import algorithms, collectives, engine, profiling, timeline
from ripples_jax import data as data_lib
from ripples_jax.hybrid import clock as clock_lib
from ripples_jax.pipeline import baselines, timing
from ripples_jax.pipeline import inputs as pipeline_inputs
from ripples_jax.runlog import RunLog, make_workdir
from ripples_jax.schedule.static import default_grid

AVERAGED = ("params", "model_state")  # what a stage's average touches; every other key is local


@dataclasses.dataclass
class RoundsLoop:
  """The loop state between rounds, the checkpoint's cursor (the clock is re-run on resume)."""

  round: int = 0  # rounds executed
  ticks: int = 0  # ticks executed, all replicas
  next_log: int = 0  # the step (ticks // R) of the next record
  next_eval: int = 0
  evaluated_step: int | None = None
  time_to_target: float | None = None  # the replicas' mean model, uncharged
  consensus_time_to_target: float | None = None  # ... with the All-Reduce that builds it charged
  worker_time_to_target: float | None = None  # the median replica's own model


def replica_view(config) -> ml_collections.ConfigDict:
  """config.replicas as a Ripples config over R workers, the replicas: what the algorithm registry's
  generators read (a Group Generator is the simulator's and the runtime's, over replicas instead of
  workers)."""
  c, R = config.replicas, config.replicas.count
  schedule = dict(group_size=c.group_size, smart_tolerance=c.smart_tolerance, smart_max_gap=c.smart_max_gap)
  schedule.update(smart_fresh=c.get("smart_fresh", False), request_ahead=True)
  schedule.update(layout="node", workers_per_node=c.workers_per_node)  # Static GG: the node layout
  grid = tuple(c.get("grid", ())) or default_grid(R)
  moshpit = dict(grid=grid, window=c.get("window", 0.0), max_gap=c.get("window_max_gap", 4))
  view = dict(algorithm=c.algorithm, num_workers=R, seed=config.seed, schedule=schedule, moshpit=moshpit)
  return ml_collections.ConfigDict(view)


def make_generator(config):
  """replicas.algorithm's Group Generator over the R replicas (algorithms.groups_of on replica_view):
  a generator, group_gen.Fixed of a fixed schedule, or None (none: no averaging)."""
  return algorithms.groups_of(replica_view(config), np.random.default_rng([5, config.seed]))


def replica_group_sizes(config) -> range:
  """The sizes a group of replicas.algorithm can have (placement=devices compiles a mean for each)."""
  gen, R = make_generator(config), config.replicas.count
  if gen is None:
    return range(0)
  layouts = getattr(gen, "layouts", None)  # a fixed schedule's, Moshpit's rounds
  most = max(len(g) for layout in layouts for g in layout) if layouts else min(config.replicas.group_size, R)
  return range(2, most + 1)


def member_sets(config, r: int) -> list:
  """Every member set replica r can average in, in one global order (placement=per_process connects
  each before the clock starts)."""
  gen, R = make_generator(config), config.replicas.count
  if gen is None:
    return []
  layouts = getattr(gen, "layouts", None)
  if layouts:
    lines = {tuple(sorted(g)) for layout in layouts for g in layout if len(g) > 1}
    if getattr(gen, "partial_lines", False):  # Moshpit's window: any 2 or more of a line
      lines = {s for g in lines for k in range(2, len(g) + 1) for s in itertools.combinations(g, k)}
    sets = sorted(lines)
  else:
    most = min(config.replicas.group_size, R)
    sets = [s for n in range(2, most + 1) for s in itertools.combinations(range(R), n)]
  return [s for s in sets if r in s]


def clock_spec(config, stage_s, stage_bytes, total_ticks: int) -> clock_lib.Spec:
  c = config.replicas
  return clock_lib.Spec(
    tuple(float(s) for s in stage_s),
    tuple(float(b) for b in stage_bytes),
    c.count,
    total_ticks,
    make_generator(config),
    sync_every=c.sync_every,
    slow=tuple(c.slow) if len(c.slow) else None,
    slowdown=float(c.slowdown),
    rotate_every=float(c.rotate_every),
    jitter=float(c.jitter),
    alpha=float(c.alpha),
    bandwidth=float(c.bandwidth),
    seed=config.seed,
    avg_s=float(c.avg_s),
  )


def stage_costs(config, stages, state_K, sample_x):
  """Seconds of one tick's forward + backward of each stage and bytes of its parameters: the config's
  (replicas.stage_s, stage_bytes), else measured here (timing.measure_stage_times; the parameters)."""
  c = config.replicas
  stage_s = tuple(c.stage_s)
  if not stage_s:
    fwd_K, bwd_K = timing.measure_stage_times(stages, state_K, sample_x)
    stage_s = tuple(f + b for f, b in zip(fwd_K, bwd_K))
  nbytes = lambda st: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(st["params"]))
  stage_bytes = tuple(c.stage_bytes) or tuple(nbytes(st) for st in state_K)
  return stage_s, stage_bytes


def replica_rounds(events, R: int) -> list:
  """The replicas' events packed into rounds by timeline.pack_rounds, a replica's tick being the APPLY
  of its own step: rounds of (tick mask [R], tick index [R], gid [R]) in event order. A round closes
  before a replica ticks twice, ticks after averaging, or averages twice in it (replica r's own events
  keep their order; different replicas' events commute until an average joins them)."""
  ticks = [[] for _ in range(R)]  # each replica's tick indices, in its order
  for ev in events:
    if ev[1] == clock_lib.TICK_END:
      ticks[ev[2]].append(ev[3])
  steps = [(ev[0], ev[1], ev[2], ev[2]) if ev[1] == clock_lib.TICK_END else ev for ev in events]
  out, seen = [], np.zeros(R, np.int64)  # each replica's ticks packed so far: its next tick's index
  for r in timeline.pack_rounds(steps, R, R):
    tick = r["apply_src"] >= 0
    t = np.array([ticks[w][seen[w]] if tick[w] else 0 for w in range(R)], np.int64)
    seen += tick
    out.append({"tick": tick, "t": t, "gid": r["gid"].astype(np.int64), "time": r["time"]})
  return out


def make_replica_round_fn(step):
  """(state_K, x_R, y_R, t_R, tick_R, gid_R) -> (state_K, loss_R): the ticking replicas' step, then every
  stage's average by gid (gid[r] = r: no group)."""

  def round_fn(state, x_R, y_R, t_R, tick_R, gid_R):
    new, (loss_R, _) = jax.vmap(step)(state, x_R, y_R, t_R)
    keep = lambda a, b: jnp.where(tick_R.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    state = jax.tree.map(keep, new, state)
    out = []
    for st in state:  # stage by stage: stage k's rows meet only stage k's rows
      mixed = {
        key: jax.tree.map(
          lambda a: (
            collectives.segment_mean(a.reshape(a.shape[0], -1), gid_R).reshape(a.shape).astype(a.dtype)
          ),
          st[key],
        )
        for key in AVERAGED
      }
      out.append(dict(st, **mixed))
    return out, jnp.where(tick_R, loss_R, jnp.nan)

  return jax.jit(round_fn, donate_argnums=0)


@dataclasses.dataclass
class Hybrid:
  """What both hybrid executors build first: the pipeline's setup, one replica's initial state, the
  method's step maker and schedule, and the budget of ticks (per replica and in all)."""

  p: pipeline_inputs.PipelineSetup
  one: list
  step_fn: object
  schedule: object
  per_replica: int
  total: int


def build_replicas(config, workdir: str | None = None) -> Hybrid:
  """num_epochs are passes over the training set by the replicas together (data parallel: each replica
  ceil(num_batches / R) batches and its drain, R=1 the pipeline's run); with a straggler the fast
  replicas take more of the R x that ticks, as Ripples' workers do. No replica's updates are masked as
  past the end (the step's num_batches is the run's ticks): a replica's stream of batches is its
  shard's endless walk, and what is in flight at the end is not applied."""
  R = config.replicas.count
  p = pipeline_inputs.build_pipeline(config, workdir)
  init_fn, step_fn = baselines.METHODS[config.method]
  one = init_fn(
    p.stages, p.optimizer, config, jax.random.key(config.seed), p.feed.sample, p.data["num_classes"]
  )
  schedule = baselines.schedule_of(config)
  per_replica = -(-p.num_batches // R) + (schedule.drain_ticks() if schedule else 0)
  return Hybrid(p, one, step_fn, schedule, per_replica, R * per_replica)


def run(config, workdir: str | None = None) -> dict:
  """executor=hybrid (run.EXECUTORS): the summary of simulate_replicas_and_train."""
  return simulate_replicas_and_train(config, workdir)[0]


def simulate_replicas_and_train(config, workdir: str | None = None):
  """The clock, then the numerics, through RunLog; returns (summary, final state_K, the clock's trace)."""
  R = config.replicas.count
  workdir = make_workdir(workdir, config)
  h = build_replicas(config, workdir)
  p, one, schedule, per_replica, total = h.p, h.one, h.schedule, h.per_replica, h.total
  stage_s, stage_bytes = stage_costs(config, p.stages, one, p.feed.sample)
  # Every replica starts from the same parameters, as Ripples' workers do.
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (R,) + a.shape).copy(), one)
  spec = clock_spec(config, stage_s, stage_bytes, total)
  trace = clock_lib.simulate_replicas(spec)
  charge = replica_consensus_charge(config, spec)
  logging.info(
    "hybrid %s R=%d K=%d: %d events, %.1f virtual s; stage seconds %s, bytes %s",
    config.replicas.algorithm,
    R,
    config.num_stages,
    len(trace.events),
    trace.end_time,
    np.round(stage_s, 5),
    stage_bytes,
  )
  shards = data_lib.shard_indices(p.data["y_train"], R, "iid", seed=config.seed)
  with RunLog(workdir, config, per_replica) as log:
    cur = RoundsLoop(next_log=config.log_every, next_eval=config.eval_every)
    got = log.restore(state)
    if got is not None:
      _, state, saved = got
      cur = RoundsLoop(**saved)
    with profiling.CompileCounter() as compiles:
      round_fn = make_replica_round_fn(h.step_fn(p.stages, p.optimizer, config, total))
      state, cur = execute_rounds(config, p, shards, state, cur, trace, round_fn, log, schedule, charge)
    split = trace.time_split()
    summary = log.finish(
      time=trace.end_time,
      worker_steps=trace.worker_steps.tolist(),
      replicas=R,
      num_stages=config.num_stages,
      method=config.method,
      algorithm=config.replicas.algorithm,
      groups=clock_lib.averages(trace),
      compute_time=split["compute"].tolist(),
      wait_time=split["wait"].tolist(),
      comm_time=split["comm"].tolist(),
      stage_s=list(stage_s),
      stage_bytes=list(stage_bytes),
      time_to_target=cur.time_to_target,
      consensus_time_to_target=cur.consensus_time_to_target,
      worker_time_to_target=cur.worker_time_to_target,
      consensus_charge=charge,
      target_accuracy=config.replicas.target_accuracy,
      compiles=compiles.count,
    )
  return summary, state, trace


def execute_rounds(
  config, p, shards, state, cur: RoundsLoop, trace, round_fn, log: RunLog, schedule, charge=None
):
  """The packed rounds from cur.round on; records, evaluations and checkpoints on the way."""
  R = config.replicas.count
  offset = schedule.offsets[-1] if schedule else 0  # the last stage's labels are of batch t - offset
  evaluate = baselines.make_eval(p.stages)
  test = jax.device_put((p.data["x_test"], p.data["y_test"]))
  val = jax.device_put((p.data["x_val"], p.data["y_val"])) if "x_val" in p.data else None
  every, losses = config.checkpoint_every, []
  next_ckpt = (cur.ticks // R // every + 1) * every if every else None
  rounds = replica_rounds(trace.events, R)
  for i, r in enumerate(rounds):
    if i < cur.round:
      continue
    x_R, y_R = replica_batches(config, p.data, shards, r, offset)
    state, loss_R = round_fn(state, x_R, y_R, r["t"], r["tick"], r["gid"])
    if r["tick"].any():
      losses.append(loss_R)
    cur.round, cur.ticks = i + 1, cur.ticks + int(r["tick"].sum())
    step, final = cur.ticks // R, i == len(rounds) - 1
    if step >= cur.next_log or step >= cur.next_eval or final:
      record_point(config, cur, log, evaluate, test, val, state, step, r["time"], losses, final, charge)
      losses = []
      if next_ckpt is not None and (step >= next_ckpt or final):  # right after a record: no loss pending
        next_ckpt = (step // every + 1) * every
        log.checkpoint(step, state, dataclasses.asdict(cur), force=final)
    else:
      log.progress(step)
  return state, cur


def replica_batches(config, data, shards, r: dict, offset: int):
  """x of each ticking replica's tick t (batch t of its shard's walk) and the labels of batch t - offset
  (negative: warm-up, any batch, its update masked); zeros elsewhere."""
  R, B = len(shards), config.batch_size
  x = np.zeros((R, B) + data["x_train"].shape[1:], data["x_train"].dtype)
  y = np.zeros((R, B), data["y_train"].dtype)
  rows = np.flatnonzero(r["tick"])
  if len(rows):
    pick = [shards[w] for w in rows]
    t = r["t"][rows]
    x[rows] = data["x_train"][data_lib.batch_indices(pick, B, config.seed, t, workers=rows)]
    y[rows] = data["y_train"][
      data_lib.batch_indices(pick, B, config.seed, np.maximum(t - offset, 0), workers=rows)
    ]
  return x, y


def averaged_model(state):
  """The run's model: every stage's parameters and model state averaged over the replicas."""
  return [{key: jax.tree.map(lambda a: a.mean(0), st[key]) for key in AVERAGED} for st in state]


def run_models(config, state) -> list:
  """The models a record evaluates (their metrics averaged): the replicas' average, or with no
  averaging (replicas.algorithm=none: R independent pipelines, no one model; the average of
  independently trained networks is no network) each replica's own."""
  if config.replicas.algorithm != "none":
    return [averaged_model(state)]
  return replica_models(config, state)


def replica_models(config, state) -> list:
  """Each replica's own model (every stage's parameters and model state at its index)."""
  own = lambda r: [{key: jax.tree.map(lambda a: a[r], st[key]) for key in AVERAGED} for st in state]
  return [own(r) for r in range(config.replicas.count)]


def replica_consensus_charge(config, spec: clock_lib.Spec) -> float | None:
  """Virtual seconds of the All-Reduce of every stage across the R replicas that builds the deployable
  model (the replicas' mean; the K stages' at once, the longest, as a group's averages): 0 where every
  replica holds it (allreduce), None with no averaging (no one model)."""
  name = config.replicas.algorithm
  if name == algorithms.NONE:
    return None
  if algorithms.get(name).consensus != algorithms.BUILT and config.replicas.sync_every == 1:
    return 0.0  # all-reduced after every tick: every replica holds it at every evaluation
  R = config.replicas.count
  return spec.avg_s or max(
    collectives.ring_allreduce_time(R, b, spec.alpha, spec.bandwidth) for b in spec.stage_bytes
  )


def record_point(
  config,
  cur: RoundsLoop,
  log: RunLog,
  evaluate,
  test,
  val,
  state,
  step: int,
  t: float,
  losses,
  final,
  charge=None,
):
  """One metrics record at `step` (virtual time t), with an evaluation when one is due; with averaging
  the deployable model's time too, consensus_time = t + the All-Reduce that builds it (`charge`)."""
  cur.next_log = (step // config.log_every + 1) * config.log_every
  scalars = {}
  if losses:
    scalars["train_loss"] = float(np.nanmean(np.asarray(jnp.stack(losses))))
  if step >= cur.next_eval or final:
    cur.next_eval = (step // config.eval_every + 1) * config.eval_every
    cur.evaluated_step = step
    models = run_models(config, state)
    for split, xy in (("test", test), ("val", val)):
      if xy is not None:
        acc, loss = np.mean([jax.device_get(evaluate(m, *xy)) for m in models], 0)
        scalars.update({f"{split}_accuracy": float(acc), f"{split}_loss": float(loss)})
    target = config.replicas.target_accuracy
    if cur.time_to_target is None and target and scalars["test_accuracy"] >= target:
      cur.time_to_target = t
    if charge is not None:
      scalars["consensus_time"] = t + charge
      if cur.consensus_time_to_target is None and target and scalars["test_accuracy"] >= target:
        cur.consensus_time_to_target = t + charge
    if config.replicas.algorithm != "none" and config.get("eval_workers", True):
      median = record_own(config, evaluate, test, state, scalars)
      if cur.worker_time_to_target is None and target and median >= target:
        cur.worker_time_to_target = t
  log.record(step, t, **scalars)


def record_own(config, evaluate, test, state, scalars) -> float:
  """The replicas' own models (what a replica holds and could deploy) on the first
  engine.WORKER_EVAL_EXAMPLES test examples, as the simulator's workers': the median replica's and the
  worst one's accuracy into `scalars`; returns the median."""
  k = engine.WORKER_EVAL_EXAMPLES
  x, y = test
  acc_R = [float(jax.device_get(evaluate(m, x[:k], y[:k]))[0]) for m in replica_models(config, state)]
  scalars["worker_median_test_accuracy"] = float(np.median(acc_R))
  scalars["worker_min_test_accuracy"] = float(min(acc_R))
  return scalars["worker_median_test_accuracy"]

"""executor=sim: schedule + timeline + engine. Exact numerics, virtual time, deterministic under a seed.

The clock (timeline.simulate) runs first and alone: with the speeds and the network model it decides
every event of the run. The events are packed into rounds and executed in order on stacked per-worker
state; metrics carry the virtual time of the round that produced them.
"""

import dataclasses
import time

import jax
import numpy as np
from absl import logging

from ripples_jax import algorithms, allocator, engine, profiling, timeline, workload
from ripples_jax import data as data_lib
from ripples_jax.algorithms import make_group_generator
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.models import num_params
from ripples_jax.runlog import RunLog, make_workdir
from ripples_jax.timeline import ps_async


def measure_step_time(model, optimizer, sample_x, sample_y, reps: int = 20) -> float:
  """Median seconds of one worker's real jitted step (gradient + update) on one device."""
  state = engine.init_state(model, optimizer, jax.random.key(0), sample_x[:1], 1, make_worker_mesh(1))
  fn = engine.make_round_fn(model, optimizer, make_worker_mesh(1), (((0,),),), "segment")
  x, y, mask = sample_x[None], sample_y[None], np.ones(1, bool)
  state, loss = fn(state, x, y, mask, 0)
  loss.block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    state, loss = fn(state, x, y, mask, 0)
    loss.block_until_ready()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def build_clock(config, model_bytes: float, base_time: float):
  hetero, tl = config.hetero, config.timeline
  speed = timeline.SpeedModel(
    base_time,
    config.num_workers,
    tuple(hetero.slow_workers),
    float(hetero.slowdown),
    float(hetero.random_p),
    float(hetero.jitter),
    config.seed,
    rotate_every=float(hetero.rotate_every),
  )
  hidden = float(tl.get("overlap", 0.0)) * base_time  # seconds of each step's transfers compute hides
  net = timeline.Network(model_bytes, tl.alpha, tl.bandwidth, tl.ps_bandwidth, hidden)
  return speed, net


@dataclasses.dataclass
class Loop:
  """The loop state between rounds, saved as the checkpoint's cursor (the clock is re-run on resume)."""

  round: int = 0  # rounds executed
  starts: list = None  # gradients started per worker (each worker's next batch index)
  applied: int = 0  # gradients applied, all workers
  next_log: int = 0  # the step (applied // n) of the next record
  next_eval: int = 0  # ... of the next evaluation
  evaluated_step: int | None = None
  time_to_target: float | None = None  # the workers' mean model (no worker holds it), uncharged
  consensus_time_to_target: float | None = None  # the deployable model, its All-Reduce charged
  worker_time_to_target: float | None = None  # the median worker's own model


LARGE = 1024  # slots from which the allocator's defaults cost a run a noticeable share of its time


def run(config, workdir: str | None = None) -> dict:
  """executor=sim (run.EXECUTORS): the summary of simulate_and_train."""
  return simulate_and_train(config, workdir)[0]


def simulate_and_train(config, workdir: str | None = None):
  """Runs the clock, then the numerics, writing the same files as the lockstep executor.

  Returns (summary, the clock's trace).
  """
  n = config.num_workers
  s = workload.build(config)
  workdir = make_workdir(workdir, config)
  has_server = algorithms.get(config.algorithm).clock == algorithms.PS_ASYNC
  slots = n + has_server  # the parameter server is one more slot
  if slots >= LARGE and not allocator.tuned():
    logging.warning(
      "%d slots with glibc's default allocator: the rounds' memory is faulted in afresh each round "
      "(1.7-2.5x slower at 4,096 workers, docs/design.md 5.1); start the run with %s",
      slots,
      allocator.command_prefix(),
    )
  # All slots on one device: the rounds are many and small, and their cross-slot gathers would be
  # collectives between CPU device threads, which starve (rendezvous timeouts) when thousands of tiny
  # rounds are queued on 2 cores. The numerics do not depend on placement.
  mesh = make_worker_mesh(slots, jax.devices()[:1])
  state = engine.init_sim_state(
    s.model, s.optimizer, jax.random.key(config.seed), s.data["x_train"][:1], slots, mesh
  )
  if algorithms.get(config.algorithm).clock == algorithms.DILOCO:  # the global model, the outer momentum
    state["outer"] = engine.init_outer_state(state["params"])
  model_bytes = config.timeline.model_bytes or 4 * num_params(jax.tree.map(lambda a: a[0], state["params"]))
  base_time = config.timeline.compute_time or measure_step_time(
    s.model, s.optimizer, s.data["x_train"][: config.batch_size], s.data["y_train"][: config.batch_size]
  )
  trace = run_clock(config, model_bytes, base_time)
  charge = consensus_charge(config, model_bytes, base_time)
  with RunLog(workdir, config, config.num_steps) as log:
    # Resume: the clock is deterministic, so it is simply run again; the rounds the checkpoint had
    # executed are skipped and the engine state and the cursor restored.
    cur = Loop(starts=[0] * n, next_log=config.log_every, next_eval=config.eval_every)
    got = log.restore(state)
    if got is not None:
      _, state, saved = got
      cur = Loop(**saved)
    with profiling.CompileCounter() as compiles:
      state, cur, programs = execute(config, s, state, cur, trace, mesh, log, charge)
    split = trace.time_split()
    summary = log.finish(
      time=trace.end_time,
      worker_steps=trace.worker_steps,
      conflicts=trace.conflicts.tolist(),
      compute_time=split["compute"].tolist(),
      wait_time=split["wait"].tolist(),
      comm_time=split["comm"].tolist(),
      base_step_time=base_time,
      model_bytes=model_bytes,
      time_to_target=cur.time_to_target,
      consensus_time_to_target=cur.consensus_time_to_target,
      worker_time_to_target=cur.worker_time_to_target,
      consensus_charge=charge,
      target_accuracy=config.target_accuracy,
      round_programs=programs,
      compiles=compiles.count,  # XLA compiles while the rounds ran (round programs, evaluation)
      events=len(trace.events),
      # hetero.leave: what the clock applied, (time, worker, leave | rejoin | first_group); absent
      # without it, so such a run's summary is what it always was
      **({"membership": [list(m) for m in trace.membership]} if leave_plan(config) else {}),
    )
  return summary, trace


def consensus_charge(config, model_bytes: float, base_time: float) -> float:
  """Virtual seconds of the one All-Reduce that builds the deployable model from the workers' (charged
  at every evaluation of a gossip or group method); 0 where every worker holds it or it is DiLoCo's
  global model (the algorithm's record: algorithms.HELD, GLOBAL, BUILT)."""
  if algorithms.get(config.algorithm).consensus != algorithms.BUILT:
    return 0.0
  _, net = build_clock(config, model_bytes, base_time)
  return float(net.allreduce(config.num_workers))


def diloco_outer(config) -> tuple[float, float] | None:
  """DiLoCo's outer optimizer, (lr, Nesterov momentum); None for every other algorithm."""
  if algorithms.get(config.algorithm).clock != algorithms.DILOCO:
    return None
  return float(config.diloco.outer_lr), float(config.diloco.outer_momentum)


def leave_plan(config) -> tuple:
  """hetero.leave as (worker, t_leave, t_rejoin) triples (docs/design.md 3.10); () without it."""
  return tuple(tuple(x) for x in config.hetero.get("leave", ()))


def adpsgd_cost(config) -> timeline.AdpsgdCost:
  tl = config.timeline
  return timeline.AdpsgdCost(
    bool(tl.adpsgd_serial),
    float(tl.adpsgd_fixed_cost),
    bool(tl.adpsgd_passive_blocks),
    float(tl.get("adpsgd_hidden", 1.0)),
  )


def run_clock(config, model_bytes: float, base_time: float) -> timeline.Trace:
  """The whole run's events: the clock alone, with the speeds, the network and the Group Generator."""
  speed, net = build_clock(config, model_bytes, base_time)
  gg = make_group_generator(config, np.random.default_rng([4, config.seed]))
  t_clock = time.time()
  tl = config.timeline
  spec = timeline.ClockSpec(
    config.algorithm,
    speed,
    net,
    config.num_steps * config.num_workers,
    time_budget=config.time_budget,
    gg=gg,
    seed=config.seed,
    inner_steps=config.diloco.inner_steps if diloco_outer(config) else 1,
    rtt=tl.request_rtt,
    ahead=config.schedule.request_ahead,
    adpsgd_cost=adpsgd_cost(config),
    server=timeline.AuthorityCost(tl.authority_service, tl.group_setup, tl.setup_unit),
    leave=leave_plan(config),
    detect=tl.get("detect_s", 0.0),
  )
  trace = timeline.simulate(spec)
  logging.info(
    "%s clock: %d events, %.1f virtual s, %.2f wall s; %d workers x %.4f s base step, %.0f model bytes",
    config.algorithm,
    len(trace.events),
    trace.end_time,
    time.time() - t_clock,
    config.num_workers,
    base_time,
    model_bytes,
  )
  return trace


def compact_round(r: dict, num_slots: int) -> dict:
  """A packed round (timeline.pack_rounds) as engine.make_compact_round_fn takes it: the slots it
  touches (applies and their sources, group members, pulls and their sources, starts), padded to a
  power of two C (one program per C), with group ids and pull sources as positions among them."""
  S, ar = num_slots, np.arange(num_slots)
  touched = r["start"] | r["reset"] if "reset" in r else r["start"].copy()
  for dst, src in (
    (r["apply_src"] >= 0, r["apply_src"]),
    (r["gid"] != ar, r["gid"]),
    (r["pull_src"] != ar, r["pull_src"]),
  ):
    touched |= dst
    touched[src[dst]] = True
  idx = np.flatnonzero(touched)
  A = len(idx)
  C = min(1 << max(A - 1, 0).bit_length(), S)
  pos = np.full(S, -1, np.int64)
  pos[idx] = np.arange(A)
  fill = lambda v, dtype: np.concatenate([np.asarray(v, dtype), np.arange(A, C, dtype=dtype)])
  out = {
    "idx": np.concatenate([idx, np.full(C - A, S)]).astype(np.int32),
    "apply_src": np.concatenate([r["apply_src"][idx], np.full(C - A, -1)]).astype(np.int32),
    "gid": fill(pos[r["gid"][idx]], np.int32),
    "pull_src": fill(pos[r["pull_src"][idx]], np.int32),
    "start": np.concatenate([r["start"][idx], np.zeros(C - A, bool)]),
  }
  if "reset" in r:
    out["reset"] = np.concatenate([r["reset"][idx], np.zeros(C - A, bool)])
  return out


@dataclasses.dataclass
class Rounds:
  """The executor's round programs: the full round (every slot, masks) for the rounds that touch more
  than half the slots and for the D-PSGD ring (it touches every worker), the compact round for the
  others. The two compute the same bits for every slot (tests/test_sim.py), so which one a round takes
  changes nothing but its cost. `programs`: the round shapes compiled (C of each compact one, and
  "full")."""

  full: object
  compact: object
  resets: bool = False  # hetero.leave: every round takes a reset mask (one program per shape)
  outer: bool = False  # DiLoCo: the full round takes outer_now (its outer step)
  programs: set = dataclasses.field(default_factory=set)


def execute(config, s: workload.Setup, state, cur: Loop, trace, mesh, log: RunLog, charge: float = 0.0):
  """The packed rounds from cur.round on; records, evaluations and checkpoints on the way."""
  n, has_server = config.num_workers, algorithms.get(config.algorithm).clock == algorithms.PS_ASYNC
  slots = n + has_server
  leaving = bool(leave_plan(config))
  rounds = Rounds(
    engine.make_sim_round_fn(
      s.model,
      s.optimizer,
      mesh,
      n,
      slots,
      cross_apply=has_server,
      ring=config.algorithm == "dpsgd",
      pull=has_server or leaving,  # a rejoined worker's first group is a pull (JOIN, 3.10)
      outer=diloco_outer(config),
    ),
    engine.make_compact_round_fn(s.model, s.optimizer, mesh, slots),
    leaving,
    diloco_outer(config) is not None,
  )
  # PS: the server's model; with leave/join, the live workers' (3.10)
  evaluate = make_evaluate(
    s,
    slice(n, n + 1) if has_server else slice(0, n),
    None if has_server or not leaving else trace.membership,
    config.eval_workers,
    global_model=algorithms.get(config.algorithm).consensus == algorithms.GLOBAL,
  )
  put = lambda a: jax.device_put(a, engine.worker_sharding(mesh))
  # ps.staleness=divide: every application's staleness, from the clock's order (the k-th APPLY is the
  # cur.applied-th gradient), so a resumed run scales as the uninterrupted one did.
  taus = (
    ps_async.staleness(trace.events, n) if has_server and workload.ps_staleness(config) == "divide" else None
  )
  total, every = config.num_steps * n, config.checkpoint_every
  starts = np.array(cur.starts, np.int64)
  next_ckpt = (cur.applied // n // every + 1) * every if every else None
  x_shape, x_dtype = (config.batch_size,) + s.data["x_train"].shape[1:], s.data["x_train"].dtype
  losses = []
  for i, r in enumerate(timeline.pack_rounds(trace.events, n, slots)):
    if i < cur.round:
      continue
    # A server round is apply -> pull -> start for one worker: the next push to the server ends it.
    assert not has_server or r["start"].sum() <= 1
    scale = None
    if taus is not None:  # the server's gradient at lr / its staleness (one APPLY per server round)
      scale = np.ones(slots, np.float32)
      scale[n] = np.float32(1.0 / taus[cur.applied]) if r["applied"] else 1.0
    state, loss_S = run_round(config, s, state, r, rounds, starts, put, x_shape, x_dtype, slots, scale)
    if r["start"][:n].any():
      losses.append(loss_S)
    starts += r["start"][:n]
    cur.round, cur.applied = i + 1, cur.applied + len(r["applied"])
    step = cur.applied // n
    # A record at every log_every and every eval_every step, whichever comes first: evaluations do not
    # wait for a log point.
    if step >= cur.next_log or step >= cur.next_eval or cur.applied >= total:
      record(config, cur, log, evaluate, state, step, r["time"], losses, cur.applied >= total, charge)
      losses = []
      if next_ckpt is not None and step >= next_ckpt:  # right after a record: no loss is pending
        next_ckpt = (step // every + 1) * every
        cur.starts = starts.tolist()
        log.checkpoint(step, state, dataclasses.asdict(cur), force=True)
      log.progress(min(step, config.num_steps))
      if config.get("stop_at_target") and cur.time_to_target is not None:
        break  # a time-to-accuracy run: the target is reached, the rest of the budget is not run
  if cur.evaluated_step != cur.applied // n:
    # A time budget ended the run between records: evaluate where it stopped.
    ev = evaluate(state, trace.end_time)
    log.record(cur.applied // n, trace.end_time, train_loss=log.last.get("train_loss"), **ev)
  cur.starts = starts.tolist()
  return state, cur, len(rounds.programs)


def run_round(config, s, state, r, rounds: Rounds, starts, put, x_shape, x_dtype, slots: int, scale=None):
  """One packed round on the device: batches for the workers that start (each at its own step) and
  only for them, then the compact round, or the full one for the ring, DiLoCo's outer step and rounds
  that touch more than half the slots (a compact round would pad them to all of them and pay its
  gathers). `scale`: each slot's gradient scale (ps.staleness=divide), None for none."""
  n = config.num_workers
  c = None if r["ring"] or r["outer"] else compact_round(r, slots)
  if c is None or (c["idx"] < slots).sum() > slots // 2:
    rounds.programs.add("full")
    x, y = (
      np.zeros((slots,) + x_shape, x_dtype),
      np.zeros((slots, config.batch_size), s.data["y_train"].dtype),
    )
    started = np.flatnonzero(r["start"][:n])
    if len(started):
      x[started], y[started] = batches(config, s, started, starts)
    args = (r["apply_src"], r["gid"], r["ring"], r["pull_src"], r["start"])
    if rounds.resets:
      args += (r.get("reset", np.zeros(slots, bool)),)
    kw = {"outer_now": r["outer"]} if rounds.outer else {}
    if scale is not None:
      kw["scale_S"] = put(scale)
    return rounds.full(
      state, put(x), put(y), *(put(a) if isinstance(a, np.ndarray) else a for a in args), **kw
    )
  C = len(c["idx"])
  rounds.programs.add(C)
  x, y = np.zeros((C,) + x_shape, x_dtype), np.zeros((C, config.batch_size), s.data["y_train"].dtype)
  rows = np.flatnonzero(c["start"])
  if len(rows):
    x[rows], y[rows] = batches(config, s, c["idx"][rows], starts)
  resets = (c.get("reset", np.zeros(C, bool)),) if rounds.resets else ()
  kw = {} if scale is None else {"scale_C": np.append(scale, np.float32(1))[c["idx"]]}  # padding: 1
  return rounds.compact(
    state, c["idx"], x, y, c["apply_src"], c["gid"], c["pull_src"], c["start"], *resets, **kw
  )


def batches(config, s, workers, starts):
  """The batch each of `workers` starts now: its shard's batch at its own step (data.batch_indices)."""
  idx = data_lib.batch_indices(
    [s.shards[w] for w in workers], config.batch_size, config.seed, starts[workers], workers=workers
  )
  return s.data["x_train"][idx], s.data["y_train"][idx]


def make_evaluate(
  s: workload.Setup, slots: slice, membership: list | None = None, workers: bool = True, global_model=False
):
  """(state, t) -> the evaluation scalars of the model held in `slots` (averaged over them; workers:
  and their own models' accuracies, config.eval_workers; global_model: DiLoCo's global model as
  consensus_accuracy, the model every worker holds after an outer step). With
  `membership` (trace.membership), over those of them live at virtual time t (3.10): a dead worker's
  stale model, or a rejoined one's before its first group, is no part of the run's model."""
  eval_fn = engine.make_eval_fn(s.model)
  x_test, y_test = jax.device_put((s.data["x_test"], s.data["y_test"]))
  val = jax.device_put((s.data["x_val"], s.data["y_val"])) if "x_val" in s.data else None

  def evaluate(state, t):
    pick = slots
    if membership:
      live = live_at(membership, slots.stop - slots.start, t)
      pick = slots if live.all() or not live.any() else np.flatnonzero(live) + slots.start
    held = jax.tree.map(lambda a: a[pick], state)
    out = {k: float(v) for k, v in eval_fn(held, x_test, y_test, workers).items()}
    if val is not None:  # the averaged model on the held-out examples: what a step size is chosen on
      out["val_accuracy"] = float(eval_fn(held, *val, workers=False)["test_accuracy"])
    if global_model:
      one = {
        "params": state["outer"]["params"],
        "model_state": jax.tree.map(lambda a: a[:1], state["model_state"]),
      }
      out["consensus_accuracy"] = float(eval_fn(one, x_test, y_test, False)["test_accuracy"])
      if val is not None:  # what a study tunes the deployable model on
        out["consensus_val_accuracy"] = float(eval_fn(one, *val, workers=False)["test_accuracy"])
    return out

  return evaluate


def live_at(membership: list, n: int, t: float) -> np.ndarray:
  """Which workers hold a model of the run at virtual time t: not after a leave, not between a
  rejoin and its first group."""
  live = np.ones(n, bool)
  for when, w, event in membership:
    if when > t:
      break
    live[w] = event == "first_group"  # leave and rejoin: no model of the run (yet)
  return live


def record(
  config, cur: Loop, log: RunLog, evaluate, state, step: int, t: float, losses, final: bool, charge=0.0
):
  """One metrics record at `step` (virtual time t), with an evaluation when one is due: the workers'
  mean model (test_accuracy, at t), the deployable one (consensus_accuracy at consensus_time = t + the
  All-Reduce that builds it, `charge`) and the workers' own (median, worst)."""
  n = config.num_workers
  cur.next_log = (step // config.log_every + 1) * config.log_every
  # The loss of the gradients started since the last record (a tail of apply-only rounds started
  # none: it repeats the last value rather than inventing one).
  loss = float(np.nanmean(np.asarray(jax.numpy.stack(losses))[:, :n])) if losses else log.last["train_loss"]
  ev = {}
  if step >= cur.next_eval or final:
    cur.next_eval = (step // config.eval_every + 1) * config.eval_every
    cur.evaluated_step = step
    ev = evaluate(state, t)
    if (
      cur.time_to_target is None and config.target_accuracy and ev["test_accuracy"] >= config.target_accuracy
    ):
      cur.time_to_target = t
    ev.setdefault("consensus_accuracy", ev["test_accuracy"])  # HELD or BUILT: the workers' mean
    if "val_accuracy" in ev:
      ev.setdefault("consensus_val_accuracy", ev["val_accuracy"])
    ev["consensus_time"] = t + charge
    target = config.target_accuracy
    if target and cur.consensus_time_to_target is None and ev["consensus_accuracy"] >= target:
      cur.consensus_time_to_target = t + charge
    if target and cur.worker_time_to_target is None and ev.get("worker_median_test_accuracy", -1) >= target:
      cur.worker_time_to_target = t
  log.record(step, t, train_loss=loss, **ev)

"""executor=hybrid/devices: R pipeline replicas x K stages on R*K devices of this process, on the wall
clock (docs/design.md 4.7).

Replica r's stage k lives on device r*K + k (pipeline/devices.py's per-stage programs, one device list
per replica) and replica r runs in a thread of its own: it ticks its pipeline, waits for the tick's
state, pads the tick to `replicas.pad_s` (times the slowdown when its slow device is in it: padded
ticks, so the run measures the protocol rather than two CPU cores shared by R*K devices), and at every
`sync_every`-th tick joins its group from the shared Group Buffer (hybrid/clock.py's Groups: Ripples'
protocol, schedule/online.Service, one generator for every stage). The last member to arrive averages
each stage k among the members, on the first member's stage-k device, and puts the mean back on every
member's stage-k device; the others wait for it. A replica's stages average only with the same stage of
the others.

The ticks are a budget shared by the replicas (the simulator's R x (ceil(batches / R) + drain)): a tick
is reserved before it starts; once none is left a replica that finishes its tick leaves instead of
syncing, and a group one of whose members left is abandoned. Every tick and average is logged, under
one lock, in the order it happened: each replica's own events in its order and an average after its
members' ticks, so the log replays through the simulator's numerics (hybrid/sim.py) to the run's
parameters (tests/test_hybrid.py). The run's model is sampled every eval_every steps (the replicas'
ticks over R), the replicas' current states copied to the host, and evaluated at the next consistent
cut (every checkpoint_every steps: `cut`, which the clock does not count) or after the run.
"""

import dataclasses
import threading
import time

import jax
import numpy as np
from absl import logging

from ripples_jax import data as data_lib
from ripples_jax.hybrid import clock as clock_lib
from ripples_jax.hybrid import sim
from ripples_jax.pipeline import baselines, devices, methods
from ripples_jax.runlog import RunLog, make_workdir


@dataclasses.dataclass
class Shared:
  """What the replica threads share, guarded by `cond`'s lock."""

  cond: threading.Condition
  groups: clock_lib.Groups  # its started_at and estimates are the two arrays below
  states: list  # each replica's newest state (the threads publish it after every tick)
  left: int  # ticks not yet reserved
  started_at: np.ndarray  # when each replica's tick started (or it reached its sync point)
  estimates: np.ndarray  # how long its current tick should take (0 at a sync point: ready now)
  last: np.ndarray  # each replica's newest tick time: its next tick's estimate, as the clock's
  ticks: np.ndarray
  reached: dict = dataclasses.field(default_factory=dict)  # group key -> members arrived
  finished: set = dataclasses.field(default_factory=set)  # group keys averaged
  gone: set = dataclasses.field(default_factory=set)  # replicas that left (no tick left for them)
  events: list = dataclasses.field(default_factory=list)  # hybrid/clock.py's: (wall s, TICK, r, i) | AVG
  avg_s: list = dataclasses.field(default_factory=list)  # each average's own seconds
  t0: float = 0.0  # the clock's origin: the wall clock less the cuts (a cut takes nothing from it)
  pause: bool = False  # a cut is being taken: no replica starts a tick
  paused: set = dataclasses.field(default_factory=set)  # replicas waiting for the cut to end
  waiting: dict = dataclasses.field(default_factory=dict)  # replica -> (group key, members) it waits in
  errors: list = dataclasses.field(default_factory=list)  # (replica, exception) of a thread that raised


def replica_devices(config) -> list[list]:
  """Devices of replica r's stages: r*K .. r*K + K - 1 of this process."""
  K, R = config.num_stages, config.replicas.count
  devs = devices.stage_devices(R * K)
  return [devs[r * K : (r + 1) * K] for r in range(R)]


def replica_tick(p, config, schedule, num_batches: int, devs: list):
  """One replica's tick on its devices; no donation: the sampler reads a published state while the
  thread ticks on."""
  if not methods.get(config.method).runs_tick("devices"):  # validated: gpipe, the one other there
    return devices.make_device_gpipe(p.stages, p.optimizer, config.microbatches, devs)
  make = devices.make_fused_device_tick if devices.fusable(schedule) else devices.make_device_tick
  return make(p.stages, p.optimizer, schedule, num_batches, devs, donate=False)


def slowed(config, r: int, now: float) -> float:
  """The factor replica r's tick is padded by at wall time `now` (its slow device; 1 otherwise)."""
  c = config.replicas
  slow = clock_lib.slow_device(tuple(c.slow), c.slowdown, c.count, c.rotate_every, now)
  return float(c.slowdown) if slow is not None and slow[0] == r else 1.0


def replica_loop(config, p, r: int, tick, shard, offset: int, sh: Shared) -> None:
  """Replica r: reserve a tick, run and pad it, publish it, sync; until the budget is spent. A cut
  holds it only here, before a tick, or waiting in a group (wait_for): a group that needs a member
  held before its tick is part of the cut, half reached, and resumed as such."""
  B, seed, i = config.batch_size, config.seed, int(sh.ticks[r])  # resumed: its next batch
  idx = lambda j: data_lib.batch_indices([shard], B, seed, j, workers=[r])[0]
  if not rejoin_group(r, sh):
    return
  while True:
    with sh.cond:
      while sh.pause:
        sh.paused.add(r)
        sh.cond.notify_all()
        sh.cond.wait()
      sh.paused.discard(r)
      state = sh.states[r]  # a cut may have settled it
      if sh.left <= 0:  # nothing left to reserve: leave; groups waiting on r are abandoned
        sh.gone.add(r)
        sh.cond.notify_all()
        return
      sh.left -= 1
      start = time.perf_counter() - sh.t0
      sh.started_at[r], sh.estimates[r] = start, sh.last[r]
    x, y = p.data["x_train"][idx(i)], p.data["y_train"][idx(max(i - offset, 0))]
    state, metrics = tick(state, x, y, i)
    jax.block_until_ready((state, metrics))
    pad = config.replicas.pad_s * slowed(config, r, start)
    rest = start + pad - (time.perf_counter() - sh.t0)
    if rest > 0:
      time.sleep(rest)
    with sh.cond:
      now = time.perf_counter() - sh.t0
      sh.states[r], sh.last[r] = state, now - start
      sh.ticks[r] += 1
      sh.events.append((now, clock_lib.TICK_END, r, i))
    i += 1
    if i % config.replicas.sync_every == 0:
      if not sync(r, i // config.replicas.sync_every - 1, sh):
        with sh.cond:
          sh.gone.add(r)
          sh.cond.notify_all()
        return


def rejoin_group(r: int, sh: Shared) -> bool:
  """Replica r, resumed inside a group, waits there again; False if the group was abandoned. Its last
  member may have arrived before r's thread started (threads start in no set order): the group is then
  out of `reached`, complete, and r waits only for its averages."""
  with sh.cond:
    if r not in sh.waiting:
      return True
    key, members = sh.waiting[r]
    if wait_for(r, key, members, sh.reached.get(key, set(members)), sh):
      return True
    sh.gone.add(r)
    sh.cond.notify_all()
    return False


def replica_thread(config, p, r: int, tick, shard, offset: int, sh: Shared) -> None:
  """replica_loop, whose error ends the run (monitor raises it) instead of leaving the replicas that wait
  in its groups waiting on a thread that is gone: it leaves, and no tick is reserved after it."""
  try:
    replica_loop(config, p, r, tick, shard, offset, sh)
  except BaseException as e:  # noqa: BLE001  (re-raised by monitor, in the main thread)
    with sh.cond:
      sh.errors.append((r, e))
      sh.gone.add(r)
      sh.left = 0
      sh.cond.notify_all()


def stopped(sh: Shared) -> set:
  """(With the lock.) The replicas a cut may be taken around: held before a tick, gone, or waiting in a
  group not yet averaged. A member whose group has finished is not stopped until it holds itself: its
  published state is already the average, and the group (out of `reached` since its last member
  arrived) could not be waited in again on resume."""
  return sh.paused | sh.gone | {r for r, (key, _) in sh.waiting.items() if key not in sh.finished}


def sync(r: int, count: int, sh: Shared) -> bool:
  """Replica r at its count-th sync point: its group's averages (run by the last member to arrive);
  False if the group was abandoned (a member left) or the budget ran out before r got here."""
  with sh.cond:
    if sh.left <= 0:
      return False
    now = time.perf_counter() - sh.t0
    sh.started_at[r], sh.estimates[r] = now, 0.0  # ready now (Smart GG reads this)
    g = sh.groups.head(r, count, now)
    if g is None:
      return True
    key = g.gid if g.gid >= 0 else (g.request, g.members)
    got = sh.reached.setdefault(key, set())
    got.add(r)
    if len(got) < len(g.members):
      return wait_for(r, key, g.members, got, sh)
    del sh.reached[key]
  averaged = average_group(g, sh)  # outside the lock: the members wait on `finished`, the rest run on
  with sh.cond:
    for m, state in averaged.items():
      sh.states[m] = state
    sh.events.append((time.perf_counter() - sh.t0, clock_lib.AVG, g.members, None))
    sh.finished.add(key)
    for m in g.members:
      sh.groups.done(m, g.gid)
    sh.cond.notify_all()
  return True


def wait_for(r: int, key, members, got: set, sh: Shared) -> bool:
  """(With the lock.) Replica r, arrived at its group, waits for the last member's averages; False if
  a member left before reaching it. A waiting replica counts as stopped for a cut (its tick is done
  and published; the group may need a member that the cut holds before its tick)."""
  sh.waiting[r] = (key, tuple(members))
  sh.cond.notify_all()
  try:
    while key not in sh.finished:
      if any(m in sh.gone and m not in got for m in members):
        return False
      sh.cond.wait()
    return True
  finally:
    del sh.waiting[r]


@jax.jit
def _mean(parts):
  """The members' mean, leaf by leaf, in the members' order (one program per group size and device)."""
  return jax.tree.map(lambda *a: sum(a[1:], a[0]) / len(a), *parts)


def average_group(g, sh: Shared) -> dict:
  """{member: its state with each stage's parameters and model state averaged among the members}: the
  mean on the first member's device of that stage, put back on every member's device of that stage.
  The members' states are not touched until the caller publishes these (the sampler reads them)."""
  t = time.perf_counter()
  members = list(g.members)
  out = {m: list(sh.states[m]) for m in members}
  for k in range(len(sh.states[members[0]])):
    home = _device(sh.states[members[0]][k])
    parts = [jax.device_put({key: sh.states[m][k][key] for key in sim.AVERAGED}, home) for m in members]
    mean = _mean(parts)
    for m in members:
      out[m][k] = dict(out[m][k], **jax.device_put(mean, _device(sh.states[m][k])))
  jax.block_until_ready(list(out.values()))
  sh.avg_s.append(time.perf_counter() - t)
  return out


def _device(stage_state):
  return jax.tree.leaves(stage_state["params"])[0].device


def sample(sh: Shared) -> list:
  """The replicas' published states (taken together under the lock: never half an average), copied to
  the host (parameters and model state only)."""
  with sh.cond:
    states = list(sh.states)
  return [[{k: jax.device_get(st[k]) for k in sim.AVERAGED} for st in state] for state in states]


def run(config, workdir: str | None = None) -> dict:
  """executor=hybrid/devices (run.EXECUTORS): the summary of train_replicas."""
  return train_replicas(config, workdir)[0]


@dataclasses.dataclass
class Monitor:
  """The main thread's loop state: samples not yet evaluated, the next sample's and cut's steps."""

  pending: list
  next_eval: int
  next_cut: int | None
  time_to_target: float | None = None


def train_replicas(config, workdir: str | None = None):
  """The replicas' threads on the wall clock, the main thread sampling the run's model every eval_every
  steps and taking a consistent cut every checkpoint_every (records of the samples, then a checkpoint;
  resumed from); returns (summary, the final state stacked over replicas as the simulator holds it,
  the run's event log, resumed runs' included)."""
  R, K = config.replicas.count, config.num_stages
  workdir = make_workdir(workdir, config)
  h = sim.build_replicas(config, workdir)  # the simulator's setup and budget of ticks
  p, one, schedule, per_replica = h.p, h.one, h.schedule, h.per_replica
  devs = replica_devices(config)
  ticks = [replica_tick(p, config, schedule, R * per_replica, d) for d in devs]
  pad = float(config.replicas.pad_s)
  groups = clock_lib.Groups(R, sim.make_generator(config), estimate=pad)
  sh = Shared(
    threading.Condition(),
    groups,
    [devices.place(one, d) for d in devs],
    R * per_replica,
    groups.started_at,
    groups.estimates,
    np.full(R, pad),
    np.zeros(R, np.int64),
  )
  every = config.checkpoint_every
  with RunLog(workdir, config, per_replica) as log:
    mon = Monitor([], config.eval_every, every or None)
    got = log.restore(stacked(sh.states))
    if got is not None:
      resume_cut(config, sh, mon, devs, got)
    warm_up(config, p, ticks, sh)
    shards = data_lib.shard_indices(p.data["y_train"], R, "iid", seed=config.seed)
    offset = schedule.offsets[-1] if schedule else 0
    threads = [
      threading.Thread(
        target=replica_thread, args=(config, p, r, ticks[r], shards[r], offset, sh), daemon=True
      )
      for r in range(R)
    ]
    sh.t0 = time.perf_counter() - sh.t0  # resumed: the clock goes on from the cut's time
    for t in threads:
      t.start()
    evaluator = make_evaluator(config, p)
    monitor(config, threads, ticks, sh, log, evaluator, mon)
    end = max(e[0] for e in sh.events)
    for r, tick in enumerate(ticks):  # the fused tick's pending arrivals into their FIFOs
      sh.states[r] = getattr(tick, "settle", lambda s: s)(sh.states[r])
    logging.info(
      "hybrid/devices R=%d K=%d: %d events in %.2f s; ticks %s", R, K, len(sh.events), end, sh.ticks
    )
    flush(log, evaluator, mon, config.replicas.target_accuracy)
    summary = log.finish(
      time=end,
      worker_steps=sh.ticks.tolist(),
      replicas=R,
      num_stages=K,
      method=config.method,
      algorithm=config.replicas.algorithm,
      placement="devices",
      groups=sum(e[1] == clock_lib.AVG for e in sh.events),
      average_s=float(np.mean(sh.avg_s)) if sh.avg_s else 0.0,
      pad_s=pad,
      time_to_target=mon.time_to_target,
      target_accuracy=config.replicas.target_accuracy,
    )
  return summary, stacked(sh.states), sh.events


def stacked(states: list):
  """The replicas' states stacked on a leading axis, on the host (what a checkpoint holds)."""
  return jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *states)


def cut_cursor(sh: Shared, mon: Monitor) -> dict:
  """A cut's metadata: where every replica stands, the buffer, the events so far, the clock."""
  return {
    "ticks": sh.ticks.tolist(),
    "left": int(sh.left),
    "gone": sorted(sh.gone),
    "last": sh.last.tolist(),
    "space": sh.groups.state(),
    "reached": [[_key_json(k), sorted(v)] for k, v in sh.reached.items()],
    "waiting": [[r, _key_json(k), list(m)] for r, (k, m) in sh.waiting.items()],
    "events": [[t, kind, x if kind == clock_lib.AVG else [x, y[0]]] for t, kind, x, *y in sh.events],
    "avg_s": list(sh.avg_s),
    "time": time.perf_counter() - sh.t0,
    "next_eval": mon.next_eval,
    "time_to_target": mon.time_to_target,
  }


def _key_json(key):
  return key if isinstance(key, int) else [key[0], list(key[1])]


def _key(j):
  """A group's key back from JSON: a buffer group's gid, or a fixed schedule's (request, members)."""
  return j if isinstance(j, int) else (j[0], tuple(j[1]))


def resume_cut(config, sh: Shared, mon: Monitor, devs, got) -> None:
  """The run from its newest cut: states placed back on their devices, the buffer, the events."""
  _, state, c = got
  R = config.replicas.count
  sh.states = [devices.place(jax.tree.map(lambda a: a[r], state), devs[r]) for r in range(R)]
  sh.ticks[:], sh.left, sh.gone, sh.last[:] = c["ticks"], c["left"], set(c["gone"]), c["last"]
  sh.groups.load(c["space"])
  sh.reached = {_key(k): set(v) for k, v in c["reached"]}
  sh.waiting = {r: (_key(k), tuple(m)) for r, k, m in c["waiting"]}
  sh.events = [
    (t, clock_lib.AVG, tuple(x), None)
    if kind in (clock_lib.AVG, "avg")
    else (t, clock_lib.TICK_END, x[0], x[1])
    for t, kind, x in c["events"]  # "avg", "tick": a cut written before the events took the timeline's kinds
  ]
  sh.avg_s, sh.t0 = list(c["avg_s"]), c["time"]
  mon.next_eval, mon.time_to_target = c["next_eval"], c["time_to_target"]
  every = config.checkpoint_every
  mon.next_cut = (int(sh.ticks.sum()) // R // every + 1) * every


def warm_up(config, p, ticks, sh: Shared) -> None:
  """Every program compiled before the clock starts: each replica's tick (on a copy, thrown away) and
  the mean of every group size on every device (a group's first average would otherwise stop its
  members for the compile: measured 0.5-1.8 s on the first groups of a 4 x 2 run)."""
  x = np.zeros((config.batch_size,) + p.data["x_train"].shape[1:], p.data["x_train"].dtype)
  y = np.zeros(config.batch_size, p.data["y_train"].dtype)
  for r, tick in enumerate(ticks):
    copy = jax.tree.map(lambda a: a.copy(), sh.states[r])
    for t in range(3):  # the fused tick's first call has no arrivals yet: its steady program is the next
      copy, metrics = tick(copy, x, y, t)
    jax.block_until_ready((copy, metrics))
    getattr(tick, "settle", lambda s: s)(copy)
    for st in sh.states[r]:
      one = {key: st[key] for key in sim.AVERAGED}
      for size in sim.replica_group_sizes(config):
        jax.block_until_ready(_mean([one] * size))


def monitor(config, threads, ticks, sh: Shared, log: RunLog, evaluator, mon: Monitor) -> None:
  """Samples every eval_every steps and cuts every checkpoint_every until the threads are done; the
  run's end is always sampled."""
  R = config.replicas.count
  while any(t.is_alive() for t in threads):
    done = int(sh.ticks.sum()) // R
    if done >= mon.next_eval:
      mon.pending.append((time.perf_counter() - sh.t0, done, sample(sh)))
      mon.next_eval = (done // config.eval_every + 1) * config.eval_every
    if mon.next_cut is not None and done >= mon.next_cut and sh.left > 0:
      cut(config, ticks, sh, log, evaluator, mon)
      mon.next_cut = (int(sh.ticks.sum()) // R // config.checkpoint_every + 1) * config.checkpoint_every
    time.sleep(0.002)
  for t in threads:
    t.join()
  if sh.errors:
    r, e = sh.errors[0]
    raise RuntimeError(f"hybrid/devices: replica {r}'s thread failed ({type(e).__name__}: {e})") from e
  final = int(sh.ticks.sum()) // R
  last = max(e[0] for e in sh.events)
  if final > log.last.get("step", -1) and (not mon.pending or mon.pending[-1][1] < final):
    mon.pending.append((last, final, sample(sh)))


def cut(config, ticks, sh: Shared, log: RunLog, evaluator, mon: Monitor) -> None:
  """A consistent cut: every replica stopped before its next tick or waiting in its group, the
  fused ticks' pending arrivals settled, the samples so far and one at the cut recorded, the state and
  the cursor checkpointed; the clock does not count it."""
  with sh.cond:
    sh.pause = True
    while len(stopped(sh)) < len(sh.states):
      sh.cond.wait()
    began = time.perf_counter()
    for r, tick in enumerate(ticks):
      sh.states[r] = getattr(tick, "settle", lambda s: s)(sh.states[r])
    step = int(sh.ticks.sum()) // config.replicas.count
    states = list(sh.states)
    mon.pending.append(
      (began - sh.t0, step, [[{k: jax.device_get(st[k]) for k in sim.AVERAGED} for st in s] for s in states])
    )
    flush(log, evaluator, mon, config.replicas.target_accuracy)
    log.checkpoint(step, stacked(states), cut_cursor(sh, mon), force=True)
    sh.t0 += time.perf_counter() - began
    sh.pause = False
    sh.cond.notify_all()


def make_evaluator(config, p):
  """(host states of every replica) -> the record's scalars: the run's model (sim.run_models) on the
  test split and, when held out, the validation split."""
  evaluate = baselines.make_eval(p.stages)
  splits = {"test": jax.device_put((p.data["x_test"], p.data["y_test"]))}
  if "x_val" in p.data:
    splits["val"] = jax.device_put((p.data["x_val"], p.data["y_val"]))

  def scalars(states) -> dict:
    out = {}
    models = sim.run_models(config, stacked(states))
    for split, xy in splits.items():
      acc, loss = np.mean([jax.device_get(evaluate(m, *xy)) for m in models], 0)
      out.update({f"{split}_accuracy": float(acc), f"{split}_loss": float(loss)})
    return out

  return scalars


def flush(log: RunLog, evaluator, mon: Monitor, target: float) -> None:
  """The pending samples evaluated and recorded, in order."""
  for t, step, states in mon.pending:
    if step <= log.last.get("step", -1):
      continue  # a cut's own sample at a step already recorded
    scalars = evaluator(states)
    if mon.time_to_target is None and target and scalars["test_accuracy"] >= target:
      mon.time_to_target = t
    log.record(step, t, **scalars)
  mon.pending = []

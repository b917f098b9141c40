r"""executor=hybrid/per_process: R pipeline replicas x K stages, one process per (replica, stage) under the
launcher, and the coordinator (docs/design.md 4.7).

  python -m experiments.launch --num_processes=8 --module=experiments.train_dsp -- \
      --config=configs/dsp.py:method=dsp,num_stages=2 --config.placement=per_process \
      --config.replicas.count=4 --config.replicas.pad_s=0.1 --workdir=runs/hybrid_mp

Who is who: process 0 is the coordinator (it hosts the coordination service and the Group Generator's
service, trains nothing, owns metrics.jsonl and summary.json); replica r's stage k is process
1 + r * K + k (`process_of`), its pipeline the pipeline runtime's (pipeline/per_process.py: Stage, its
links to its replica's neighbouring stages, each a collective over the two processes' devices).

The protocol (the jax.distributed key-value store; one Group Buffer and generator for every stage, as
hybrid/clock.py explains: per-stage generators deadlock):
  hyb/req/<r>/<s>   replica r's stage 0 at its s-th sync point (after tick (s + 1) * sync_every - 1):
                    "<time> <its last tick's seconds> <the last group id it averaged>"
  hyb/e/<r>/<s>     the service's answer, read by every stage of replica r (`encode`): groups to
                    average (G), markers (E: a snapshot of every stage's parameters; a checkpoint when
                    its step is a multiple of checkpoint_every), STOP (S). An empty entry: tick on.
A group's stage k averages among the members' stage-k processes only (a GroupAverager over their devices,
runtime/preduce.py): stages never mix. Every member set a replica can be in is connected before the clock
starts, in one global order (gloo's first use of a context waits for all its members).

Why nothing cycles: every stage of a replica executes the same entries in the same order, each stage's
groups are a subsequence of the Group Buffer's one order, and a link transfer waits only for a
neighbour at an earlier tick or an earlier group of the same replica (hybrid/clock.py's argument, per
stage). Fixed schedules (All-Reduce, Static GG) take the group of the sync point's index.

The budget of ticks is the simulator's (hybrid/sim.build): R x per-replica ticks in all. Dynamic
generators and none share it (a replica reserves sync_every ticks with each answer; once it is spent,
each replica gets its pending groups and STOP, and no group is generated); a fixed schedule's replicas
tick in step, each per_replica ticks.

Markers: once the replicas' ticks over R pass a multiple of eval_every, marker c enters every replica's
entries at one cut of the buffer's order: dynamic, after the groups created before it (each replica's
marker comes once it has no such group pending, before any later one); fixed, at the first sync index no
replica has been answered for, before that index's group. So the snapshot (and checkpoint) at c is a
consistent cut across replicas; across the stages of a replica it is the lockstep one (each stage
settles its links at the same tick). The record's time is the latest stage's snapshot time; the
coordinator evaluates the snapshots after the run (the clock never pauses for it).

Resume: from the newest marker every process checkpointed and whose service state the coordinator
saved (ckpt_hybrid/<c>/): every process restores its stage, cuts its trace back to the marker, the
service restarts from its state at the marker with every group of the cut done, and the clock goes on
from the latest process's marker time. Each replica asks again at its marker's sync point.
"""

import dataclasses
import itertools
import json
import os
import queue
import signal
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ripples_jax import data as data_lib
from ripples_jax.distributed import coord
from ripples_jax.distributed.arrays import LOCAL, WORKER
from ripples_jax.distributed.host import pin_threads
from ripples_jax.hybrid import clock as clock_lib
from ripples_jax.hybrid import sim
from ripples_jax.pipeline import baselines
from ripples_jax.pipeline.link import stage_device
from ripples_jax.pipeline.per_process import Stage
from ripples_jax.runlog import RunLog, make_workdir
from ripples_jax.runtime.preduce import GroupAverager
from ripples_jax.schedule import group_gen

PREFIX = f"{coord.PREFIX}/hyb"
CKPT = "ckpt_hybrid"


def process_of(r: int, k: int, K: int) -> int:
  """The process of replica r's stage k (process 0: the coordinator)."""
  return 1 + r * K + k


def encode(items) -> str:
  out = []
  for it in items:
    if it[0] == "G":
      out.append(f"G {it[1]} {','.join(str(m) for m in it[2])}")
    elif it[0] == "E":
      out.append(f"E {it[1]} {int(it[2])}")
    else:
      out.append("S")
  return ";".join(out)


def decode(text: str) -> list:
  items = []
  for part in filter(None, text.split(";")):
    kind, *rest = part.split()
    if kind == "G":
      items.append(("G", int(rest[0]), tuple(int(m) for m in rest[1].split(","))))
    elif kind == "E":
      items.append(("E", int(rest[0]), bool(int(rest[1]))))
    else:
      items.append(("S",))
  return items


def run(config, workdir: str) -> dict:
  """This process's part (run.EXECUTORS): the coordinator on process 0, a stage elsewhere."""
  return coordinate(config, workdir) if jax.process_index() == 0 else stage(config, workdir)


# --- The Group Generator's service (the coordinator) ------------------------------------------------


class Service:
  """Answers each replica's requests in arrival order (one listener thread per replica); see the module
  docstring for the rules. `clock()`: the run's time."""

  def __init__(self, config, kv, per_replica: int, total: int, clock, on_checkpoint=None):
    c = config.replicas
    self.on_checkpoint = on_checkpoint or (lambda c, state: None)
    self.config, self.kv, self.clock = config, kv, clock
    self.R, self.E, self.per_replica = c.count, c.sync_every, per_replica
    self.space = clock_lib.Space(self.R, sim.make_generator(config))
    self.fixed = self.space.fixed
    self.left = total - self.R * self.E  # ticks not yet reserved (each replica's first block is)
    self.ticks = np.zeros(self.R, np.int64)
    self.started_at, self.estimates = np.zeros(self.R), np.full(self.R, float(c.pad_s))
    self.answered = np.full(self.R, -1, np.int64)
    self.marks = [[] for _ in range(self.R)]  # per replica: [(marker, cut)] not yet emitted
    self.next_mark = 1
    self.cut = {}  # marker -> its cut: the buffer's group count (dynamic) or sync index (fixed)
    self.stopped, self.error = set(), None
    self._requests, self._stop = queue.Queue(), threading.Event()
    self.first_sync = np.zeros(self.R, np.int64)  # resumed: each replica asks first at its marker's

  def state(self) -> dict:
    return {
      "space": self.space.state(),
      "next_mark": self.next_mark,
      "answered": self.answered.tolist(),
    }

  def load(self, state: dict, cursors: list) -> None:
    """The state at a checkpoint marker; `cursors`: each replica's stage-0 checkpoint there. Every group
    created before the marker was executed by its members before their checkpoint: none is pending."""
    self.space.load(state["space"])
    for r in range(self.R):
      self.space.buffer.done(r, self.space.buffer.count - 1)
    self.next_mark = state["next_mark"]
    self.ticks[:] = [c["tick"] for c in cursors]
    self.answered[:] = [c["sync"] - 1 for c in cursors]
    self.first_sync[:] = [c["sync"] for c in cursors]
    self.left = int(self.config.replicas.count * self.per_replica - self.ticks.sum())

  def start(self):
    self._threads = [threading.Thread(target=self._listen, args=(r,), daemon=True) for r in range(self.R)]
    self._threads.append(threading.Thread(target=self._serve, daemon=True))
    for t in self._threads:
      t.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def done(self) -> bool:
    return len(self.stopped) == self.R or self.error is not None

  def _listen(self, r: int) -> None:
    s = int(self.first_sync[r])
    while not self._stop.is_set() and r not in self.stopped:
      try:
        value = self.kv.blocking_key_value_get(f"{PREFIX}/req/{r}/{s}", 1000)
      except Exception:  # noqa: BLE001  not yet asked (the get timed out): ask the store again
        continue
      self._requests.put((r, s, value))  # its next request follows this one's answer
      s += 1

  def _serve(self) -> None:
    try:
      while not self._stop.is_set() and len(self.stopped) < self.R:
        try:
          r, s, value = self._requests.get(timeout=0.5)
        except queue.Empty:
          continue
        _, tick_s, last_gid = value.split()
        items = self.answer(r, s, float(tick_s), int(last_gid))
        self.kv.key_value_set(f"{PREFIX}/e/{r}/{s}", encode(items))
    except Exception as e:  # noqa: BLE001  the coordinator's main thread reports it
      self.error = e
      logging.exception("the hybrid's Group Generator service stopped")

  def answer(self, r: int, s: int, tick_s: float, last_gid: int) -> list:
    """Replica r at its s-th sync point: the items of its entry."""
    now = self.clock()
    if last_gid >= 0:
      self.space.buffer.done(r, last_gid)
    self.ticks[r], self.answered[r] = (s + 1) * self.E, s
    self.started_at[r], self.estimates[r] = now, 0.0  # ready now (Smart GG reads this)
    self.new_marks(now)
    items = self.fixed_items(r, s) if self.fixed else self.dynamic_items(r, s, now)
    if items and items[-1][0] == "S":
      self.stopped.add(r)
    else:
      self.started_at[r], self.estimates[r] = now, tick_s  # it ticks on from here
    return items

  def new_marks(self, now: float) -> None:
    """Markers whose step the replicas' ticks have passed (none once the budget is spent: the end is
    recorded anyway)."""
    every, R = self.config.eval_every, self.R
    while self.ticks.sum() >= self.next_mark * every * R and self.left >= self.E and not self.stopped:
      c = self.next_mark
      cut = int(self.answered.max()) + 1 if self.fixed else self.space.buffer.count
      self.cut[c] = cut
      for r in range(R):
        self.marks[r].append((c, cut))
      if self.saves(c):  # written before any entry holds c: every stage's checkpoint at c has it
        self.on_checkpoint(c, dict(self.state(), next_mark=c + 1))
      self.next_mark += 1

  def saves(self, c: int) -> bool:
    every = self.config.checkpoint_every
    return bool(every) and (c * self.config.eval_every) % every == 0

  def emit(self, r: int, c: int) -> tuple:
    return ("E", c, self.saves(c))

  def fixed_items(self, r: int, s: int) -> list:
    """All-Reduce, Static GG: the group of index s; every replica stops after per_replica ticks."""
    marks = self.marks[r]
    stop = (s + 1) * self.E >= self.per_replica
    items = [self.emit(r, c) for c, j in marks if j <= s or stop]
    self.marks[r] = [(c, j) for c, j in marks if not (j <= s or stop)]
    if stop:
      return items + [("S",)]
    view = group_gen.GGView(self.clock(), self.space.buffer, self.started_at, self.estimates, None)
    g = self.space.head(r, s, view)
    return items + ([("G", -1, g.members)] if g is not None else [])

  def dynamic_items(self, r: int, s: int, now: float) -> list:
    """Ripples' generators and none: the head of r's queue (generated when empty), or once the budget
    is spent, every group still pending for r and STOP."""
    buffer = self.space.buffer
    stop = self.left < self.E
    if not stop:
      self.left -= self.E
      view = group_gen.GGView(now, buffer, self.started_at.copy(), self.estimates.copy(), None)
      g = self.space.head(r, s, view)
      run = [g] if g is not None else []
    else:
      run = list(buffer.queues[r]) if self.space.gen is not None else []
    rest = [q for q in buffer.queues[r] if all(q.gid != g.gid for g in run)]
    items = []
    for g in run:
      for c, cut in list(self.marks[r]):
        if g.gid >= cut:  # a group after the cut: the marker first
          items.append(self.emit(r, c))
          self.marks[r].remove((c, cut))
      items.append(("G", g.gid, g.members))
    for c, cut in list(self.marks[r]):
      if stop or all(q.gid >= cut for q in rest):  # nothing of the cut left pending for r
        items.append(self.emit(r, c))
        self.marks[r].remove((c, cut))
    return items + ([("S",)] if stop else [])


def member_sets(config, r: int) -> list:
  """Every member set replica r can average in, in one global order (warm-up connects each)."""
  c, R = config.replicas, config.replicas.count
  gen = sim.make_generator(config)
  if gen is None:
    return []
  if isinstance(gen, group_gen.Fixed):
    sets = sorted({tuple(sorted(g)) for layout in gen.layouts for g in layout if len(g) > 1})
  else:
    sets = [s for n in range(2, min(c.group_size, R) + 1) for s in itertools.combinations(range(R), n)]
  return [s for s in sets if r in s]


# --- A stage process ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Loop:
  """Where this stage stands; its checkpoint's cursor."""

  tick: int = 0  # the next tick
  sync: int = 0  # the next sync point's index
  last_gid: int = -1  # the newest group it averaged (the service's `done`)
  time: float = 0.0  # the run's clock at the checkpoint
  trace_lines: int = 0
  ask_first: bool = False  # resumed at a sync point: its entry is asked for again before any tick


class Trace:
  """trace-<r>-<k>.jsonl: this stage's ticks, averages and markers, written through (a crash keeps them)."""

  def __init__(self, workdir: str, r: int, k: int, keep: int | None = None):
    self.path = os.path.join(workdir, f"trace-{r}-{k}.jsonl")
    lines = open(self.path).read().splitlines() if keep is not None and os.path.exists(self.path) else []
    with open(self.path, "w") as f:  # resumed: cut back to the marker's line
      f.writelines(line + "\n" for line in lines[:keep])
    self.lines = len(lines[:keep])
    self.f = open(self.path, "a")

  def add(self, **event) -> None:
    self.f.write(json.dumps(event) + "\n")
    self.f.flush()
    self.lines += 1

  def close(self) -> None:
    self.f.close()


def slowed(config, r: int, k: int, now: float) -> float:
  c = config.replicas
  slow = clock_lib.slow_device(tuple(c.slow), c.slowdown, c.count, c.rotate_every, now)
  return float(c.slowdown) if slow == (r, k) else 1.0


def stage(config, workdir: str) -> dict:
  """Replica r's stage k: warm-up, the start barrier, ticks and entries until STOP, the final state."""
  me, K, R = jax.process_index(), config.num_stages, config.replicas.count
  r, k = divmod(me - 1, K)
  sigterm = coord.SigtermStop().install()
  rt = config.runtime
  if rt.pin_cores and hasattr(os, "sched_getaffinity"):
    cores = sorted(os.sched_getaffinity(0))
    pin_threads({cores[(me - 1) % len(cores)]})
  workdir = make_workdir(workdir, config)
  h = sim.build(config, workdir)
  p = h.p
  sp = Stage(
    config, p.stages, p.optimizer, h.total, p.feed.sample, p.data["x_test"], base=process_of(r, 0, K)
  )
  kv = coord.client()
  local = Mesh(np.array([[sp.device]]), (WORKER, LOCAL))
  averager = GroupAverager(local, {m: [stage_device(process_of(m, k, K))] for m in range(R)}, 256)
  resumed = int(kv.blocking_key_value_get(f"{PREFIX}/resume", int(rt.stall_timeout * 4000)))
  loop = Loop()
  if resumed > 0:
    loop = restore(sp, workdir, resumed, r, k)
  trace = Trace(workdir, r, k, keep=loop.trace_lines if resumed > 0 else None)
  warm_up(config, sp, averager, r, k, p)
  progress = {"ticks": loop.tick, "done": False}
  watchdog = coord.Watchdog(
    kv,
    me - 1,
    R * K,
    lambda: (progress["ticks"], progress["ticks"], progress["done"]),
    rt.heartbeat_s,
    rt.heartbeat_timeout,
    rt.stall_timeout,
    role="stage",
    hosts_service=False,
    service_host=f"the {coord.COORDINATOR}",
  )
  sigterm.watchdog = watchdog
  kv.wait_at_barrier(f"{PREFIX}/start", int(rt.stall_timeout * 4000))
  t0 = time.perf_counter() - float(kv.blocking_key_value_get(f"{PREFIX}/t0", 60_000))
  clock = lambda: time.perf_counter() - t0  # noqa: E731
  watchdog.start()
  try:
    run_stage(config, sp, averager, kv, trace, loop, progress, clock, (r, k), workdir, p)
    sp.links.close()
  except Exception:
    watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)
    raise
  trace.add(k="end", t=clock(), tick=loop.tick, compiles=averager.compiles, ahead_s=averager.ahead_s)
  trace.close()
  np.save(snapshot_path(workdir, "final", r, k), np.asarray(flat_of(sp.state)[0]))
  progress["done"] = True
  kv.wait_at_barrier(f"{PREFIX}/end", int(10 * rt.stall_timeout * 1000))
  watchdog.stop()
  return {"method": config.method, "stage": k, "replica": r, "workdir": workdir, "time": clock()}


def flat_of(st):
  """(flat, unravel) of a stage's averaged part (parameters and model state)."""
  return ravel_pytree({key: st[key] for key in sim.AVERAGED})


def snapshot_path(workdir: str, name, r: int, k: int) -> str:
  folder = os.path.join(workdir, "snapshots", str(name))
  os.makedirs(folder, exist_ok=True)
  return os.path.join(folder, f"{r}-{k}.npy")


def warm_up(config, sp: Stage, averager, r: int, k: int, p) -> None:
  """Before the clock: three ticks on a copy (both ends of each link run them: the programs compile and
  the links connect), then every member set's average program, in one global order."""
  B = config.batch_size
  x = np.zeros((B,) + p.data["x_train"].shape[1:], p.data["x_train"].dtype) if k == 0 else None
  y = np.zeros(B, p.data["y_train"].dtype) if sp.last else None
  ring = list(sp.ring)
  copy = jax.tree.map(lambda a: a.copy(), sp.state)
  sp.links.load_slots(copy)
  for t in range(3):
    copy, _ = sp.tick(copy, x, y, t)
  sp.links.settle(copy)
  sp.ring.clear()
  sp.ring.extend(ring)
  sp.links.load_slots(sp.state)
  flat = jax.device_put(flat_of(sp.state)[0], NamedSharding(averager.local_mesh, P()))
  for members in member_sets(config, r):
    averager.connect(members, flat)


def run_stage(config, sp: Stage, averager, kv, trace, loop: Loop, progress, clock, rk, workdir, p) -> None:
  """Ticks and entries until STOP. runtime.fail_stage / fail_tick: replica 0's stage fail_stage
  SIGKILLs itself before that tick, in a run's first life only."""
  resumed = loop.ask_first
  r, k = rk
  c, rt, B = config.replicas, config.runtime, config.batch_size
  shards = data_lib.shard_indices(p.data["y_train"], c.count, "iid", seed=config.seed)
  idx = lambda i: data_lib.batch_indices([shards[r]], B, config.seed, i, workers=[r])[0]  # noqa: E731
  offset = sp.schedule.offsets[-1]
  timeout_ms = int(10 * rt.stall_timeout * 1000)
  if loop.ask_first:  # resumed at its marker's sync point: ask there again
    loop.ask_first = False
    if not sync(config, sp, averager, kv, trace, loop, clock, rk, workdir, timeout_ms, loop.tick):
      return
  first_life = not resumed
  while True:
    i = loop.tick
    if first_life and r == 0 and k == rt.fail_stage and i == rt.fail_tick:  # fault injection
      logging.warning("replica 0 stage %d kills itself at tick %d", k, i)
      os.kill(os.getpid(), signal.SIGKILL)
    x = p.data["x_train"][idx(i)] if k == 0 else None
    y = p.data["y_train"][idx(max(i - offset, 0))] if sp.last else None
    start = clock()
    sp.pad = lambda start=start: pad_until(start + c.pad_s * slowed(config, r, k, start), clock)
    sp.state, metrics = sp.tick(sp.state, x, y, i)
    end = clock()
    loss = float(metrics[0]) if metrics is not None else None
    trace.add(k="tick", i=i, t0=start, t1=end, loss=loss)
    loop.tick = progress["ticks"] = i + 1
    if loop.tick % c.sync_every:
      continue
    if not sync(config, sp, averager, kv, trace, loop, clock, rk, workdir, timeout_ms, end - start):
      return


def pad_until(t: float, clock) -> None:
  rest = t - clock()
  if rest > 0:
    time.sleep(rest)


def sync(config, sp, averager, kv, trace, loop: Loop, clock, rk, workdir, timeout_ms, tick_s) -> bool:
  """This stage at its replica's sync point loop.sync: stage 0 asks; every stage executes the entry.
  False at STOP."""
  r, k = rk
  s = loop.sync
  if k == 0:
    kv.key_value_set(f"{PREFIX}/req/{r}/{s}", f"{clock()} {tick_s} {loop.last_gid}")
  items = decode(kv.blocking_key_value_get(f"{PREFIX}/e/{r}/{s}", timeout_ms))
  loop.sync = s + 1
  for item in items:
    if item[0] == "G":
      t0 = clock()
      flat, unravel = flat_of(sp.state)
      flat = jax.device_put(flat, NamedSharding(averager.local_mesh, P()))
      mean = jax.device_put(averager.average(item[2], flat), sp.device)  # the tick's own sharding
      sp.state = dict(sp.state, **unravel(mean.block_until_ready()))
      if item[1] >= 0:
        loop.last_gid = item[1]
      trace.add(k="avg", g=item[1], m=list(item[2]), s=s, t0=t0, t1=clock())
    elif item[0] == "E":
      mark(sp, trace, loop, clock, rk, workdir, item[1], item[2], s)
    else:
      return False
  return True


def mark(sp: Stage, trace, loop: Loop, clock, rk, workdir, c: int, save: bool, s: int) -> None:
  """Marker c: this stage's parameters for the coordinator's evaluation; with `save` a checkpoint too
  (the links settled first: both ends of each link are at this tick)."""
  r, k = rk
  np.save(snapshot_path(workdir, c, r, k), np.asarray(flat_of(sp.state)[0]))
  if save:
    sp.state = sp.links.settle(sp.state)
    # The cursor asks at sync point s again on resume when the marker came before this entry's group,
    # which the resumed service has not made (dynamic) or makes again (fixed: the marker is always first).
    trace.add(k="mark", c=c, t=clock(), save=True)
    loop.time = clock()
    cursor = dict(dataclasses.asdict(loop), sync=s, trace_lines=trace.lines)
    save_stage(sp, workdir, c, r, k, cursor)
  else:
    trace.add(k="mark", c=c, t=clock(), save=False)


def ckpt_dir(workdir: str, c: int) -> str:
  return os.path.join(workdir, CKPT, str(c))


def save_stage(sp: Stage, workdir: str, c: int, r: int, k: int, cursor: dict) -> None:
  """ckpt_hybrid/<c>/<r>-<k>.npz (the stage's state and ring as leaves) and its cursor, each whole or
  not at all (written aside, then renamed)."""
  folder = ckpt_dir(workdir, c)
  os.makedirs(folder, exist_ok=True)
  leaves = [np.asarray(a) for a in jax.tree.leaves(sp.pack(sp.state))]
  path = os.path.join(folder, f"{r}-{k}")
  with open(path + ".tmp.npz", "wb") as f:
    np.savez(f, *leaves)
  os.replace(path + ".tmp.npz", path + ".npz")
  with open(path + ".tmp", "w") as f:
    json.dump(cursor, f)
  os.replace(path + ".tmp", path + ".json")


def restore(sp: Stage, workdir: str, c: int, r: int, k: int) -> Loop:
  path = os.path.join(ckpt_dir(workdir, c), f"{r}-{k}")
  with np.load(path + ".npz") as f:
    leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
  like = sp.pack(sp.state)
  packed = jax.tree.unflatten(jax.tree.structure(like), leaves)
  sp.state = jax.device_put(sp.unpack(packed), sp.device)
  cursor = json.load(open(path + ".json"))
  logging.info("replica %d stage %d: resuming at tick %d (marker %d)", r, k, cursor["tick"], c)
  return Loop(**dict(cursor, ask_first=True))


def resume_point(workdir: str, R: int, K: int) -> int:
  """The newest marker every process checkpointed and whose service state was saved (0: none)."""
  folder = os.path.join(workdir, CKPT)
  marks = (
    sorted((int(d) for d in os.listdir(folder) if d.isdigit()), reverse=True) if os.path.isdir(folder) else []
  )
  for c in marks:
    have = set(os.listdir(ckpt_dir(workdir, c)))
    if "service.json" in have and all(f"{r}-{k}.json" in have for r in range(R) for k in range(K)):
      return c
  return 0


# --- The coordinator -----------------------------------------------------------------------------------


def save_service(workdir: str, c: int, state: dict) -> None:
  """ckpt_hybrid/<c>/service.json: the service's state when marker c entered the order, whole or not at
  all."""
  folder = ckpt_dir(workdir, c)
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, "service.json")
  with open(path + ".tmp", "w") as f:
    json.dump(state, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)


def coordinate(config, workdir: str) -> dict:
  """Process 0: the resume point, the service, the start barrier, the end; then every marker's snapshot
  evaluated and summary.json."""
  R, K, rt = config.replicas.count, config.num_stages, config.runtime
  sigterm = coord.SigtermStop(name=coord.COORDINATOR).install()
  workdir = make_workdir(workdir, config)
  h = sim.build(config, workdir)
  kv = coord.client()
  with RunLog(workdir, config, h.per_replica, is_lead=True, checkpoint_every=0) as log:
    log.start_fresh()  # the records are written at the end, from the snapshots
    resumed = resume_point(workdir, R, K)
    clock_at = {"t0": time.perf_counter()}
    now = lambda: time.perf_counter() - clock_at["t0"]  # noqa: E731
    service = Service(config, kv, h.per_replica, h.total, now, lambda c, st: save_service(workdir, c, st))
    start_time = 0.0
    if resumed:
      cursors = [json.load(open(os.path.join(ckpt_dir(workdir, resumed), f"{r}-0.json"))) for r in range(R)]
      service.load(json.load(open(os.path.join(ckpt_dir(workdir, resumed), "service.json"))), cursors)
      times = [
        json.load(open(os.path.join(ckpt_dir(workdir, resumed), f"{r}-{k}.json")))["time"]
        for r in range(R)
        for k in range(K)
      ]
      start_time = max(times)
      logging.info("coordinator: the hybrid resumes at marker %d (time %.2f s)", resumed, start_time)
    kv.key_value_set(f"{PREFIX}/resume", str(resumed))
    watchdog = coord.Watchdog(
      kv, None, R * K, lambda: (0, 0, False), rt.heartbeat_s, rt.heartbeat_timeout, rt.stall_timeout,
      role="stage", hosts_service=True,
    )  # fmt: skip
    sigterm.watchdog = watchdog
    kv.key_value_set(f"{PREFIX}/t0", repr(start_time))
    kv.wait_at_barrier(f"{PREFIX}/start", int(rt.stall_timeout * 4000))
    clock_at["t0"] = time.perf_counter() - start_time
    service.start()
    watchdog.start()
    try:
      while not service.done():
        log.progress(min(int(service.ticks.sum()) // R, h.per_replica))
        time.sleep(0.05)
      if service.error is not None:
        raise RuntimeError(f"the hybrid's Group Generator service stopped: {service.error}")
      kv.wait_at_barrier(f"{PREFIX}/end", int(10 * rt.stall_timeout * 1000))
    except Exception:
      watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)
      raise
    finally:
      service.stop()
    watchdog.stop()
    return summarize(config, workdir, h, log)


def read_traces(workdir: str, R: int, K: int) -> dict:
  return {
    (r, k): [json.loads(line) for line in open(os.path.join(workdir, f"trace-{r}-{k}.jsonl"))]
    for r in range(R)
    for k in range(K)
  }


def group_key(e: dict) -> tuple:
  """A trace's average as one group of the run: its Group Buffer id, or a fixed schedule's sync index
  and members (every member averages it at the same index)."""
  return ("g", e["g"] if e["g"] >= 0 else (e["s"], tuple(e["m"])))


def events_of(traces: dict, R: int) -> list:
  """The run as hybrid/clock.py's events, in an order the simulator's numerics replay (hybrid/sim.py
  pack_rounds): every replica's own ticks and groups in its order (stage 0's; every stage has the
  same), a group once all its members reached it. A tick's time is its slowest stage's end; a group's,
  its last stage average's end."""
  K = len(traces) // R
  seqs = []
  for r in range(R):
    ends = {}
    for k in range(K):
      for e in traces[(r, k)]:
        if e["k"] == "tick":
          ends[("t", e["i"])] = max(ends.get(("t", e["i"]), 0.0), e["t1"])
        elif e["k"] == "avg":
          key = group_key(e)
          ends[key] = max(ends.get(key, 0.0), e["t1"])
    seq = []
    for e in traces[(r, 0)]:
      if e["k"] == "tick":
        seq.append((("t", e["i"]), e["i"], None))
      elif e["k"] == "avg":
        seq.append((group_key(e), None, tuple(e["m"])))
    seqs.append([(ends[key], key, i, m) for key, i, m in seq])
  events, pos = [], [0] * R
  while any(pos[r] < len(seqs[r]) for r in range(R)):
    moved = False
    for r in range(R):
      while pos[r] < len(seqs[r]) and seqs[r][pos[r]][1][0] == "t":
        t, _, i, _ = seqs[r][pos[r]]
        events.append((t, clock_lib.TICK, r, i))
        pos[r] += 1
        moved = True
    heads = {}
    for r in range(R):
      if pos[r] < len(seqs[r]):
        heads.setdefault(seqs[r][pos[r]][1], []).append(r)
    for at in sorted(heads.values(), key=lambda at: seqs[at[0]][pos[at[0]]][0]):
      members = seqs[at[0]][pos[at[0]]][3]
      if sorted(at) == sorted(members):
        t = max(seqs[m][pos[m]][0] for m in members)
        events.append((t, clock_lib.AVG, members))
        for m in members:
          pos[m] += 1
        moved = True
    if not moved:
      raise ValueError(f"the traces' groups have no common order (replicas at {pos})")
  return events


def summarize(config, workdir: str, h, log: RunLog) -> dict:
  """Every marker's snapshot evaluated (the run's model: hybrid/sim.run_models), the final state's too;
  summary.json with the measured ticks, averages and time to target."""
  R, K = config.replicas.count, config.num_stages
  traces = read_traces(workdir, R, K)
  evaluate = baselines.make_eval(h.p.stages)
  splits = {"test": jax.device_put((h.p.data["x_test"], h.p.data["y_test"]))}
  if "x_val" in h.p.data:
    splits["val"] = jax.device_put((h.p.data["x_val"], h.p.data["y_val"]))
  unravel = [flat_of(st)[1] for st in h.one]

  def scalars(name) -> dict:
    states = [[unravel[k](np.load(snapshot_path(workdir, name, r, k))) for k in range(K)] for r in range(R)]
    stacked = [
      {key: jax.tree.map(lambda *a: np.stack(a), *[s[k][key] for s in states]) for key in sim.AVERAGED}
      for k in range(K)
    ]
    out = {}
    for split, xy in splits.items():
      acc, loss = np.mean([jax.device_get(evaluate(m, *xy)) for m in sim.run_models(config, stacked)], 0)
      out.update({f"{split}_accuracy": float(acc), f"{split}_loss": float(loss)})
    return out

  marks = {}
  for tr in traces.values():
    for e in tr:
      if e["k"] == "mark":
        marks[e["c"]] = max(marks.get(e["c"], 0.0), e["t"])
  ticks = [sum(e["k"] == "tick" for e in traces[(r, 0)]) for r in range(R)]
  end = max(e["t"] for tr in traces.values() for e in tr if e["k"] == "end")
  target, time_to_target = config.replicas.target_accuracy, None
  final_step = int(sum(ticks)) // R
  for c in sorted(m for m in marks if m * config.eval_every < final_step):
    got = scalars(c)
    if time_to_target is None and target and got["test_accuracy"] >= target:
      time_to_target = marks[c]
    log.record(c * config.eval_every, marks[c], **got)
  final = scalars("final")
  if time_to_target is None and target and final["test_accuracy"] >= target:
    time_to_target = end
  log.record(final_step, end, **final)
  # A group's cost: its last member's average (the others' also holds their wait for it), the slowest
  # stage's; what the simulator's clock takes as avg_s.
  costs = {}
  for (_, k), tr in traces.items():
    for e in tr:
      if e["k"] == "avg":
        key = (group_key(e), k)
        costs[key] = min(costs.get(key, np.inf), e["t1"] - e["t0"])
  per_group = {}
  for (g, _), cost in costs.items():
    per_group[g] = max(per_group.get(g, 0.0), cost)
  avgs = list(per_group.values())
  tick_s = [e["t1"] - e["t0"] for tr in traces.values() for e in tr if e["k"] == "tick"]
  return log.finish(
    time=end,
    worker_steps=ticks,
    replicas=R,
    num_stages=K,
    method=config.method,
    algorithm=config.replicas.algorithm,
    placement="per_process",
    groups=len({group_key(e) for r in range(R) for e in traces[(r, 0)] if e["k"] == "avg"}),
    average_s=float(np.mean(avgs)) if avgs else 0.0,
    tick_s=float(np.median(tick_s)) if tick_s else 0.0,
    pad_s=float(config.replicas.pad_s),
    time_to_target=time_to_target,
    target_accuracy=target,
  )

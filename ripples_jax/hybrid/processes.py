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
  hyb/e/<r>/<s>     the answer (SyncPoints), read by every stage of replica r: schedule/online.py's
                    entries (its `encode`, joined by ";"): groups to average (G), markers (M: a
                    snapshot of every stage's parameters, kind "ckpt" a checkpoint too, "eval" not),
                    NONE (N: tick on), STOP (S).
A group's stage k averages among the members' stage-k processes only (a GroupAverager over their devices,
runtime/preduce.py): stages never mix. Every member set a replica can be in is connected before the clock
starts, in one global order (gloo's first use of a context waits for all its members).

Why nothing cycles: every stage of a replica executes the same entries in the same order, each stage's
groups are a subsequence of the Group Buffer's one order, and a link transfer waits only for a
neighbour at an earlier tick or an earlier group of the same replica (hybrid/clock.py's argument, per
stage). Fixed schedules (All-Reduce, Static GG) take the group of the sync point's index.

The budget of ticks is the simulator's (hybrid/sim.build_replicas): R x per-replica ticks in all. Dynamic
generators and none share it (a replica reserves sync_every ticks with each answer; once it is spent,
each replica gets its pending groups and STOP, and no group is generated); a fixed schedule's replicas
tick in step, each per_replica ticks.

Markers: once the replicas' ticks over R pass a multiple of eval_every, marker c enters every replica's
entries at one cut of the buffer's order: dynamic, online.Service.mark (after the groups created before
it in every queue); fixed, at the first sync index no
replica has been answered for, before that index's group. So the snapshot (and checkpoint) at c is a
consistent cut across replicas; across the stages of a replica it is the lockstep one (each stage
settles its links at the same tick). The record's time is the latest stage's snapshot time; the
coordinator evaluates the snapshots after the run (the clock never pauses for it).

Resume (as the runtime's workers do): every stage checkpoints alone at a checkpoint marker (RunLog
per_process: ckpt/<process>/<step>, step = marker x eval_every) and the coordinator saves the service's
state there first (authority/<step>.json); a restarted run's stages agree on the newest step every one
of them restores (distributed/resume.py) and tell the coordinator, which restarts the service from that
state with every group of the cut done; the clock goes on from the latest stage's marker time, each
trace is cut back to the marker (its events' epoch "c"), and each replica asks again at its marker's
sync point.
"""

import dataclasses
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
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.distributed.arrays import LOCAL, WORKER
from ripples_jax.distributed.host import pin_threads
from ripples_jax.hybrid import clock as clock_lib
from ripples_jax.hybrid import sim
from ripples_jax.pipeline import baselines
from ripples_jax.pipeline.link import stage_device
from ripples_jax.pipeline.per_process import Stage, checkpoint_rows
from ripples_jax.runlog import RunLog, make_workdir
from ripples_jax.runlog.storage import save_array
from ripples_jax.runtime import coordinator as snapshots
from ripples_jax.runtime.preduce import GroupAverager
from ripples_jax.runtime.trace import TraceWriter
from ripples_jax.schedule import group_gen, online

KEYS = f"{coord.PREFIX}/hyb"  # the hybrid's keys in the coordination store


def process_of(r: int, k: int, K: int) -> int:
  """The process of replica r's stage k (process 0: the coordinator)."""
  return 1 + r * K + k


def run(config, workdir: str) -> dict:
  """This process's part (run.EXECUTORS): the coordinator on process 0, a stage elsewhere."""
  return coordinate(config, workdir) if jax.process_index() == 0 else stage(config, workdir)


# --- The Group Generator's service (the coordinator) ------------------------------------------------


class SyncPoints:
  """The coordinator's answers to the replicas' sync points, in arrival order (one listener thread per
  replica): schedule/online.Service over the R replicas (its Group Buffer and generator, its entries,
  markers, STOP and state) through this adapter, which adds what the replicas' protocol needs beyond the
  runtime's: a budget of ticks reserved sync_every at a time, and one answer per sync point.

  Dynamic generators (and none: a generator that makes nothing): a replica's answer is its queue's
  entries up to its next group or NONE (asked for when its queue holds none) and the markers right
  after it; once the budget is spent (Service.stop) everything up to STOP. A marker is Service.mark's,
  at one point of every queue, so it cuts every group on the same side for all its members. Fixed
  schedules (All-Reduce, Static GG): no generator, as in the runtime (online.fixed_entry); a marker
  comes at the first sync index no replica has been answered for, before that index's group; every
  replica stops after its share of the ticks. Marker c is ("M", "ckpt", c) when its step is a
  checkpoint's, else ("M", "eval", c). `clock()`: the run's time."""

  def __init__(self, config, kv, per_replica: int, total: int, clock, on_checkpoint=None):
    c = config.replicas
    self.on_checkpoint = on_checkpoint or (lambda c, state: None)
    self.config, self.kv, self.clock = config, kv, clock
    self.R, self.E, self.per_replica = c.count, c.sync_every, per_replica
    gen = sim.make_generator(config)
    self.fixed = isinstance(gen, group_gen.Fixed)
    self.layouts = gen.layouts if self.fixed else None
    nothing = lambda worker, view: None  # noqa: E731  (none: every answer is NONE)
    self.service = online.Service(
      self.R, nothing if self.fixed or gen is None else gen, estimate=float(c.pad_s)
    )
    self.pos = [0] * self.R  # each replica's next entry
    self.left = total - self.R * self.E  # ticks not yet reserved (each replica's first block is)
    self.ticks = np.zeros(self.R, np.int64)
    self.answered = np.full(self.R, -1, np.int64)
    self.marks = [[] for _ in range(self.R)]  # fixed: per replica, [(marker, sync index)] not yet emitted
    self.next_mark = 1
    self.stopped, self.error = set(), None
    self._requests, self._stop = queue.Queue(), threading.Event()
    self.first_sync = np.zeros(self.R, np.int64)  # resumed: each replica asks first at its marker's

  def state(self) -> dict:
    return {"service": self.service.state(), "next_mark": self.next_mark, "answered": self.answered.tolist()}

  def load(self, state: dict, cursors: list) -> None:
    """The state at a checkpoint marker; `cursors`: each replica's stage-0 checkpoint there. Every group
    made before the marker was executed by its members before their checkpoint: the queues start empty
    (online.Service.load)."""
    self.service.load(state["service"])
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
        value = self.kv.blocking_key_value_get(f"{KEYS}/req/{r}/{s}", 1000)
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
        entries = self.answer(r, s, float(tick_s), int(last_gid))
        self.kv.key_value_set(f"{KEYS}/e/{r}/{s}", ";".join(online.encode(e) for e in entries))
    except Exception as e:  # noqa: BLE001  the coordinator's main thread reports it
      self.error = e
      logging.exception("the hybrid's Group Generator service stopped")

  def answer(self, r: int, s: int, tick_s: float, last_gid: int) -> list:
    """Replica r at its s-th sync point, having averaged up to group `last_gid`: its entries."""
    now, svc = self.clock(), self.service
    svc.report(r, now, 0.0, (s + 1) * self.E, last_gid if not self.fixed else -1)
    svc.estimates[r] = 0.0  # ready now (Smart GG reads this)
    self.ticks[r], self.answered[r] = (s + 1) * self.E, s
    self.new_marks()
    entries = self.fixed_entries(r, s) if self.fixed else self.dynamic_entries(r, now)
    if entries[-1][0] == online.STOP:
      self.stopped.add(r)
    else:
      svc.started_at[r], svc.estimates[r] = now, tick_s  # it ticks on from here
    return entries

  def new_marks(self) -> None:
    """Markers whose step the replicas' ticks have passed (none once the budget is spent: the end is
    recorded anyway)."""
    every, R = self.config.eval_every, self.R
    while self.ticks.sum() >= self.next_mark * every * R and self.left >= self.E and not self.stopped:
      c = self.next_mark
      kind = "ckpt" if self.saves(c) else "eval"
      if self.fixed:
        cut = int(self.answered.max()) + 1
        for r in range(R):
          self.marks[r].append((c, cut))
      else:
        self.service.mark(kind, c)
      if kind == "ckpt":  # written before any entry holds c: every stage's checkpoint at c has it
        self.on_checkpoint(c, dict(self.state(), next_mark=c + 1))
      self.next_mark += 1

  def saves(self, c: int) -> bool:
    every = self.config.checkpoint_every
    return bool(every) and (c * self.config.eval_every) % every == 0

  def fixed_entries(self, r: int, s: int) -> list:
    """All-Reduce, Static GG: the group of index s; every replica stops after per_replica ticks."""
    stop = (s + 1) * self.E >= self.per_replica
    kind = lambda c: "ckpt" if self.saves(c) else "eval"  # noqa: E731
    out = [(online.MARK, kind(c), c) for c, j in self.marks[r] if j <= s or stop]
    self.marks[r] = [(c, j) for c, j in self.marks[r] if not (j <= s or stop)]
    if stop:
      return out + [(online.STOP,)]
    return out + [online.fixed_entry(self.layouts, self.R, r, s)]

  def dynamic_entries(self, r: int, now: float) -> list:
    """r's queue up to its next group or NONE and the markers right after it (asked for when the queue
    holds none); once the budget is spent, everything up to STOP."""
    svc = self.service
    if self.left < self.E:
      svc.stop()  # STOP after whatever every queue holds: each replica's pending groups, then the end
    else:
      self.left -= self.E
    if all(svc.entry(r, k)[0] == online.MARK for k in range(self.pos[r], svc.appended(r))):
      svc.request(r, svc.appended(r), now)  # only markers left (or nothing): its request
    out, stepped = [], False
    while self.pos[r] < svc.appended(r):
      entry = svc.entry(r, self.pos[r])
      if stepped and entry[0] != online.MARK and not svc.stopped:
        break  # one group per sync point
      out.append(entry)
      self.pos[r] += 1
      stepped = stepped or entry[0] in (online.GROUP, online.NONE)
      if entry[0] == online.STOP:
        break
    svc.trim(self.pos)  # what is posted is forgotten: the state stays bounded
    return out


# --- A stage process ----------------------------------------------------------------------------------


@dataclasses.dataclass
class StageLoop:
  """Where this stage stands; its checkpoint's cursor."""

  tick: int = 0  # the next tick
  sync: int = 0  # the next sync point's index
  last_gid: int = -1  # the newest group it averaged (the service's `done`)
  time: float = 0.0  # the run's clock at the checkpoint
  marker: int = 0  # the newest marker passed: its trace events' epoch ("c")
  ask_first: bool = False  # resumed at a sync point: its entry is asked for again before any tick


def slowed(config, r: int, k: int, now: float) -> float:
  c = config.replicas
  slow = clock_lib.slow_device(tuple(c.slow), c.slowdown, c.count, c.rotate_every, now)
  return float(c.slowdown) if slow == (r, k) else 1.0


@dataclasses.dataclass
class StageProcess:
  """What a stage process works with, built once: replica r's stage k (process 1 + r * K + k)."""

  config: object
  sp: Stage
  averager: GroupAverager
  kv: object
  log: RunLog  # its checkpoints (per_process: ckpt/<process>/<step>); the coordinator owns the records
  trace: TraceWriter  # trace-<r>-<k>.jsonl, written through; "c": the newest marker passed
  r: int
  k: int
  workdir: str
  p: object  # the pipeline's set-up (pipeline_inputs.build_pipeline)
  clock: object = None  # the run's time, from the start barrier on


def stage(config, workdir: str) -> dict:
  """Replica r's stage k: its resume point, warm-up, the start barrier, ticks and entries until STOP,
  the final state."""
  me, K, R = jax.process_index(), config.num_stages, config.replicas.count
  r, k = divmod(me - 1, K)
  sigterm = coord.SigtermStop().install()
  rt = config.runtime
  if rt.pin_cores and hasattr(os, "sched_getaffinity"):
    cores = sorted(os.sched_getaffinity(0))
    pin_threads({cores[(me - 1) % len(cores)]})
  workdir = make_workdir(workdir, config)
  h = sim.build_replicas(config, workdir)
  p = h.p
  sp = Stage(
    config, p.stages, p.optimizer, h.total, p.feed.sample, p.data["x_test"], base=process_of(r, 0, K)
  )
  local = Mesh(np.array([[sp.device]]), (WORKER, LOCAL))
  averager = GroupAverager(local, {m: [stage_device(process_of(m, k, K))] for m in range(R)}, 256)
  rows = checkpoint_rows(range(1, R * K + 1), sp.device)
  with RunLog(workdir, config, h.per_replica, is_lead=False, per_process=rows) as log:
    kv = coord.client()
    loop = resume_stage(sp, log, kv, rt)
    path = os.path.join(workdir, f"trace-{r}-{k}.jsonl")
    trace = TraceWriter(workdir, me, loop.marker if loop.ask_first else None, write_through=True, path=path)
    ctx = StageProcess(config, sp, averager, kv, log, trace, r, k, workdir, p)
    return run_life(ctx, loop, sigterm)


def resume_stage(sp: Stage, log: RunLog, kv, rt) -> StageLoop:
  """The newest checkpoint marker every stage restores (distributed.resume over RunLog per_process), or
  a fresh start; the first stage tells the coordinator which (publish_point), every stage its cursor."""
  me, n = jax.process_index(), jax.process_count() - 1
  got = resume_lib.restore_common(log, kv, me - 1, n, sp.pack(sp.state), rt.stall_timeout, what="stage")
  loop = StageLoop()
  if got is not None:
    sp.state = sp.unpack(got[1])
    loop = StageLoop(**dict(got[2], ask_first=True))
    logging.info("stage process %d: resuming at tick %d (marker %d)", me, loop.tick, loop.marker)
  if me == 1:
    resume_lib.publish_point(kv, log, got and got[0])
  kv.key_value_set(f"{KEYS}/cursor/{me}", json.dumps(dataclasses.asdict(loop)), allow_overwrite=True)
  return loop


def run_life(ctx: StageProcess, loop: StageLoop, sigterm) -> dict:
  """Warm-up, the start barrier, ticks and entries until STOP, the final state."""
  config, sp, kv, rt = ctx.config, ctx.sp, ctx.kv, ctx.config.runtime
  warm_up(config, sp, ctx.averager, ctx.r, ctx.k, ctx.p)
  progress = {"ticks": loop.tick, "done": False}
  watchdog = coord.Watchdog(
    kv,
    jax.process_index() - 1,
    jax.process_count() - 1,
    lambda: (progress["ticks"], progress["ticks"], progress["done"]),
    rt.heartbeat_s,
    rt.heartbeat_timeout,
    rt.stall_timeout,
    role="stage",
    hosts_service=False,
    service_host=f"the {coord.COORDINATOR}",
  )
  sigterm.watchdog = watchdog
  kv.wait_at_barrier(f"{KEYS}/start", int(rt.stall_timeout * 4000))
  t0 = time.perf_counter() - float(kv.blocking_key_value_get(f"{KEYS}/t0", 60_000))
  ctx.clock = lambda: time.perf_counter() - t0
  watchdog.start()
  try:
    run_stage(ctx, loop, progress)
    sp.links.close()
  except Exception:
    watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)
    raise
  a = ctx.averager
  ctx.trace.add(k="end", c=loop.marker, t=ctx.clock(), tick=loop.tick, compiles=a.compiles, ahead_s=a.ahead_s)
  save_array(stage_snapshot_path(ctx.workdir, "final", ctx.r, ctx.k), np.asarray(flat_of(sp.state)[0]))
  progress["done"] = True
  kv.wait_at_barrier(f"{KEYS}/end", int(10 * rt.stall_timeout * 1000))
  watchdog.stop()
  return {
    "method": config.method,
    "stage": ctx.k,
    "replica": ctx.r,
    "workdir": ctx.workdir,
    "time": ctx.clock(),
  }


def flat_of(st):
  """(flat, unravel) of a stage's averaged part (parameters and model state)."""
  return ravel_pytree({key: st[key] for key in sim.AVERAGED})


def stage_snapshot_path(workdir: str, name, r: int, k: int) -> str:
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
  for members in sim.member_sets(config, r):
    averager.connect(members, flat)


def run_stage(ctx: StageProcess, loop: StageLoop, progress: dict) -> None:
  """Ticks and entries until STOP. runtime.fail_stage / fail_tick: replica 0's stage fail_stage
  SIGKILLs itself before that tick, in a run's first life only."""
  config, sp, p, r, k, clock = ctx.config, ctx.sp, ctx.p, ctx.r, ctx.k, ctx.clock
  resumed = loop.ask_first
  c, rt, B = config.replicas, config.runtime, config.batch_size
  shards = data_lib.shard_indices(p.data["y_train"], c.count, "iid", seed=config.seed)
  idx = lambda i: data_lib.batch_indices([shards[r]], B, config.seed, i, workers=[r])[0]  # noqa: E731
  offset = sp.schedule.offsets[-1]
  if loop.ask_first:  # resumed at its marker's sync point: ask there again
    loop.ask_first = False
    if not sync(ctx, loop, loop.tick):
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
    ctx.trace.add(k="tick", c=loop.marker, i=i, t0=start, t1=end, loss=loss)
    loop.tick = progress["ticks"] = i + 1
    if loop.tick % c.sync_every:
      continue
    if not sync(ctx, loop, end - start):
      return


def pad_until(t: float, clock) -> None:
  rest = t - clock()
  if rest > 0:
    time.sleep(rest)


def sync(ctx: StageProcess, loop: StageLoop, tick_s: float) -> bool:
  """This stage at its replica's sync point loop.sync: stage 0 asks; every stage executes the entries
  (schedule/online.py's). False at STOP."""
  sp, clock, s = ctx.sp, ctx.clock, loop.sync
  if ctx.k == 0:
    ctx.kv.key_value_set(f"{KEYS}/req/{ctx.r}/{s}", f"{clock()} {tick_s} {loop.last_gid}")
  text = ctx.kv.blocking_key_value_get(
    f"{KEYS}/e/{ctx.r}/{s}", int(10 * ctx.config.runtime.stall_timeout * 1000)
  )
  loop.sync = s + 1
  for entry in [online.decode(part) for part in text.split(";") if part]:
    if entry[0] == online.GROUP:
      t0 = clock()
      flat, unravel = flat_of(sp.state)
      flat = jax.device_put(flat, NamedSharding(ctx.averager.local_mesh, P()))
      mean = jax.device_put(ctx.averager.average(entry[2], flat), sp.device)  # the tick's own sharding
      sp.state = dict(sp.state, **unravel(mean.block_until_ready()))
      loop.last_gid = entry[1]
      ctx.trace.add(k="avg", c=loop.marker, g=entry[1], m=list(entry[2]), s=s, t0=t0, t1=clock())
    elif entry[0] == online.MARK:
      mark_point(ctx, loop, entry[2], entry[1], s)
    elif entry[0] == online.STOP:
      return False
  return True


def mark_point(ctx: StageProcess, loop: StageLoop, c: int, kind: str, s: int) -> None:
  """Marker c: this stage's parameters for the coordinator's evaluation; kind "ckpt": a checkpoint too
  (the links settled first: both ends of each link are at this tick), at the run's step c x eval_every.
  Its trace line is the last of epoch c - 1: a run resumed from it keeps the line."""
  sp = ctx.sp
  save_array(stage_snapshot_path(ctx.workdir, c, ctx.r, ctx.k), np.asarray(flat_of(sp.state)[0]))
  if kind == "ckpt":
    sp.state = sp.links.settle(sp.state)
  ctx.trace.add(k="mark", c=loop.marker, id=c, kind=kind, t=ctx.clock())
  loop.marker = c
  if kind == "ckpt":
    # The cursor asks at sync point s again on resume when the marker came before this entry's group,
    # which the resumed service has not made (dynamic) or makes again (fixed: the marker is always first).
    loop.time = ctx.clock()
    cursor = dict(dataclasses.asdict(loop), sync=s)
    ctx.log.checkpoint(c * ctx.config.eval_every, sp.pack(sp.state), cursor, force=True)
    # Committed before the next tick, as every stage's marker is: a stage killed after passing c
    # holds c (the runtime's workers write theirs in the background and may lose the newest).
    t0 = time.perf_counter()
    ctx.log.wait()
    ctx.trace.add(k="saved", c=c, s=time.perf_counter() - t0)  # the stall: orbax, 1.6-2.5 s on 2 cores


# --- The coordinator -----------------------------------------------------------------------------------


def coordinate(config, workdir: str) -> dict:
  """Process 0: the resume point, the service, the start barrier, the end; then every marker's snapshot
  evaluated and summary.json."""
  R, K, rt = config.replicas.count, config.num_stages, config.runtime
  sigterm = coord.SigtermStop(name=coord.COORDINATOR).install()
  workdir = make_workdir(workdir, config)
  h = sim.build_replicas(config, workdir)
  kv = coord.client()
  with RunLog(workdir, config, h.per_replica, is_lead=True, checkpoint_every=0) as log:
    log.start_fresh()  # the records are written at the end, from the snapshots
    point = resume_lib.await_point(kv, rt.stall_timeout * 4)  # the stages agree on it (resume_stage)
    clock_at = {"t0": time.perf_counter()}
    now = lambda: time.perf_counter() - clock_at["t0"]  # noqa: E731
    # Marker c's service state, written before any entry holds c (the runtime's authority snapshots).
    save = lambda c, st: snapshots.save_snapshot(workdir, c * config.eval_every, st)  # noqa: E731
    service = SyncPoints(config, kv, h.per_replica, h.total, now, save)
    start_time = 0.0
    if point is not None:
      timeout = int(rt.stall_timeout * 4000)
      cursors = [
        json.loads(kv.blocking_key_value_get(f"{KEYS}/cursor/{j}", timeout)) for j in range(1, R * K + 1)
      ]
      firsts = [cursors[process_of(r, 0, K) - 1] for r in range(R)]  # each replica's stage 0
      service.load(snapshots.load_snapshot(workdir, point["mark"]), firsts)
      start_time = max(c["time"] for c in cursors)
      step = point["mark"]
      logging.info(
        "coordinator: the hybrid resumes at marker %d (step %d, time %.2f s)",
        step // config.eval_every,
        step,
        start_time,
      )
    watchdog = coord.Watchdog(
      kv, None, R * K, lambda: (0, 0, False), rt.heartbeat_s, rt.heartbeat_timeout, rt.stall_timeout,
      role="stage", hosts_service=True,
    )  # fmt: skip
    sigterm.watchdog = watchdog
    kv.key_value_set(f"{KEYS}/t0", repr(start_time))
    kv.wait_at_barrier(f"{KEYS}/start", int(rt.stall_timeout * 4000))
    clock_at["t0"] = time.perf_counter() - start_time
    service.start()
    watchdog.start()
    try:
      while not service.done():
        log.progress(min(int(service.ticks.sum()) // R, h.per_replica))
        time.sleep(0.05)
      if service.error is not None:
        raise RuntimeError(f"the hybrid's Group Generator service stopped: {service.error}")
      kv.wait_at_barrier(f"{KEYS}/end", int(10 * rt.stall_timeout * 1000))
    except Exception:
      watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)
      raise
    finally:
      service.stop()
    watchdog.stop()
    return summarize_stages(config, workdir, h, log)


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
        events.append((t, clock_lib.TICK_END, r, i))
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
        events.append((t, clock_lib.AVG, members, None))
        for m in members:
          pos[m] += 1
        moved = True
    if not moved:
      raise ValueError(f"the traces' groups have no common order (replicas at {pos})")
  return events


def summarize_stages(config, workdir: str, h, log: RunLog) -> dict:
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
    states = [
      [unravel[k](np.load(stage_snapshot_path(workdir, name, r, k))) for k in range(K)] for r in range(R)
    ]
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
        marks[e["id"]] = max(marks.get(e["id"], 0.0), e["t"])
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

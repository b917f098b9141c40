"""executor=async: one controller process per worker, each running the Ripples worker loop for real.

  loop: local step on this worker's devices (padded to runtime.step_time, slowed while this worker is
        a straggler) -> the head of its queue: markers (eval snapshot, checkpoint), then one group or
        none -> P-Reduce over the group's sub-mesh -> repeat

Worker w is process w + 1: process 0 is the coordinator (runtime/coordinator.py), which trains nothing
and hosts the coordination service, the authority and the run's records. The queue comes from the
online Group Generator (runtime/authority.py: the coordinator's authority, requests through the
coordination service) or, for All-Reduce and Static GG, from the fixed schedule computed locally.
Every queue is a subsequence of one global order, so no cyclic wait can occur, and a worker blocks
only in its own groups' collectives and, with an empty queue, on the authority's answer. No barrier
inside the run: a checkpoint is a marker in the global order that each worker saves at (its own
orbax manager), and the saved states form a consistent cut. AD-PSGD has no authority and no global
order (runtime/adpsgd.py).
"""

import glob
import os
import time

import jax
import numpy as np
from absl import logging

from ripples_jax import algorithms
from ripples_jax import checkpoint as ckpt_lib
from ripples_jax.distributed import coord
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.distributed.host import collective_timeout_s
from ripples_jax.distributed.markers import fail_now
from ripples_jax.runlog import RunLog
from ripples_jax.runlog.storage import save_array
from ripples_jax.runtime import authority as authority_lib
from ripples_jax.runtime import diloco, membership
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.process import (
  GLOBAL,
  Loop,
  Worker,
  ask_back,
  cursor,
  end_of_run,
  end_step,
  fails_here,
  open_worker,
  result,
  snapshot_path,
  start_clock,
  watch,
  watched,
)
from ripples_jax.schedule.online import GROUP, MARK, MEMBER, STOP


def resume(worker: Worker, log: RunLog, kv, workdir: str) -> Loop | int:
  """The loop state from the newest marker every worker can restore (distributed.resume), or a fresh
  one; what the lost run did after that marker (snapshots, trace events) is dropped so this run redoes it.
  The lowest worker that restored tells the coordinator where (distributed.resume.publish_point).

  Elastic, with an authority: a marker needs only the workers live at it (its snapshot's membership:
  authority.out_at_marker), so a run that lost a worker for good resumes from its newest marker, not
  from one before the death. A worker out at the chosen marker gets the marker back (an int): it
  rejoins the resumed run (rejoin_resumed)."""
  me, n, rt = worker.me, worker.config.num_workers, worker.rt
  like = worker.pack(Loop(worker.fresh()))
  excused = None
  if rt.elastic and algorithms.get(worker.config.algorithm).dynamic:
    excused = lambda step: authority_lib.out_at_marker(workdir, step)  # noqa: E731
  got = resume_lib.restore_common(log, kv, me, n, like, rt.stall_timeout, what="worker", excused=excused)
  if me == min(set(range(n)) - (excused(got[0]) if got and excused else set())):
    resume_lib.publish_point(kv, log, got and got[0])
  if got is not None and got[1] is None:  # out at the marker
    return got[0]
  if got is None:
    loop = Loop(worker.fresh())
  else:
    loop = worker.unpack(got[1], got[2])
    logging.info(
      "worker %d: resuming at checkpoint marker %d after %d local steps", me, loop.epoch, loop.steps_done
    )
  owned = [f"*-{me}.npy"] + ([f"*-{GLOBAL}.npy"] if me == 0 else [])  # worker 0 keeps DiLoCo's global
  for path in [p for pattern in owned for p in glob.glob(os.path.join(workdir, "snapshots", pattern))]:
    name = os.path.basename(path).rsplit("-", 1)[0]  # eval<id>: kept if the resumed run passed it
    if not name.startswith("eval") or int(name[4:]) > loop.evals:
      os.remove(path)
  os.makedirs(os.path.join(workdir, "snapshots"), exist_ok=True)
  return loop


def fixed_layouts(c) -> list:
  """The fixed schedule's layouts (an algorithm without a Group Generator): DiLoCo's All-Reduce after
  every H-th step, All-Reduce's every step, Static GG's periodic ones (their records' layouts)."""
  if c.algorithm == "diloco":  # the All-Reduce after every H-th step, and after the last one
    return list(diloco.layouts(c))
  return list(algorithms.get(c.algorithm).layouts(c))


def connect_fixed(worker: Worker) -> float:
  """Connects every group of a fixed schedule that holds this worker, before the run (GroupAverager.
  connect: gloo's 30 s set-up would end a run whose group first meets with a member far behind). The
  groups go in the schedule's order, each once: every worker runs a subsequence of one global order,
  and a layout's groups are disjoint, so no cycle of waits can form. Returns the seconds it took."""
  groups = dict.fromkeys(g for layout in fixed_layouts(worker.config) for g in layout if worker.me in g)
  flat = worker.fresh()["flat"]
  return sum(worker.averager.connect(tuple(g), flat) for g in groups if len(g) > 1)


def make_feed(worker: Worker, loop: Loop, kv, inc: int = 0, taken: int = 0):
  """The queue this worker reads: the authority's (dynamic generators) or the fixed schedule's
  (inc, taken: a rejoined worker's incarnation and its new queue's first index)."""
  c, me = worker.config, worker.me
  if algorithms.get(c.algorithm).dynamic:
    # Random GG, Group Division: at a step's start; Smart GG: just before its end
    ahead = algorithms.asks_ahead(c)
    lead = bool(c.schedule.request_ahead) and not ahead
    return authority_lib.Feed(kv, me, worker.now, ahead, lead=lead, inc=inc, taken=taken, n=c.num_workers)
  layouts = fixed_layouts(c)
  point = loop.syncs if loop.resumed_at is not None else 0
  return authority_lib.LocalFeed(
    layouts,
    c.num_workers,
    me,
    c.num_steps,
    c.eval_every,
    worker.rt.checkpoint_every,
    point,
    average_last=algorithms.get(c.algorithm).average_last,
  )


def run(config, workdir: str) -> dict:
  """This process's worker: runs the loop; returns its own counts (the coordinator writes the summary)."""
  rt, n = config.runtime, config.num_workers
  sigterm, workdir, kv, worker = open_worker(config, workdir)
  me = worker.me
  estimate = worker.warm_up()
  if rt.elastic and membership.started(kv):  # the run is on: this process is a restart
    return rejoin(worker, kv, workdir, estimate, sigterm)
  coord.publish_estimate(kv, coord.WARMUP, me, estimate)  # the authority's first plan (the coordinator)
  if hasattr(worker.averager, "precompile"):  # pairs: every program and connection, before the run
    like = jax.ShapeDtypeStruct(worker._flat0.shape, worker._flat0.dtype)
    compiled = worker.averager.precompile(like)
    connected = worker.averager.connect_all(worker.fresh()["flat"])
    logging.info(
      "worker %d: %d pair programs compiled ahead in %.2f s, connected in %.2f s",
      me,
      n - 1,
      compiled,
      connected,
    )
  elif not algorithms.get(config.algorithm).dynamic:  # a fixed schedule: its groups are known before the run
    logging.info(
      "worker %d: the fixed schedule's groups connected ahead in %.2f s", me, connect_fixed(worker)
    )
  with worker.run_log(workdir) as log:
    loop = resume(worker, log, kv, workdir)
    if isinstance(loop, int):  # out at the marker the run resumes from
      return rejoin_resumed(worker, kv, workdir, loop, estimate, sigterm)
    loop.last_step_time = loop.last_step_time or estimate
    loop.incs = [0] * n if rt.elastic else None
    if rt.checkpoint_every:  # compiles the checkpoint fingerprint now, not at the first marker
      ckpt_lib.fingerprint(jax.device_put(jax.device_get(worker.pack(loop))))
    trace = trace_lib.TraceWriter(
      workdir,
      me,
      keep_before_epoch=loop.epoch if loop.resumed_at is not None else None,
      write_through=rt.elastic,  # a worker killed anywhere has recorded every state it shared
    )
    progress, watchdog = watch(
      kv, me, n, rt, sigterm, steps=loop.steps_done, incarnation=0 if rt.elastic else None
    )
    worker.t_start = start_clock(kv, me, n, loop.epoch, loop.time, int(rt.stall_timeout * 1000))
    feed = make_feed(worker, loop, kv)
    train(worker, loop, log, kv, feed, trace, progress, watchdog, workdir)
    logging.info(
      "worker %d: %d local steps, %d P-Reduce programs compiled, %.2f s in their first runs",
      me,
      loop.steps_done,
      worker.averager.compiles,
      worker.averager.setup_s,
    )
    return result(worker, loop, log, workdir)


def train(worker: Worker, loop: Loop, log: RunLog, kv, feed, trace, progress, watchdog, workdir) -> None:
  """The run's body, from the common start (or a rejoin) to the end barrier."""
  watchdog.start()
  try:
    with watched(watchdog, trace, worker.rt):
      run_loop(worker, loop, log, feed, trace, progress, workdir)
      end_of_run(
        worker,
        loop,
        log,
        kv,
        trace,
        progress,
        workdir,
        rtt=feed.rtts.as_record(),
        blocked=feed.blocked.as_record(),
        requests=feed.requests,
      )
  finally:
    feed.close()
  watchdog.stop()


def rejoin(worker: Worker, kv, workdir: str, estimate: float, sigterm) -> dict:
  """A restarted process of an elastic run (runtime/membership.py): asks the authority to take it
  back, continues its trace and its data shard where its last life's record ends, and takes no step
  before its first group lands (there it has weight 0 and takes the others' mean, fresh optimizer)."""
  rt, me, n = worker.rt, worker.me, worker.config.num_workers
  got, before = ask_back(worker, kv, workdir)
  loop = Loop(
    worker.fresh(),
    steps_done=sum(e["k"] == "step" for e in before),  # the batches continue where the record ends
    last_gid=max((e["g"] for e in before if e["k"] == "group"), default=-1),
    epoch=got["ckpt"],
    evals=got["evals"],
    last_step_time=estimate,
    incs=got["incs"],
    joining=True,
  )
  logging.warning(
    "worker %d: rejoining the run as incarnation %d after %d local steps", me, got["inc"], loop.steps_done
  )
  with worker.run_log(workdir) as log:
    trace = trace_lib.TraceWriter(workdir, me, append=True, write_through=True)
    trace.add(k="rejoin", c=loop.epoch, inc=got["inc"], g0=got["g0"], t=worker.now(), s=loop.steps_done)
    progress, watchdog = watch(kv, me, n, rt, sigterm, steps=loop.steps_done, incarnation=got["inc"])
    feed = make_feed(worker, loop, kv, inc=got["inc"], taken=got["taken"])
    train(worker, loop, log, kv, feed, trace, progress, watchdog, workdir)
    return result(worker, loop, log, workdir)


def rejoin_resumed(worker: Worker, kv, workdir: str, mark: int, estimate: float, sigterm) -> dict:
  """A worker out at the marker `mark` the run resumed from (dead there, or still joining): its trace
  is cut back to the marker (what it recorded after it, if anything, the resumed run redoes), it takes
  part in the start barrier (with no time of its own: 0), and once the run is on it asks to rejoin as
  a restarted process would (rejoin): refused (no device for a next life), it exits with one line and
  the run goes on without it."""
  trace_lib.TraceWriter(workdir, worker.me, keep_before_epoch=mark)
  timeout_s = worker.rt.stall_timeout
  start_clock(kv, worker.me, worker.config.num_workers, mark, 0.0, int(timeout_s * 1000))
  deadline = time.monotonic() + timeout_s
  while not membership.started(kv):  # the coordinator marks the run on right after the barrier
    if time.monotonic() > deadline:
      raise TimeoutError(f"worker {worker.me}: the resumed run did not start within {timeout_s:.0f} s")
    time.sleep(0.05)
  logging.warning(
    "worker %d: out at checkpoint marker %d, which the run resumes from: rejoining", worker.me, mark
  )
  return rejoin(worker, kv, workdir, estimate, sigterm)


def run_loop(worker: Worker, loop: Loop, log: RunLog, feed, trace, progress, workdir) -> None:
  """Step, then the head of the queue (markers and membership entries, then one group or none), until
  STOP.

  A resumed worker starts by taking its next entry: it saved its state right after a marker, at the
  point where it takes the entry that follows. A rejoined worker (elastic) takes no step before its
  first group lands: it has no model of the run's to step on."""
  rt = worker.rt
  saved = loop.resumed_at
  step_first = loop.resumed_at is None and not loop.joining
  if step_first:  # the initial model is evaluation point 0
    mark(worker, loop, log, trace, (MARK, "eval", 0), workdir)
  while True:
    if step_first:
      if fails_here(worker, loop, "step"):
        fail_now(log, saved, loop.steps_done, worker.me)
      run_step(worker, loop, log, feed, trace)
      progress["steps"] = loop.steps_done
    entry = feed.next(rt.stall_timeout)
    while entry[0] in (MARK, MEMBER):
      if entry[0] == MARK:
        saved = mark(worker, loop, log, trace, entry, workdir) or saved
      else:
        member(worker, loop, trace, entry)
      entry = feed.next(rt.stall_timeout)
    if entry[0] == STOP:
      return
    loop.syncs += 1
    if entry[0] == GROUP:
      average(worker, loop, log, trace, entry, saved)
    elif loop.joining:  # no group was made for it (Smart GG skipped it): ask again a base step later
      time.sleep(loop.last_step_time)
    step_first = not loop.joining  # a joiner whose first group failed asks again, without a step
    step_first &= not getattr(feed, "steps_over", False)  # DiLoCo's last outer step: STOP comes next
    progress["events"] += 1


def member(worker: Worker, loop: Loop, trace, entry) -> None:
  """A membership entry (elastic): a rejoined worker's pairs use its new connection key from here on."""
  _, kind, w, inc = entry
  if kind == "join":
    loop.incs[w] = inc
  trace.add(k="member", kind=kind, w=w, inc=inc, c=loop.epoch, t=worker.now())


def average(worker: Worker, loop: Loop, log: RunLog, trace, entry, saved) -> None:
  """P-Reduce over the entry's group. Elastic: members whose exchange with a dead member failed keep
  their model (trace "failed"); a joiner (weight 0) takes the others' mean."""
  gid, members = entry[1], entry[2]
  joiners = entry[3] if len(entry) > 3 else ()
  t0, failed = worker.now(), []
  if loop.incs is None:
    flat = worker.averager.average(members, loop.state["flat"])
  else:
    hook = None
    if fails_here(worker, loop, "preduce"):
      hook = lambda: fail_now(log, saved, loop.steps_done, worker.me)  # noqa: E731
    elif fails_here(worker, loop, "slow"):
      hook = slow_once(collective_timeout_s(worker.rt) + 1.0)
    flat, failed = worker.averager.average_elastic(
      members, loop.state["flat"], joiners, loop.incs, hook, attempt=gid
    )
  outer = worker.outer_step is not None
  if outer:  # DiLoCo: the outer step from the workers' mean (runtime/diloco.py)
    flat, loop.state["outer"] = worker.outer_step(flat, loop.state["outer"])
  flat.block_until_ready()
  loop.state["flat"] = flat
  loop.last_gid = gid
  event = {"k": "group", "c": loop.epoch, "g": gid, "m": list(members), "t0": t0, "t1": worker.now()}
  if outer:
    event["outer"] = True
  if joiners:
    event["join"] = list(joiners)
  if failed:
    event["failed"] = failed
    causes = getattr(worker.averager, "causes", {})
    event["cause"] = [causes.get(m, "unknown") for m in failed]
  elif worker.me in joiners:  # fresh momentum (a new process's), its schedule at its own step count
    # Fresh even when it stepped since its first group (a group made before the authority saw that
    # step carries it as a joiner again: Service.report): the engine's JOIN, which the replay runs.
    loop.state["opt_state"] = worker.schedule_at(worker.fresh()["opt_state"], loop.steps_done)
    loop.joining = False
  trace.add(**event)


def slow_once(seconds: float):
  """Fault injection (fail_where=slow): after this group's first exchange the worker sleeps `seconds`
  once, alive (its heartbeat thread beats on), slower than the collective timeout: its next partner's
  exchange times out against a live worker, which must not break that pair for the run."""
  slept = []

  def hook():
    if not slept:
      slept.append(seconds)
      logging.warning("sleeping %.1f s inside a P-Reduce, alive (fail_where=slow)", seconds)
      time.sleep(seconds)

  return hook


def mark(worker: Worker, loop: Loop, log: RunLog, trace, entry, workdir) -> int | None:
  """A marker reached the head of this worker's queue: every group before it in the global order has
  run here and none after it, on every worker, so what each worker saves here is one consistent cut."""
  _, kind, ident = entry
  trace.add(k="mark", kind=kind, id=ident, c=loop.epoch, t=worker.now(), s=loop.steps_done)
  if kind == "eval":
    loop.evals = ident
    if not loop.joining:  # a joiner holds no model of the run's yet: no part of its average
      save_array(snapshot_path(workdir, f"eval{ident}", worker.me), np.asarray(loop.state["flat"]))
      if worker.outer_step is not None and worker.me == 0:  # DiLoCo's deployable model
        save_array(snapshot_path(workdir, f"eval{ident}", GLOBAL), np.asarray(loop.state["outer"]["global"]))
    return None
  loop.epoch = ident
  if loop.joining:
    return None
  log.checkpoint(ident, worker.pack(loop), cursor(worker, loop, ident), force=True)
  trace.flush()
  return ident


def run_step(worker: Worker, loop: Loop, log: RunLog, feed, trace) -> None:
  """One local step: report its start, compute, pad, trace; stop the worker on a non-finite loss."""
  x, y = worker.batch(loop.steps_done)
  t0 = time.perf_counter()
  feed.report(loop.steps_done + 1, t0 - worker.t_start, loop.last_step_time, loop.last_gid, loop.epoch)
  grads, ms, loss = worker.grad_fn(loop.state["flat"], x, y)
  loss = float(loss)  # blocks: the step's real time is what the padding and the reports need
  tc = time.perf_counter()
  worker.pad(t0, tc, loop.steps_done)  # the padded step computes until here; then its gradient lands
  loop.state["flat"], loop.state["opt_state"] = worker.apply_fn(
    loop.state["flat"], loop.state["opt_state"], grads, ms
  )
  loop.state["flat"].block_until_ready()
  t1 = time.perf_counter()
  loop.last_step_time = t1 - t0
  end_step(worker, loop, log, trace, loop.epoch, (t0, tc, t1), loss)

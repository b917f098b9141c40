"""AD-PSGD in the runtime (Lian et al., ICML'18; docs/design.md 3.4, 3.7): no authority, no global order.

Active workers (odd ids) average with one random passive worker (even ids) in every local step;
passive workers only respond, so the waits-for graph is bipartite and no cycle of waits can form.

  active a:  read x -> pick p, post ripples/ad/<p>/<a>/<r>, and average (a, p) on x in a
             communication thread | meanwhile compute the gradient on x -> apply it to the average
             (Lian et al.'s order: the average is atomic and overlaps the gradient's computation; the
             gradient of the parameters read is applied to the averaged model)
  passive p: its main thread steps; a communication thread serves the posted requests one at a time
             in arrival order, each a pair average with p's *current* parameters.

runtime.adpsgd_passive:
  concurrent (as published)  the communication thread serves while p computes: p's gradient is
             computed on the parameters it held when its step started and applied to whatever they
             are when it ends (averaged meanwhile or not). A lock makes each average and each
             gradient application atomic on p's parameters; that is all p ever waits for.
  blocking   p serves the requests that arrived only between its own steps (the form in which
             the passive side's compute stops for its averages), for comparison.
Trace: a served average is a group event with "during": the step it landed in (concurrent), and an
active worker's own average one with "during" and "own"; the replay puts each between that step's
start and apply, exactly the engine's AD-PSGD semantics (START, AVG, APPLY).
The run ends when every worker has taken num_steps steps; a passive worker keeps serving until every
active one is done. Checkpoints: the final state only (no global order to put a marker in).
"""

import concurrent.futures
import os
import queue
import threading
import time

import jax
import numpy as np
from absl import logging

from ripples_jax import setup as setup_lib
from ripples_jax.distributed import coord
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.runlog import RunLog, make_workdir
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.authority import values_in_order
from ripples_jax.runtime.worker import (
  Loop,
  Worker,
  end_of_run,
  end_step,
  result,
  snapshot_path,
  watch,
  watched,
)

DONE = "done"


class Passive:
  """The passive side: listener threads (one per active worker) feed one FIFO; the server takes
  requests from it (concurrent mode: its own thread; blocking mode: the main thread between steps)."""

  def __init__(self, worker: Worker, loop: Loop, kv, trace, concurrent: bool):
    self.worker, self.loop, self.kv, self.trace = worker, loop, kv, trace
    self.lock = threading.Lock()
    self.computing = None  # the local step in flight (between its start and its apply)
    self.applied = 0  # local steps applied so far
    self.inbox = queue.Queue()
    self.actives = list(range(1, worker.config.num_workers, 2))
    self.done = set()
    self.served = 0
    for a in self.actives:
      threading.Thread(target=self._listen, args=(a,), name=f"ripples-ad-listen-{a}", daemon=True).start()
    self.thread = None
    if concurrent:
      self.thread = threading.Thread(target=self._serve_forever, name="ripples-ad-serve", daemon=True)
      self.thread.start()

  def _listen(self, a: int) -> None:
    try:
      for value in values_in_order(self.kv, f"{coord.PREFIX}/ad/{self.worker.me}/{a}"):
        self.inbox.put((a, value))
        if value == DONE:
          return
    except Exception as e:  # noqa: BLE001  raised by the server, which the watchdog then explains
      self.inbox.put(e)

  def serve_one(self, block: bool) -> bool:
    """Serves one request (waiting for one when `block`); False when there was none."""
    try:
      item = self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait()
    except queue.Empty:
      return False
    if isinstance(item, Exception):
      raise item
    a, value = item
    if value == DONE:
      self.done.add(a)
      return True
    me, loop = self.worker.me, self.loop
    with self.lock:  # atomic on this worker's parameters: no gradient is applied halfway through
      t0 = self.worker.now()
      loop.state["flat"] = self.worker.averager.average(tuple(sorted((a, me))), loop.state["flat"])
      loop.state["flat"].block_until_ready()
      # Where it landed in this worker's order: inside a step (between its start and apply), or
      # after `applied` steps (the step's own trace line comes later, after its padding).
      where = {"during": self.computing} if self.computing is not None else {"after": self.applied}
      self.trace.add(
        k="group", c=0, g=f"{a}.{value}", m=sorted((a, me)), t0=t0, t1=self.worker.now(), **where
      )
    self.served += 1
    return True

  def _serve_forever(self) -> None:
    try:
      while len(self.done) < len(self.actives):
        self.serve_one(block=True)
    except Exception as e:  # noqa: BLE001  a lost peer: the watchdog names it
      logging.warning("worker %d: AD-PSGD server stopped: %s", self.worker.me, e)

  def drain(self) -> None:
    """Blocking mode, between two steps: serve what has arrived."""
    while self.serve_one(block=False):
      pass

  def finish(self) -> None:
    """Serve until every active worker is done."""
    if self.thread is not None:
      self.thread.join()
    else:
      while len(self.done) < len(self.actives):
        self.serve_one(block=True)


def step(worker: Worker, loop: Loop, log: RunLog, trace, passive: Passive | None, average=None) -> None:
  """One local step. The passive side computes its gradient outside the lock, on the params read at
  its start, and applies it under the lock to the params as they are then. The active side
  (`average`: its pair average, started on the params read at the step's start) applies its gradient
  to the averaged params once both are done."""
  x, y = worker.batch(loop.steps_done)
  t0 = time.perf_counter()
  lock = passive.lock if passive is not None else threading.Lock()
  with lock:
    flat = loop.state["flat"]
    if passive is not None:
      passive.computing = loop.steps_done
  pending = average(flat) if average is not None else None  # runs while the gradient is computed
  grads, ms, loss = worker.grad_fn(flat, x, y)
  loss = float(loss)  # blocks: the gradient is ready
  tc = time.perf_counter()
  worker.pad(t0, tc, loop.steps_done)  # the padded step computes until here; then its gradient lands
  if pending is not None:
    loop.state["flat"] = pending.result()  # the averaged params (x is no longer this worker's)
  with lock:
    loop.state["flat"], loop.state["opt_state"] = worker.apply_fn(
      loop.state["flat"], loop.state["opt_state"], grads, ms
    )
    loop.state["flat"].block_until_ready()
    if passive is not None:
      passive.computing = None
      passive.applied += 1
  end_step(worker, loop, log, trace, 0, (t0, tc, time.perf_counter()), loss)


def run(config, workdir: str) -> dict:
  rt, n = config.runtime, config.num_workers
  sigterm = coord.SigtermStop(name=f"worker {coord.worker_of(jax.process_index())}").install()
  s = setup_lib.build(config)
  workdir = make_workdir(workdir, config)
  kv = coord.client()
  worker = Worker(config, s)
  me = worker.me
  worker.warm_up()
  with worker.run_log(workdir) as log:
    # No mid-run markers: a fresh start, refused (nothing deleted) where an earlier run's final
    # checkpoints are.
    resume_lib.restore_common(log, kv, me, n, None, rt.stall_timeout, resumable=False, what="worker")
    if me == 0:
      resume_lib.publish_point(kv, log, None)  # the coordinator's: a fresh start
    loop = Loop(worker.fresh())
    trace = trace_lib.TraceWriter(workdir, me)
    progress, watchdog = watch(kv, me, n, rt, sigterm, steps=0)
    kv.wait_at_barrier(f"{coord.PREFIX}/start/0", int(rt.stall_timeout * 1000))
    worker.t_start = time.perf_counter()
    os.makedirs(os.path.join(workdir, "snapshots"), exist_ok=True)
    np.save(snapshot_path(workdir, "eval0", me), np.asarray(loop.state["flat"]))
    trace.add(k="mark", kind="eval", id=0, c=0, t=0.0, s=0)
    passive = Passive(worker, loop, kv, trace, rt.adpsgd_passive == "concurrent") if me % 2 == 0 else None
    rng = np.random.default_rng([3, config.seed, me])
    sent = {p: 0 for p in range(0, n, 2)}  # requests this active worker posted to each passive one
    comm = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ripples-ad-comm")
    watchdog.start()
    with watched(watchdog, trace, rt):
      while loop.steps_done < config.num_steps:
        average = average_with_passive(worker, loop, kv, trace, rng, sent, comm) if me % 2 == 1 else None
        step(worker, loop, log, trace, passive, average)
        progress["steps"] = loop.steps_done
        if passive is not None and passive.thread is None:
          passive.drain()
        if (
          config.eval_every
          and loop.steps_done % config.eval_every == 0
          and loop.steps_done < config.num_steps
        ):
          ident = loop.steps_done // config.eval_every
          np.save(snapshot_path(workdir, f"eval{ident}", me), np.asarray(loop.state["flat"]))
          trace.add(k="mark", kind="eval", id=ident, c=0, t=worker.now(), s=loop.steps_done)
        progress["events"] += 1
        trace.flush()
      if me % 2 == 1:
        for p, r in sent.items():
          kv.key_value_set(f"{coord.PREFIX}/ad/{p}/{me}/{r}", DONE)
      else:
        passive.finish()
      comm.shutdown(wait=True)  # nothing is left on it: every step waited for its own average
      end_of_run(worker, loop, log, kv, trace, progress, workdir)
    watchdog.stop()
    return result(worker, loop, log, workdir)


def average_with_passive(worker: Worker, loop: Loop, kv, trace, rng, sent: dict, comm):
  """The active side's average for the step about to start: flat -> a future of the pair average of
  flat with a random passive worker's params, run on the communication thread `comm` (it blocks until
  that worker's server joins it). The request is posted first, so the passive side can join at once."""
  n, me, s = worker.config.num_workers, worker.me, loop.steps_done
  p = int(rng.choice(np.arange(0, n, 2)))
  key = f"{p}.{sent[p]}"
  kv.key_value_set(f"{coord.PREFIX}/ad/{p}/{me}/{sent[p]}", key)
  sent[p] += 1

  def run(flat):
    t0 = worker.now()
    out = worker.averager.average(tuple(sorted((me, p))), flat)
    out.block_until_ready()
    trace.add(k="group", c=0, g=f"{me}.{key}", m=sorted((me, p)), t0=t0, t1=worker.now(), during=s, own=True)
    return out

  return lambda flat: comm.submit(run, flat)

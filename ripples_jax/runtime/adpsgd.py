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

runtime.elastic (docs/design.md 3.12; runtime/membership.py's Roster, served by the coordinator):
  death    an active worker picks among the passive workers its roster view holds live; an exchange
           with a dead one fails at once (its connection was made before the run) and the active worker
           applies its gradient to its own model (the simulator's rule, 3.10); a passive worker serves
           on, and stops waiting for a dead active one's DONE once the roster drops it
  budget   the run's total, num_steps x num_workers local steps: each step first takes a ticket
           (membership.take_ticket), so the live make up the dead ones' steps; a leave gives the dead
           life's ticket back (the step it died inside is made up too)
  rejoin   a restarted process copies a random live passive worker other than itself (weight 0 in
           that exchange: fresh optimizer state at its own schedule step) before its first step, then
           serves (passive) or picks partners (active) as before. A passive rejoiner copies a passive
           worker, not an active one: an active one would serve the copy between its steps, while it
           may itself be waiting, in its step, for the rejoiner to serve it (a cycle the bipartite
           order exists to rule out). Requests go on channels per pair of lives (membership.channel),
           and the pair's connection is that of its lives, each on its own device (membership.pair_key)
"""

import concurrent.futures
import os
import queue
import threading
import time

import jax
import numpy as np
from absl import logging

from ripples_jax.distributed import coord, wire
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.distributed.kvstore import Either, values_in_order
from ripples_jax.distributed.markers import fail_now
from ripples_jax.runlog import RunLog
from ripples_jax.runlog.storage import save_array
from ripples_jax.runtime import membership
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.process import (
  Loop,
  Worker,
  ask_back,
  end_of_run,
  end_step,
  fails_here,
  open_worker,
  result,
  snapshot_path,
  watch,
  watched,
)

DONE = "done"
JOIN = "join"  # a rejoiner's request: the pair exchange in which it has weight 0 (it takes the server's)
AVG = "avg"


class Passive:
  """The serving side: listener threads (one per client life) feed one FIFO; the server takes
  requests from it (concurrent mode: its own thread; blocking mode: the main thread between steps).
  Its clients: the active workers (elastic: every other worker, whose rejoiners may ask for a copy)."""

  def __init__(
    self, worker: Worker, loop: Loop, log: RunLog, kv, trace, concurrent: bool, view=None, progress=None
  ):
    self.worker, self.loop, self.log, self.kv, self.trace = worker, loop, log, kv, trace
    # The heartbeat's counts: a request served is progress. A passive worker done with its own steps
    # serves a straggler's requests until that one's DONE; without counting them its beats stood
    # still for longer than stall_timeout, and once the straggler was done the peers' watchdogs saw
    # only it running, "stalled", and ended a run that was finishing.
    self.progress = progress
    self.view = view  # elastic: the roster view (who is live, each worker's incarnation)
    self.lock = threading.Lock()
    self.computing = None  # the local step in flight (between its start and its apply)
    self.applied = loop.steps_done  # local steps applied so far
    self.inbox = queue.Queue()
    n, me = worker.config.num_workers, worker.me
    self.actives = list(range(1, n, 2))
    self.clients = [w for w in range(n) if w != me] if view is not None else self.actives
    self.done = set()  # the (client, incarnation) lives that sent DONE
    self.served = 0
    self.listening = {}  # client -> (its incarnation listened to, that listener's stop)
    self._stop = threading.Event()
    for c in self.clients:
      self._listen_to(c, self.incs[c])
    if view is not None:
      view.on_change = self._roster_changed
    self.thread = None
    if concurrent:
      self.thread = threading.Thread(target=self._serve_forever, name="ripples-ad-serve", daemon=True)
      self.thread.start()

  @property
  def incs(self):
    return self.view.incs if self.view is not None else [0] * self.worker.config.num_workers

  @property
  def my_inc(self) -> int:
    return self.incs[self.worker.me]

  def _listen_to(self, client: int, inc: int) -> None:
    old = self.listening.get(client)
    if old is not None:
      old[1].set()  # its earlier life's channel is read no more
    quiet = threading.Event()
    self.listening[client] = (inc, quiet)
    prefix = membership.channel(self.worker.me, self.my_inc, client, inc)
    args = (client, inc, prefix, Either(self._stop, quiet))
    threading.Thread(target=self._listen, args=args, name=f"ripples-ad-listen-{client}", daemon=True).start()

  def _roster_changed(self, incs, alive) -> None:
    for c in self.clients:
      if incs[c] != self.listening[c][0]:  # a rejoined client: its new life's channel
        self._listen_to(c, incs[c])

  def _listen(self, client: int, inc: int, prefix: str, stop) -> None:
    try:
      for r, value in enumerate(values_in_order(self.kv, prefix, stop, consume=True)):
        if wire.token(f"{prefix}/{r}", value, (DONE, JOIN, AVG)) is None:
          continue  # not the client's (one warning): no exchange is entered for it
        self.inbox.put((client, inc, r, value))
        if value == DONE:
          return
    except Exception as e:  # noqa: BLE001  raised by the server, which the watchdog then explains
      self.inbox.put(e)

  def pending(self) -> list:
    """The active workers this server still waits for: live, and their life has not sent DONE."""
    incs, alive = self.incs, self.view.alive if self.view is not None else None
    return [a for a in self.actives if (alive is None or alive[a]) and (a, incs[a]) not in self.done]

  def serve_one(self, block: bool) -> bool:
    """Serves one request (waiting for one when `block`); False when there was none."""
    try:
      item = self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait()
    except queue.Empty:
      return False
    if isinstance(item, Exception):
      raise item
    client, inc, r, value = item
    if value == DONE:
      self.done.add((client, inc))
      if self.progress is not None:
        self.progress["events"] += 1
      return True
    if self.view is not None and not self.view.fresh().alive[[self.worker.me, client]].all():
      # This worker was removed (it stalled: its watchdog exits it) or the client was (a stalled one
      # that went on): no average across a removal. The client's exchange times out and fails.
      return True
    me, loop = self.worker.me, self.loop
    with self.lock:  # atomic on this worker's parameters: no gradient is applied halfway through
      t0 = self.worker.now()
      # Where it landed in this worker's order: inside a step (between its start and apply), or
      # after `applied` steps (the step's own trace line comes later, after its padding).
      where = {"during": self.computing} if self.computing is not None else {"after": self.applied}
      lives = {me: self.my_inc, client: inc}
      joiner = client if value == JOIN else None
      event = exchange(self.worker, loop, self.log, client, lives, joiner, exchange_id(client, me, lives, r))
      self.trace.add(**event, t0=t0, t1=self.worker.now(), **where)
    self.served += 1
    if self.progress is not None:
      self.progress["events"] += 1
    return True

  def _serve_forever(self) -> None:
    try:
      while self.pending():
        self.serve_one(block=True)
    except Exception as e:  # noqa: BLE001  a lost peer: the watchdog names it
      logging.warning("worker %d: AD-PSGD server stopped: %s", self.worker.me, e)

  def drain(self) -> None:
    """Blocking mode, between two steps: serve what has arrived."""
    while self.serve_one(block=False):
      pass

  def finish(self) -> None:
    """Serve until every (live) active worker is done."""
    if self.thread is not None:
      self.thread.join()
    else:
      while self.pending():
        self.serve_one(block=True)
    self._stop.set()


def exchange_id(client: int, server: int, lives: dict, r: int) -> str:
  return membership.exchange_id(client, lives[client], server, lives[server], r)


def exchange(
  worker: Worker, loop: Loop, log: RunLog, other: int, lives: dict, joiner: int | None, g: str
) -> dict:
  """The pair exchange of this worker's params with `other`'s, in place on loop.state["flat"]; its
  trace event (without times). lives: the pair's incarnations (their connection key). Elastic: a
  failed exchange keeps this worker's params (event "failed"); `joiner` (a rejoiner's copy) has weight
  0: it takes the other's params, which the other keeps. Non-elastic runs take the plain average (no
  lives in the event: the layout of runs before elastic membership)."""
  me, pair = worker.me, tuple(sorted((worker.me, other)))
  event = {"k": "group", "c": 0, "g": g, "m": list(pair)}
  if loop.incs is None:
    loop.state["flat"] = worker.averager.average(pair, loop.state["flat"])
    loop.state["flat"].block_until_ready()
    return event
  incs = [0] * worker.config.num_workers
  for m, inc in lives.items():
    incs[m] = inc
  hook = None
  if fails_here(worker, loop, "preduce"):  # fault injection: killed right after this exchange
    hook = lambda: fail_now(log, None, loop.steps_done, me)  # noqa: E731
  joiners = () if joiner is None else (joiner,)
  flat, failed = worker.averager.average_elastic(pair, loop.state["flat"], joiners, incs, hook, attempt=g)
  flat.block_until_ready()
  loop.state["flat"] = flat
  event["i"] = [incs[m] for m in pair]
  if joiners:
    event["join"] = list(joiners)
  if failed:
    event["failed"] = failed
    causes = getattr(worker.averager, "causes", {})
    event["cause"] = [causes.get(m, "unknown") for m in failed]
  return event


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
  sigterm, workdir, kv, worker = open_worker(config, workdir)
  me = worker.me
  worker.warm_up()
  if rt.elastic and membership.started(kv):  # the run is on: this process is a restart
    return rejoin(worker, kv, workdir, sigterm)
  if rt.elastic:  # every pair connected before the run: an exchange with a dead peer fails at once
    worker.averager.precompile(jax.ShapeDtypeStruct(worker._flat0.shape, worker._flat0.dtype))
    worker.averager.connect_all(worker.fresh()["flat"])
  with worker.run_log(workdir) as log:
    # No mid-run markers: a fresh start, refused (nothing deleted) where an earlier run's final
    # checkpoints are.
    resume_lib.restore_common(log, kv, me, n, None, rt.stall_timeout, resumable=False, what="worker")
    if me == 0:
      resume_lib.publish_point(kv, log, None)  # the coordinator's: a fresh start
    loop = Loop(worker.fresh(), incs=[0] * n if rt.elastic else None)
    trace = trace_lib.TraceWriter(workdir, me, write_through=rt.elastic)
    inc = 0 if rt.elastic else None
    progress, watchdog = watch(kv, me, n, rt, sigterm, steps=0, incarnation=inc)
    view = membership.RosterView(kv, rt.heartbeat_s) if rt.elastic else None
    kv.wait_at_barrier(f"{coord.PREFIX}/start/0", int(rt.stall_timeout * 1000))
    worker.t_start = time.perf_counter()
    os.makedirs(os.path.join(workdir, "snapshots"), exist_ok=True)
    save_array(snapshot_path(workdir, "eval0", me), np.asarray(loop.state["flat"]))
    trace.add(k="mark", kind="eval", id=0, c=0, t=0.0, s=0)
    train(worker, loop, log, kv, trace, progress, watchdog, view, workdir)
    return result(worker, loop, log, workdir)


def train(
  worker: Worker, loop: Loop, log: RunLog, kv, trace, progress, watchdog, view, workdir, sent=None
) -> None:
  """The steps (a fresh worker's from the start, a rejoiner's from its copy) to the end of the run.
  sent: the requests this life posted so far, per channel (a rejoiner's copy)."""
  config, rt, me = worker.config, worker.rt, worker.me
  serves_concurrently = rt.adpsgd_passive == "concurrent"
  passive = (
    Passive(worker, loop, log, kv, trace, serves_concurrently, view, progress) if me % 2 == 0 else None
  )
  life = loop.incs[me] if loop.incs else 0  # a rejoiner's draws are its own, not its last life's again
  rng = np.random.default_rng([3, config.seed, me] + ([life] if life else []))
  sent = {} if sent is None else sent  # (passive worker, its incarnation) -> requests posted on that channel
  comm = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ripples-ad-comm")
  if view is not None:
    view.start()
  watchdog.start()
  with watched(watchdog, trace, rt):
    while (point := next_step(worker, loop, kv)) is not None:
      if fails_here(worker, loop, "step"):
        fail_now(log, None, loop.steps_done, me)
      average = average_with_passive(worker, loop, log, kv, trace, rng, sent, comm, view) if me % 2 else None
      step(worker, loop, log, trace, passive, average)
      progress["steps"] = loop.steps_done
      if passive is not None and passive.thread is None:
        passive.drain()
      if (ident := eval_due(worker, loop, point)) is not None:
        loop.evals = ident
        save_array(snapshot_path(workdir, f"eval{ident}", me), np.asarray(loop.state["flat"]))
        trace.add(k="mark", kind="eval", id=ident, c=0, t=worker.now(), s=loop.steps_done)
      progress["events"] += 1
      trace.flush()
    if me % 2 == 1:
      send_done(worker, kv, sent, view)
    else:
      passive.finish()
    comm.shutdown(wait=True)  # nothing is left on it: every step waited for its own average
    if view is not None:
      view.stop()
    end_of_run(worker, loop, log, kv, trace, progress, workdir)
  watchdog.stop()


def next_step(worker: Worker, loop: Loop, kv) -> int | None:
  """The point of the run this worker's next step is (None: no step left): its own step count of
  num_steps, or (elastic) its ticket of the run's num_steps x num_workers."""
  c = worker.config
  if loop.incs is None:
    return loop.steps_done + 1 if loop.steps_done < c.num_steps else None
  return membership.take_ticket(kv, c.num_steps * c.num_workers)


def eval_due(worker: Worker, loop: Loop, point: int) -> int | None:
  """The evaluation marker this step ends at, if any. Each worker saves eval k after its own step
  k x eval_every; elastic, after its first step once the run's tickets passed k x eval_every x
  num_workers, so every live worker saves k within about a step of the others, a rejoiner included
  (its own step count lags the run's: its snapshots would come late, and the evaluation's time is
  its last worker's)."""
  c = worker.config
  if not c.eval_every:
    return None
  per = c.eval_every * (1 if loop.incs is None else c.num_workers)
  ident = point // per
  return ident if loop.evals < ident and ident * c.eval_every < c.num_steps else None


def send_done(worker: Worker, kv, sent: dict, view) -> None:
  """An active worker's last word to every passive one, on the channel of that one's current life
  (the roster read once more, so a passive rejoiner's new channel is not missed)."""
  n, me = worker.config.num_workers, worker.me
  if view is not None:
    view.poll()
  incs = view.incs if view is not None else [0] * n
  for p in range(0, n, 2):
    r = sent.get((p, incs[p]), 0)
    kv.key_value_set(f"{membership.channel(p, incs[p], me, incs[me])}/{r}", DONE)


def pick_passive(worker: Worker, rng, view, exclude=()) -> int | None:
  """A random passive worker (elastic: a live one, per this worker's roster view), or None."""
  n = worker.config.num_workers
  candidates = np.arange(0, n, 2)
  if view is not None:
    candidates = candidates[view.alive[candidates]]
    candidates = candidates[~np.isin(candidates, [worker.me, *exclude])]
  return int(rng.choice(candidates)) if len(candidates) else None


def request(worker: Worker, kv, sent: dict, p: int, lives: dict, what: str) -> str:
  """Posts this worker's next request on its channel to passive p; the exchange's id."""
  me = worker.me
  r = sent.get((p, lives[p]), 0)
  sent[(p, lives[p])] = r + 1
  kv.key_value_set(f"{membership.channel(p, lives[p], me, lives[me])}/{r}", what)
  return exchange_id(me, p, lives, r)


def average_with_passive(worker: Worker, loop: Loop, log: RunLog, kv, trace, rng, sent: dict, comm, view):
  """The active side's average for the step about to start: flat -> a future of the pair average of
  flat with a random passive worker's params, run on the communication thread `comm` (it blocks until
  that worker's server joins it). The request is posted first, so the passive side can join at once.
  None when no passive worker is live (elastic): the step has no average."""
  s, me = loop.steps_done, worker.me
  if view is not None and not view.fresh().alive[me]:
    return None  # removed (it stalled): no average; its watchdog exits it at its next beat
  p = pick_passive(worker, rng, view)
  if p is None:
    return None
  incs = view.incs if view is not None else [0] * worker.config.num_workers
  lives = {me: incs[me], p: incs[p]}
  g = request(worker, kv, sent, p, lives, AVG)

  def run(flat):
    t0 = worker.now()
    event = exchange(worker, loop, log, p, lives, None, g)  # on loop.state["flat"], which is `flat`
    trace.add(**event, t0=t0, t1=worker.now(), during=s, own=True)
    return loop.state["flat"]

  return lambda flat: comm.submit(run, flat)


def rejoin(worker: Worker, kv, workdir: str, sigterm) -> dict:
  """A restarted process of an elastic run: asks the coordinator's roster to take it back, continues
  its trace and data shard where its last life's record ends, copies a live passive worker (weight 0;
  fresh optimizer state at its own schedule step) and trains on to the run's end."""
  rt, me, n = worker.rt, worker.me, worker.config.num_workers
  got, before = ask_back(worker, kv, workdir)
  loop = Loop(
    worker.fresh(), steps_done=sum(e["k"] == "step" for e in before), incs=got["incs"], joining=True
  )
  logging.warning(
    "worker %d: rejoining the run as incarnation %d after %d local steps", me, got["inc"], loop.steps_done
  )
  with worker.run_log(workdir) as log:
    trace = trace_lib.TraceWriter(workdir, me, append=True, write_through=True)
    trace.add(k="rejoin", c=0, inc=got["inc"], g0=0, t=worker.now(), s=loop.steps_done)
    progress, watchdog = watch(kv, me, n, rt, sigterm, steps=loop.steps_done, incarnation=got["inc"])
    view = membership.RosterView(kv, rt.heartbeat_s)
    sent = copy_on_rejoin(worker, loop, log, kv, trace, view)
    train(worker, loop, log, kv, trace, progress, watchdog, view, workdir, sent)
    return result(worker, loop, log, workdir)


def copy_on_rejoin(worker: Worker, loop: Loop, log: RunLog, kv, trace, view) -> dict:
  """A rejoiner's first exchange: it takes a random live passive worker's params (its own weight 0)
  and fresh optimizer state at its own schedule step. A failed copy (that worker died too) tries
  another; with none left it starts from its own (initial) params. Returns the requests it posted,
  per channel (its later requests continue them)."""
  me, tried, sent = worker.me, [], {}
  rng = np.random.default_rng([6, worker.config.seed, me, loop.incs[me]])
  while (p := pick_passive(worker, rng, view, exclude=tried)) is not None:
    lives = {me: loop.incs[me], p: view.incs[p]}
    t0 = worker.now()
    event = exchange(worker, loop, log, p, lives, me, request(worker, kv, sent, p, lives, JOIN))
    trace.add(**event, t0=t0, t1=worker.now())
    if not event.get("failed"):
      break
    tried.append(p)
  if p is None:
    logging.warning("worker %d: no live passive worker to copy; it starts from its own params", me)
  loop.state["opt_state"] = worker.schedule_at(loop.state["opt_state"], loop.steps_done)
  loop.joining = False
  return sent

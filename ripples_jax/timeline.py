"""Discrete-event clock: worker speeds + a network cost model -> the ordered events of a run.

The clock never touches arrays. It decides *when* each worker starts a gradient, when the gradient is
applied, and when a group average lands; the engine then executes those events in order (a schedule
says what happens; an executor makes it happen; a clock says when). Gradients are computed on the
parameters a worker holds when its computation starts and applied to what it holds when it finishes
(AD-PSGD semantics), so staleness from averages landing mid-computation is modelled exactly.

Events are tuples (time, kind, a, b):
  START  a=worker              compute a gradient on the worker's current params (its next batch)
  APPLY  a=target, b=source    apply source's finished gradient to target's params (target=source,
                               or the parameter server's slot for asynchronous PS)
  AVG    a=members tuple       replace each member's params by the members' mean (atomic, at `time`)
  RING   -                     D-PSGD gossip on the ring: x_i <- (x_{i-1} + x_i + x_{i+1}) / 3
  PULL   a=worker, b=source    copy source's params (the server) into the worker
"""

import dataclasses
import heapq
import itertools
from typing import Callable

import numpy as np

from ripples_jax.collectives import ring_allreduce_time
from ripples_jax.schedule.group_gen import Fixed
from ripples_jax.schedule.online import GROUP, Service, fixed_entry

START, APPLY, AVG, RING, PULL = range(5)
EVENT_NAMES = ("start", "apply", "average", "ring", "pull")
COMPUTE, WAIT, COMM = "compute", "wait", "comm"
SYNC_ALGORITHMS = ("allreduce", "ps_sync", "dpsgd")


@dataclasses.dataclass(frozen=True)
class SpeedModel:
  """Per-worker compute time of one step: base x slowdown x jitter.

  The slowdown hits the fixed slow workers, or, with `rotate_every` > 0, a straggler that moves: at
  time t the slow worker is (slow_workers[0] + floor(t / rotate_every)) mod n (`slow_at`, the same
  rule the runtime applies on its wall clock); or every worker with probability `random_p` per step.
  """

  base_time: float
  num_workers: int
  slow_workers: tuple = ()
  slowdown: float = 1.0
  random_p: float = 0.0
  jitter: float = 0.0  # sigma of a lognormal factor (real steps are never exactly equal)
  seed: int = 0
  times: tuple = ()  # per-worker step times replacing base_time x slowdown (measured times)
  rotate_every: float = 0.0

  def streams(self):
    """One independent stream of step-time factors per worker, so a worker's times never depend on
    the order of events; drawn in blocks because the clock asks for one number at a time."""
    return [self._stream(w) for w in range(self.num_workers)]

  def _stream(self, w: int):
    rng = np.random.default_rng([2, self.seed, w])
    while True:
      t = np.ones(1024)
      if self.random_p:
        t *= np.where(rng.random(1024) < self.random_p, self.slowdown, 1.0)
      if self.jitter:
        t *= np.exp(self.jitter * rng.standard_normal(1024))
      yield from t.tolist()

  def draw(self, streams, worker: int, now: float = 0.0) -> float:
    base = self.times[worker] if self.times else self.base_time
    if worker in slow_at(self.slow_workers, self.num_workers, self.rotate_every, now):
      base *= self.slowdown
    return base * next(streams[worker])


def slow_at(slow_workers, num_workers: int, rotate_every: float, t: float) -> tuple:
  """The fixed slow workers at time t (seconds: virtual in the simulator, wall clock in the runtime)."""
  if not slow_workers or not rotate_every:
    return tuple(slow_workers)
  return ((slow_workers[0] + int(t // rotate_every)) % num_workers,)


@dataclasses.dataclass(frozen=True)
class Network:
  """alpha-beta costs (seconds, bytes/s) for a model of `model_bytes` (docs/design.md 3.1)."""

  model_bytes: float
  alpha: float = 5e-6
  bandwidth: float = 1.25e9  # per link (10 Gb/s)
  ps_bandwidth: float = 1.25e9  # the parameter server's link

  def allreduce(self, k: int) -> float:
    return ring_allreduce_time(k, self.model_bytes, self.alpha, self.bandwidth)

  def ps_transfer(self) -> float:
    return self.alpha + self.model_bytes / self.ps_bandwidth

  def ps_sync_step(self, n: int) -> float:
    # Every worker pushes M and pulls M through the server's one link: 2 n M bytes.
    return 2 * self.alpha + 2 * n * self.model_bytes / self.ps_bandwidth

  def ring_gossip(self) -> float:
    return 2 * self.alpha + 2 * self.model_bytes / self.bandwidth


@dataclasses.dataclass
class Trace:
  """The clock's output: ordered events, per-worker intervals and counters."""

  num_workers: int
  events: list = dataclasses.field(default_factory=list)
  intervals: list = dataclasses.field(default_factory=list)  # (worker, kind, t0, t1)
  worker_steps: np.ndarray = None
  conflicts: np.ndarray = None
  end_time: float = 0.0
  buffer: object = None  # the Group Buffer of a Ripples run (its groups, in global order)
  requests: int = 0  # requests sent to the Group Generator
  pairs: list = None  # AD-PSGD's (active, passive) averaging pairs

  def __post_init__(self):
    self.worker_steps = np.zeros(self.num_workers, np.int64)
    self.conflicts = np.zeros(self.num_workers, np.int64)

  def time_split(self) -> dict:
    """Seconds each worker spent computing, waiting for a group or the server, and communicating."""
    out = {k: np.zeros(self.num_workers) for k in (COMPUTE, WAIT, COMM)}
    for w, kind, t0, t1 in self.intervals:
      out[kind][w] += t1 - t0
    return out


def simulate(
  algorithm: str,
  speed: SpeedModel,
  net: Network,
  total_steps: int,
  time_budget: float = 0.0,
  gg: Callable | None = None,
  seed: int = 0,
  rtt: float = 0.0,
  ahead: bool = True,
  adpsgd_cost: "AdpsgdCost | None" = None,
  server: "AuthorityCost | None" = None,
) -> Trace:
  """Runs the clock until `total_steps` gradients (all workers together) are applied or time runs out.

  `rtt`: seconds a request to the Group Generator takes to be answered (the online protocol); `ahead`:
  a worker requests its next group when its step starts (schedule.request_ahead); `adpsgd_cost`: the
  AD-PSGD cost model's parts (AdpsgdCost; default: as published); `server`: what the runtime's
  authority and group set-up cost (AuthorityCost; default: nothing)."""
  budget = time_budget or float("inf")
  if algorithm in SYNC_ALGORITHMS:
    return _simulate_sync(algorithm, speed, net, total_steps, budget)
  clock = _Clock(speed, total_steps, budget)
  if algorithm == "adpsgd":
    _adpsgd(clock, net, np.random.default_rng([3, seed]), adpsgd_cost or AdpsgdCost())
  elif algorithm == "ps_async":
    _ps_async(clock, net)
  else:
    _group_buffer(clock, net, gg, rtt, ahead and getattr(gg, "ask_ahead", False), server or AuthorityCost())
  return clock.finish()


@dataclasses.dataclass(frozen=True)
class AuthorityCost:
  """What the runtime pays for the Group Generator and for groups, beyond the round trip:
    service     seconds of the authority's work per request; it is one server (requests queue, FIFO),
                so a busy authority delays answers (measured: benchmarks.bench_authority, busy_s /
                requests)
    setup       seconds a group pays the first time it meets a member set (setup_unit=group: its
                members; pair: each pair of them, runtime.preduce=pairs), the P-Reduce program's first
                run (measured: summary.json's group_setup_s / group_compiles)
  Zero (the default) charges nothing, as before."""

  service: float = 0.0
  setup: float = 0.0
  setup_unit: str = "group"


def _simulate_sync(algorithm, speed, net, total_steps, budget) -> Trace:
  """Lockstep: everybody computes, waits for the slowest, then one collective."""
  n = speed.num_workers
  tr = Trace(n)
  rngs = speed.streams()
  comm = {"allreduce": net.allreduce(n), "ps_sync": net.ps_sync_step(n), "dpsgd": net.ring_gossip()}[
    algorithm
  ]
  t = 0.0
  done = 0
  while done < total_steps:
    c = np.array([speed.draw(rngs, w, t) for w in range(n)])
    for w in range(n):
      tr.events.append((t, START, w, None))
    slowest = t + c.max()
    if slowest + comm > budget:
      break
    last = done + n >= total_steps
    for w in np.argsort(c, kind="stable"):
      tr.events.append((t + c[w], APPLY, int(w), int(w)))
      tr.intervals.append((int(w), COMPUTE, t, t + c[w]))
      if t + c[w] < slowest:
        tr.intervals.append((int(w), WAIT, t + c[w], slowest))
      if not last:
        tr.intervals.append((int(w), COMM, slowest, slowest + comm))
    tr.worker_steps += 1
    done += n
    # Every algorithm's run ends when its last gradient lands (the asynchronous ones cannot wait for
    # a final sync), so the last step's collective is not part of the run.
    tr.end_time = slowest
    if done >= total_steps:
      break
    t = slowest + comm
    tr.events.append((t, RING, None, None) if algorithm == "dpsgd" else (t, AVG, tuple(range(n)), None))
  return tr


class _Clock:
  """A heap of timed callbacks plus the bookkeeping every asynchronous protocol shares."""

  def __init__(self, speed: SpeedModel, total_steps: int, budget: float):
    self.speed, self.n, self.total, self.budget = speed, speed.num_workers, total_steps, budget
    self.rngs = speed.streams()
    self.trace = Trace(self.n)
    self.heap, self.seq, self.now, self.done = [], 0, 0.0, 0
    self.stopped = False
    # Plain lists: the clock touches one worker at a time, where numpy indexing costs more than it saves.
    self.started_at = np.zeros(self.n)  # an array: Smart GG reads all of it at every request
    self.duration = [0.0] * self.n  # current compute's duration (known to the clock only)
    self.iterations = [0] * self.n
    self.last_time = [0.0] * self.n  # each worker's newest finished step time

  def at(self, t: float, fn: Callable, *args) -> None:
    heapq.heappush(self.heap, (t, self.seq, fn, args))
    self.seq += 1

  def run(self) -> None:
    while self.heap and not self.stopped:
      t, _, fn, args = heapq.heappop(self.heap)
      if t > self.budget:
        break
      self.now = t
      fn(*args)

  def emit(self, kind, a, b=None) -> None:
    self.trace.events.append((self.now, kind, a, b))

  def start_compute(self, w: int, on_finish: Callable) -> None:
    c = self.speed.draw(self.rngs, w, self.now)
    self.started_at[w], self.duration[w] = self.now, c
    self.emit(START, w)
    self.at(self.now + c, self._finished, w, on_finish)

  def _finished(self, w: int, on_finish: Callable) -> None:
    self.trace.intervals.append((w, COMPUTE, self.started_at[w], self.now))
    self.last_time[w] = self.duration[w]
    self.iterations[w] += 1
    on_finish(w)

  def applied(self, target: int, source: int) -> None:
    """A gradient of `source` lands; the run ends at the total_steps-th one."""
    self.emit(APPLY, target, source)
    self.trace.worker_steps[source] += 1
    self.done += 1
    self.trace.end_time = self.now
    if self.done >= self.total:
      self.stopped = True

  def interval(self, w: int, kind: str, t0: float, t1: float) -> None:
    if t1 > t0:
      self.trace.intervals.append((w, kind, t0, t1))

  def finish(self) -> Trace:
    self.run()
    if not self.stopped:  # time budget: the run ends at the budget
      self.trace.end_time = min(self.budget, max(self.now, self.trace.end_time))
    return self.trace


def _group_buffer(
  clock: _Clock, net: Network, gg, rtt: float, ahead: bool = True, server: AuthorityCost = AuthorityCost()
) -> None:
  """Ripples as the online protocol (schedule/online.py): per local step a worker takes the head of
  its queue; with an empty queue it asks the Group Generator, whose answer arrives `rtt` seconds after
  the request (handled at its midpoint). With `ahead` (generators whose groups do not depend on when
  they are made: online.asks_ahead) a worker whose queue is empty when a step starts sends the request
  for the entry after that step right away, so the round trip overlaps the step. A fixed schedule
  (group_gen.Fixed) has no generator: the entry
  after each step is known locally and costs nothing."""
  n = clock.n
  fixed = isinstance(gg, Fixed)
  service = None if fixed else Service(n, gg, estimate=clock.speed.base_time)
  pos = [0] * n  # next entry of each worker's queue
  last_gid = [-1] * n
  asked = [None] * n  # the queue index of a worker's request in flight
  blocked = [None] * n  # since when a worker waits for its answer
  groups = {}  # gid -> [members, arrived set, arrival times]
  clock.trace.buffer = service.buffer if service else None
  busy_until = [0.0]  # the authority serves one request at a time
  met = set()  # member sets (or pairs) whose set-up has been paid

  def start(w):
    if service is not None:  # what a worker's start report tells the generator (instant here)
      service.report(w, clock.now, clock.last_time[w], clock.iterations[w] + 1, last_gid[w])
    clock.start_compute(w, on_finish)
    if service is not None and ahead and pos[w] >= len(service.entries[w]) and asked[w] is None:
      estimate = clock.last_time[w] or clock.speed.base_time
      ask(w, clock.now + estimate)

  def ask(w, ready_at):
    asked[w] = pos[w]
    if server.service:
      clock.at(clock.now + rtt / 2, queue_at_authority, w, pos[w], ready_at)
    else:
      clock.at(clock.now + rtt / 2, handle, w, pos[w], ready_at)

  def queue_at_authority(w, want, ready_at):  # FIFO: served once the requests before it are
    begin = max(clock.now, busy_until[0])
    busy_until[0] = begin + server.service
    clock.at(busy_until[0], handle, w, want, ready_at)

  def setup_cost(members) -> float:
    units = [tuple(members)] if server.setup_unit == "group" else list(itertools.combinations(members, 2))
    new = [u for u in units if u not in met]
    met.update(new)
    return server.setup * len(new)

  def on_finish(w):
    clock.applied(w, w)
    if not clock.stopped:
      take(w)

  def take(w):
    if fixed:
      entry = fixed_entry(gg.layouts, n, w, clock.iterations[w] - 1)
    elif pos[w] < len(service.entries[w]):
      entry = service.entries[w][pos[w]]
      if asked[w] == pos[w]:
        asked[w] = None
      pos[w] += 1
    else:
      blocked[w] = clock.now
      if asked[w] is None:
        ask(w, clock.now)
      return
    if entry[0] == GROUP:
      arrive(w, entry)
    else:
      start(w)

  def handle(w, want, ready_at):  # at the authority: generate on this arrival, answer after rtt / 2
    service.request(w, want, ready_at)
    clock.at(clock.now + rtt / 2, answered, w)

  def answered(w):
    if blocked[w] is not None:
      clock.interval(w, WAIT, blocked[w], clock.now)
      blocked[w] = None
      take(w)

  def arrive(w, entry):
    _, gid, members = entry
    g = groups.setdefault(gid, [members, set(), {}])
    g[1].add(w)
    g[2][w] = clock.now
    if len(g[1]) == len(members):
      d = net.allreduce(len(members)) + (setup_cost(members) if server.setup else 0.0)
      for m in members:
        clock.interval(m, WAIT, g[2][m], clock.now)
        clock.interval(m, COMM, clock.now, clock.now + d)
      clock.at(clock.now + d, group_end, gid)

  def group_end(gid):
    members = groups.pop(gid)[0]
    clock.emit(AVG, members)
    for m in members:
      last_gid[m] = gid
      start(m)

  for w in range(n):
    start(w)
  clock.run()
  if service is not None:
    clock.trace.conflicts = service.buffer.conflicts
    clock.trace.requests = service.buffer.requests


@dataclasses.dataclass(frozen=True)
class AdpsgdCost:
  """What an AD-PSGD pair average costs beyond moving the bytes, each part switchable (the paper's
  AD-PSGD baseline is slow for reasons it does not itemise; these are the candidates):
    serial          a passive worker serves one atomic average at a time (requests queue, FIFO)
    fixed           seconds added to every average (locking, a gossip thread's hand-off, an RPC)
    passive_blocks  the passive worker's computation stops while it serves an average
  The default is Lian et al.'s AD-PSGD as published: serial atomic averages, nothing else."""

  serial: bool = True
  fixed: float = 0.0
  passive_blocks: bool = False


def _adpsgd(clock: _Clock, net: Network, rng: np.random.Generator, cost: AdpsgdCost = AdpsgdCost()) -> None:
  """AD-PSGD in Lian et al.'s order: as an active (odd) worker's step starts, its communication
  thread averages it with a random passive (even) worker while it computes its gradient on the
  parameters it read; the gradient is applied to the averaged model once both are done (START, AVG,
  APPLY), so an average costs the active worker only what it outlasts the compute.

  The passive side never waits: its averaging lands through its communication channel while it
  computes (with cost.serial, requests to one passive worker serialise, first come first served; with
  cost.passive_blocks its computation pauses for each average it serves). Only active workers
  initiate, so the waits-for graph is bipartite and acyclic: no deadlock.
  """
  n = clock.n
  passive = np.arange(0, n, 2)
  channel_free = np.zeros(n)
  paused = np.zeros(n)  # seconds a passive worker's current step has been paused by averages
  landed = np.ones(n, bool)  # whether an active worker's average for its current step has landed
  held = np.zeros(n, bool)  # its compute ended before the average did: the apply waits for it
  ended = np.zeros(n)  # when its compute ended
  window = {}  # active worker -> (begin, end) of its average in flight
  clock.trace.pairs = []

  def start(w):
    clock.start_compute(w, on_finish)
    if w % 2 == 0:
      return
    j = int(rng.choice(passive))
    begin = max(clock.now, channel_free[j]) if cost.serial else clock.now
    d = net.allreduce(2) + cost.fixed
    channel_free[j] = max(channel_free[j], begin + d)
    if cost.passive_blocks:
      paused[j] += d
    clock.trace.pairs.append((w, j))
    landed[w], window[w] = False, (begin, begin + d)
    clock.at(begin + d, pair_end, w, j)

  def on_finish(w):
    if paused[w] > 0:  # the step is not done: it lost this long to the averages it served
      d, paused[w] = paused[w], 0.0
      clock.interval(w, COMM, clock.now, clock.now + d)
      clock.at(clock.now + d, on_finish, w)
      return
    if not landed[w]:  # the gradient is applied to the averaged model: wait for the average
      held[w], ended[w] = True, clock.now
      return
    apply(w)

  def pair_end(w, j):
    clock.emit(AVG, (j, w))
    landed[w] = True
    if held[w]:  # the compute ended first: what of the average outlasted it shows
      held[w] = False
      begin, end = window[w]
      clock.interval(w, WAIT, ended[w], max(ended[w], begin))
      clock.interval(w, COMM, max(ended[w], begin), end)
      apply(w)

  def apply(w):
    clock.applied(w, w)
    if not clock.stopped:
      start(w)

  for w in range(n):
    start(w)
  clock.run()


def _ps_async(clock: _Clock, net: Network) -> None:
  """Asynchronous parameter server in slot n: pull, compute, push; the server applies on arrival.

  Transfers share the server's one link (first come first served), which is what limits PS at scale.
  """
  n = clock.n
  server = n
  link_free = [0.0]

  def transfer(w, then):
    begin = max(clock.now, link_free[0])
    d = net.ps_transfer()
    link_free[0] = begin + d
    clock.interval(w, WAIT, clock.now, begin)
    clock.interval(w, COMM, begin, begin + d)
    clock.at(begin + d, then, w)

  def pulled(w):
    clock.emit(PULL, w, server)
    clock.start_compute(w, lambda w: transfer(w, pushed))

  def pushed(w):
    clock.applied(server, w)
    if not clock.stopped:
      transfer(w, pulled)

  for w in range(n):
    transfer(w, pulled)
  clock.run()


# Phase of each event kind inside one engine round (engine.make_sim_round_fn): apply, average, pull, start.
_PHASE = {APPLY: 0, AVG: 1, RING: 1, PULL: 2, START: 3}


def pack_rounds(events: list, num_workers: int, num_slots: int):
  """Greedily packs the ordered events into engine rounds without changing what any slot sees.

  A round runs phases apply < average < pull < start. An event joins the current round only if every
  slot it touches has had nothing at this phase or later in the round; otherwise a new round begins.
  Then each slot's events keep their clock order, and an average reads every member exactly at its
  place in that order, so the rounds compute what the ordered events describe.

  Yields dicts of numpy arrays: apply_src, gid, ring, pull_src, start, plus `time` (of the round's last
  event), `applied` (workers whose gradient landed) and `started`.
  """
  ar = np.arange(num_slots, dtype=np.int32)

  def fresh():
    return {
      "apply_src": np.full(num_slots, -1, np.int32),
      "gid": ar.copy(),
      "ring": False,
      "pull_src": ar.copy(),
      "start": np.zeros(num_slots, bool),
      "time": 0.0,
      "applied": [],
    }

  last = np.full(num_slots, -1)
  cur, empty = fresh(), True
  for t, kind, a, b in events:
    phase = _PHASE[kind]
    if kind == APPLY:
      touched = (a, b)
    elif kind == AVG:
      touched = a
    elif kind == RING:
      touched = range(num_workers)
    elif kind == PULL:
      touched = (a, b)
    else:
      touched = (a,)
    if any(last[s] >= phase for s in touched):
      yield cur
      cur, empty = fresh(), True
      last[:] = -1
    if kind == APPLY:
      cur["apply_src"][a] = b
      cur["applied"].append(b)
    elif kind == AVG:
      cur["gid"][list(a)] = min(a)
    elif kind == RING:
      cur["ring"] = True
    elif kind == PULL:
      cur["pull_src"][a] = b
    else:
      cur["start"][a] = True
    for s in touched:
      last[s] = phase
    cur["time"] = t
    empty = False
  if not empty:
    yield cur

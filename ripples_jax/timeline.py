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
  JOIN   a=worker, b=source    a rejoined worker's first group: copy source's params (the others' mean;
                               its own weight is 0) and reset its optimizer state (docs/design.md 3.10)

With hetero.leave, workers leave and rejoin at given virtual times; trace.membership lists what the
clock applied: (time, worker, "leave" | "rejoin" | "first_group").
"""

import dataclasses
import heapq
import itertools
from typing import Callable

import numpy as np

from ripples_jax.collectives import ring_allreduce_time
from ripples_jax.schedule.group_gen import Fixed
from ripples_jax.schedule.online import GROUP, NONE, Service, fixed_entry

START, APPLY, AVG, RING, PULL, JOIN = range(6)
EVENT_NAMES = ("start", "apply", "average", "ring", "pull", "join")
COMPUTE, WAIT, COMM = "compute", "wait", "comm"
SYNC_ALGORITHMS = ("allreduce", "ps_sync", "dpsgd")
# What cannot run with workers leaving (docs/design.md 3.10): a collective of every worker, the fixed
# ring, Static GG's fixed groups; the reason is config.py's one-line refusal.
NO_LEAVE = {
  "allreduce": "its every-worker collective cannot go on without a member",
  "ps_sync": "its synchronous step waits for every worker",
  "dpsgd": "its fixed ring cannot exclude a member",
  "ripples_static": "Static GG's fixed groups cannot exclude a member",
}


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
  """alpha-beta costs (seconds, bytes/s) for a model of `model_bytes` (docs/design.md 3.1).

  `hidden`: seconds of each step's communication that its computation hides (transfers started layer
  by layer behind the backward pass: timeline.overlap x the base step time). Every algorithm's step is
  charged its transfers less at most `hidden`, so no method is waived a cost another pays: an
  All-Reduce, a group's P-Reduce, a synchronous PS step, a gossip round. Asynchronous PS's push may
  start up to `hidden` before its compute ends, but it holds the server's shared link for its whole
  length (_ps_async); its pull precedes the compute and hides nothing. AD-PSGD's pair average already
  runs beside its whole compute (the clock charges only what outlasts the step): `allreduce(2,
  hide=False)`, so hiding is not counted twice."""

  model_bytes: float
  alpha: float = 5e-6
  bandwidth: float = 1.25e9  # per link (10 Gb/s)
  ps_bandwidth: float = 1.25e9  # the parameter server's link
  hidden: float = 0.0

  def _charged(self, t: float) -> float:
    return t - min(t, self.hidden)

  def allreduce(self, k: int, hide: bool = True) -> float:
    t = ring_allreduce_time(k, self.model_bytes, self.alpha, self.bandwidth)
    return self._charged(t) if hide else t

  def ps_transfer(self) -> float:  # a pull or a push of asynchronous PS: the link's time for it
    return self.alpha + self.model_bytes / self.ps_bandwidth

  def ps_sync_step(self, n: int) -> float:
    # Every worker pushes M and pulls M through the server's one link: 2 n M bytes.
    return self._charged(2 * self.alpha + 2 * n * self.model_bytes / self.ps_bandwidth)

  def ring_gossip(self) -> float:
    return self._charged(2 * self.alpha + 2 * self.model_bytes / self.bandwidth)


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
  membership: list = dataclasses.field(default_factory=list)  # (time, worker, event): leave and join

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
  leave: tuple = (),
  detect: float = 0.0,
) -> Trace:
  """Runs the clock until `total_steps` gradients (all workers together) are applied or time runs out.

  `rtt`: seconds a request to the Group Generator takes to be answered (the online protocol); `ahead`:
  a worker requests its next group when its step starts (schedule.request_ahead); `adpsgd_cost`: the
  AD-PSGD cost model's parts (AdpsgdCost; default: as published); `server`: what the runtime's
  authority and group set-up cost (AuthorityCost; default: nothing); `leave`: (worker, t_leave,
  t_rejoin) triples, t_rejoin < 0 or inf for never (docs/design.md 3.10); `detect`: seconds from a
  death to its removal (the runtime's heartbeat timeout; Group Buffer algorithms only): in between the
  generators still draw the dead worker and its groups fail after their live members' exchanges. The
  live workers make up the steps of the dead: the run still ends at the total_steps-th gradient."""
  budget = time_budget or float("inf")
  if leave and (algorithm in NO_LEAVE or isinstance(gg, Fixed)):
    raise ValueError(
      f"leave/join is not allowed with {algorithm}: {NO_LEAVE.get(algorithm, NO_LEAVE['ripples_static'])}"
    )
  if algorithm in SYNC_ALGORITHMS:
    return _simulate_sync(algorithm, speed, net, total_steps, budget)
  if detect and (algorithm == "adpsgd" or algorithm == "ps_async"):
    raise ValueError(f"detect is not allowed with {algorithm}: it models the Group Buffer's removal")
  clock = _Clock(speed, total_steps, budget, leave, detect)
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

  def __init__(
    self, speed: SpeedModel, total_steps: int, budget: float, leave: tuple = (), detect: float = 0.0
  ):
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
    self.computing = [False] * self.n
    # Leave/join (docs/design.md 3.10). Without a plan both stay None and nothing below changes the run.
    self.plan = tuple(tuple(x) for x in leave)
    self.alive = np.ones(self.n, bool) if self.plan else None  # an array: the generators read all of it
    self.epoch = [0] * self.n if self.plan else None  # one more at every leave and rejoin
    self.detect, self.unnoticed = detect, set()  # dead workers not yet removed (detect > 0)

  def at(self, t: float, fn: Callable, *args) -> None:
    heapq.heappush(self.heap, (t, self.seq, fn, args))
    self.seq += 1

  def at_w(self, t: float, w: int, fn: Callable, *args) -> None:
    """`at` for a callback of worker w's current life: dropped if w leaves before t (its compute, its
    request, its average in flight die with it). Without leave/join it is `at`, the same heap order."""
    if self.epoch is None:
      self.at(t, fn, *args)
    else:
      self.at(t, self._same_life, w, self.epoch[w], fn, args)

  def _same_life(self, w: int, epoch: int, fn: Callable, args: tuple) -> None:
    if self.epoch[w] == epoch:
      fn(*args)

  def plan_membership(self, on_leave: Callable, on_rejoin: Callable, on_death: Callable = None) -> None:
    """Puts the planned leaves and rejoins on the heap; the protocol's handlers act on them. With
    `detect`, a worker dies at t_leave and is removed `detect` seconds later (on_death at its death)."""
    for w, t_leave, t_rejoin in self.plan:
      if self.detect:
        self.at(t_leave, self._die, w, on_death)
      self.at(t_leave + self.detect, self._leave, w, on_leave)
      if 0 <= t_rejoin < float("inf"):
        self.at(max(t_rejoin, t_leave + self.detect), self._rejoin, w, on_rejoin)

  def _die(self, w: int, on_death: Callable) -> None:
    """Its life ends (its compute, request and averages in flight die) while the generators still draw
    it: its groups fail when their live members have exchanged (on_death, _GroupBuffer.arrive)."""
    self._stop_life(w)
    self.unnoticed.add(w)
    on_death(w)

  def _stop_life(self, w: int) -> None:
    if self.computing[w]:  # the step it was computing is lost; the time was spent
      self.computing[w] = False
      self.interval(w, COMPUTE, self.started_at[w], self.now)
    self.epoch[w] += 1

  def _leave(self, w: int, on_leave: Callable) -> None:
    if w in self.unnoticed:
      self.unnoticed.discard(w)
    else:
      self._stop_life(w)
    self.alive[w] = False
    self.trace.membership.append((self.now, w, "leave"))
    on_leave(w)

  def _rejoin(self, w: int, on_rejoin: Callable) -> None:
    self.epoch[w] += 1
    self.alive[w] = True
    self.trace.membership.append((self.now, w, "rejoin"))
    on_rejoin(w)

  def joined(self, w: int, source: int) -> None:
    """A rejoined worker's first group lands: it takes source's params, fresh optimizer state."""
    self.emit(JOIN, w, source)
    self.trace.membership.append((self.now, w, "first_group"))

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
    self.computing[w] = True
    self.emit(START, w)
    self.at_w(self.now + c, w, self._finished, w, on_finish)

  def _finished(self, w: int, on_finish: Callable) -> None:
    self.computing[w] = False
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
  _GroupBuffer(clock, net, gg, rtt, ahead, server).run()


@dataclasses.dataclass
class _BufferState:
  """The Group Buffer protocol's state (shared objects: _BufferMembership changes the first six when
  workers leave and join)."""

  pos: list  # next entry of each worker's queue
  asked: list  # the queue index of a worker's request in flight
  blocked: list  # since when a worker waits for its answer
  groups: dict  # gid -> [members, arrived set, arrival times]: groups some member has reached
  joining: set  # rejoined workers whose first group has not landed: no model to step on (3.10)
  released: dict  # gid -> its live members: a member left while its average was in flight
  last_gid: list  # each worker's newest group, for its start report to the generator
  met: set  # member sets (or pairs) whose set-up has been paid
  busy_until: float = 0.0  # the authority serves one request at a time: when it is free

  @classmethod
  def fresh(cls, n: int) -> "_BufferState":
    return cls([0] * n, [None] * n, [None] * n, {}, set(), {}, [-1] * n, set())


class _GroupBuffer:
  """The Group Buffer protocol of `_group_buffer`: each method below handles one clock event."""

  def __init__(self, clock: _Clock, net: Network, gg, rtt: float, ahead: bool, server: AuthorityCost):
    self.clock, self.net, self.gg, self.rtt, self.ahead, self.server = clock, net, gg, rtt, ahead, server
    self.fixed = isinstance(gg, Fixed)
    self.service = None if self.fixed else Service(clock.n, gg, estimate=clock.speed.base_time)
    self.st = _BufferState.fresh(clock.n)
    self.hooks = None  # _BufferMembership, with a leave plan only
    clock.trace.buffer = self.service.buffer if self.service else None

  def run(self) -> None:
    clock, service = self.clock, self.service
    if clock.plan:
      self.hooks = _BufferMembership(clock, service, self.st, self.go_on, self.ask, self.start)
      clock.plan_membership(self.hooks.leave, self.hooks.rejoin, self.died)
    for w in range(clock.n):
      self.start(w)
    clock.run()
    if service is not None:
      clock.trace.conflicts = service.buffer.conflicts
      clock.trace.requests = service.buffer.requests

  def start(self, w: int) -> None:
    clock, service, st = self.clock, self.service, self.st
    if service is not None:  # what a worker's start report tells the generator (instant here)
      service.report(w, clock.now, clock.last_time[w], clock.iterations[w] + 1, st.last_gid[w])
    clock.start_compute(w, self.on_finish)
    # With `ahead`, an empty queue asks now for the entry after this step: the round trip overlaps it.
    if service is not None and self.ahead and st.pos[w] >= len(service.entries[w]) and st.asked[w] is None:
      estimate = clock.last_time[w] or clock.speed.base_time
      self.ask(w, clock.now + estimate)

  def ask(self, w: int, ready_at: float) -> None:
    st, clock = self.st, self.clock
    st.asked[w] = st.pos[w]
    at_authority = self.queue_at_authority if self.server.service else self.handle
    clock.at_w(clock.now + self.rtt / 2, w, at_authority, w, st.pos[w], ready_at)

  def queue_at_authority(self, w: int, want: int, ready_at: float) -> None:
    """FIFO: the request is served once the requests before it are."""
    st, clock = self.st, self.clock
    begin = max(clock.now, st.busy_until)
    st.busy_until = begin + self.server.service
    clock.at_w(st.busy_until, w, self.handle, w, want, ready_at)

  def handle(self, w: int, want: int, ready_at: float) -> None:
    """At the authority: generate on this arrival, answer after rtt / 2."""
    self.service.request(w, want, ready_at)
    self.clock.at_w(self.clock.now + self.rtt / 2, w, self.answered, w)

  def answered(self, w: int) -> None:
    st, clock = self.st, self.clock
    if st.blocked[w] is not None:
      clock.interval(w, WAIT, st.blocked[w], clock.now)
      st.blocked[w] = None
      self.take(w)

  def setup_cost(self, members) -> float:
    server, met = self.server, self.st.met
    units = [tuple(members)] if server.setup_unit == "group" else list(itertools.combinations(members, 2))
    new = [u for u in units if u not in met]
    met.update(new)
    return server.setup * len(new)

  def on_finish(self, w: int) -> None:
    self.clock.applied(w, w)
    if not self.clock.stopped:
      self.take(w)

  def take(self, w: int) -> None:
    """After a step: the head of w's queue; with an empty one, w waits for its answer (and asks, if no
    request of it is in flight)."""
    clock, service, st = self.clock, self.service, self.st
    if self.fixed:
      entry = fixed_entry(self.gg.layouts, clock.n, w, clock.iterations[w] - 1)
    elif st.pos[w] < len(service.entries[w]):
      entry = service.entries[w][st.pos[w]]
      if st.asked[w] == st.pos[w]:
        st.asked[w] = None
      st.pos[w] += 1
    else:
      st.blocked[w] = clock.now
      if st.asked[w] is None:
        self.ask(w, clock.now)
      return
    if entry[0] == GROUP:
      self.arrive(w, entry)
    else:
      self.go_on(w)

  def go_on(self, w: int) -> None:
    """No group after this step (or its group failed): step again, or, rejoining, ask again."""
    if w in self.st.joining:
      self.hooks.retry(w)
    else:
      self.start(w)

  def arrive(self, w: int, entry: tuple) -> None:
    """w reaches its group; the last member to arrive starts the average."""
    clock = self.clock
    _, gid, members = entry[:3]
    g = self.st.groups.setdefault(gid, [members, set(), {}])
    g[1].add(w)
    g[2][w] = clock.now
    if clock.unnoticed:
      self.fail_if_dead(gid)
    elif len(g[1]) == len(members):
      self.arrive_complete(gid)

  def arrive_complete(self, gid: int) -> None:
    """Every member is there: the average runs."""
    clock = self.clock
    members, _, times = self.st.groups[gid]
    d = self.net.allreduce(len(members)) + (self.setup_cost(members) if self.server.setup else 0.0)
    for m in members:
      clock.interval(m, WAIT, times[m], clock.now)
      clock.interval(m, COMM, clock.now, clock.now + d)
    # Not clock.at_w: the average is no one member's; a member leaving meanwhile fails it (released).
    clock.at(clock.now + d, self.group_end, gid)

  def died(self, w: int) -> None:
    """A death not yet noticed (detect > 0): groups whose live members are all there fail now."""
    for gid in [gid for gid, g in self.st.groups.items() if w in g[0]]:
      self.fail_if_dead(gid)

  def fail_if_dead(self, gid: int) -> None:
    """A group with a dead, unnoticed member, once its live members have all arrived: they exchange
    among themselves (the runtime's pairs), find the dead one gone, and go on without the average."""
    clock, st = self.clock, self.st
    members, arrived, times = st.groups[gid]
    live = [m for m in members if m not in clock.unnoticed]
    if len(live) == len(members):
      if len(arrived) == len(members):  # nobody in it is dead: the average runs as usual
        self.arrive_complete(gid)
      return
    if not set(live) <= arrived or gid in st.released:
      return
    d = self.net.allreduce(len(live)) if len(live) > 1 else 0.0
    for m in live:
      clock.interval(m, WAIT, times[m], clock.now)
      clock.interval(m, COMM, clock.now, clock.now + d)
    st.released[gid] = set(live)  # group_end: the live members go on, no average
    clock.at(clock.now + d, self.group_end, gid)

  def group_end(self, gid: int) -> None:
    st = self.st
    members = st.groups.pop(gid)[0]
    if st.released and gid in st.released:  # a member left during the average: it failed (3.10)
      for m in sorted(st.released.pop(gid)):
        self.go_on(m)
      return
    if st.joining and not st.joining.isdisjoint(members):
      self.hooks.first_group(members)
    else:
      self.clock.emit(AVG, members)
    for m in members:
      st.last_gid[m] = gid
      self.start(m)


class _BufferMembership:
  """Leaving and joining under the Group Buffer (Random GG, Group Division, Smart GG; 3.10).

  A leaving worker's groups that have not run fail: members that have not reached one skip it (its
  entry becomes NONE: they step again), members waiting at one go on at once, and the members of an
  average in flight go on when it would have ended, without it. The alternative, averaging the
  survivors alone, is not what a runtime can do: a collective with a dead member fails in that group
  only (3.8), and averaging the rest would need another member set, i.e. another group agreed by the
  authority. From its leave on, the generators see the worker as dead (GGView.alive) and make no group
  with it. A rejoined worker starts with an empty queue and asks; it takes no step before its first
  group lands, where it has weight 0 (clock.joined)."""

  def __init__(self, clock: _Clock, service: Service, st: _BufferState, go_on, ask, start):
    self.clock, self.service, self.st = clock, service, st
    self.go_on, self.ask, self.start = go_on, ask, start
    service.view.alive = clock.alive

  def _fail(self, gid: int, members: tuple) -> None:
    """The group will not run: the entries not yet taken become NONE, and it leaves the queues that
    the generators read (Smart GG picks no worker with a pending group)."""
    buf = self.service.buffer
    for m in members:
      q = self.service.entries[m]
      for i in range(self.st.pos[m], len(q)):
        if q[i][0] == GROUP and q[i][1] == gid:
          q[i] = (NONE,)
      kept = [g for g in buf.queues[m] if g.gid != gid]
      buf.npending[m] -= len(buf.queues[m]) - len(kept)
      buf.queues[m] = kept

  def leave(self, w: int) -> None:
    clock, st = self.clock, self.st
    for entry in self.service.entries[w][st.pos[w] :]:
      if entry[0] == GROUP:
        self._fail(entry[1], entry[2])
    for gid, (members, arrived, times) in list(st.groups.items()):
      if w not in members or (clock.detect and gid in st.released):  # failing already (fail_if_dead)
        continue
      self._fail(gid, members)
      if len(arrived) == len(members):  # its average is in flight: the rest go on at its end
        st.released[gid] = {m for m in members if clock.alive[m]}
        continue
      del st.groups[gid]  # the others waiting at it go on now
      for m in sorted(arrived):
        clock.interval(m, WAIT, times[m], clock.now)
        if m != w:
          self.go_on(m)
    for live in st.released.values():
      live.discard(w)
    if st.blocked[w] is not None:
      clock.interval(w, WAIT, st.blocked[w], clock.now)
    st.blocked[w] = st.asked[w] = None
    st.joining.discard(w)

  def rejoin(self, w: int) -> None:
    """It asks at once and waits: what was queued for its earlier life is gone (every group of it
    failed at the leave). Smart GG sees it ready now."""
    st, service = self.st, self.service
    st.pos[w] = len(service.entries[w])
    st.joining.add(w)
    service.started_at[w] = self.clock.now - service.estimates[w]
    st.blocked[w] = self.clock.now
    self.ask(w, self.clock.now)

  def retry(self, w: int) -> None:
    """A rejoined worker got no group (Smart GG skipped it, or its group failed): it asks again a base
    step later (asking at once could repeat at one instant forever). Alone, it starts from its own
    parameters, with fresh optimizer state."""
    clock = self.clock
    if clock.alive.sum() == 1:
      self.first_group((w,))
      self.start(w)
      return
    self.st.blocked[w] = clock.now
    clock.at_w(clock.now + clock.speed.base_time, w, lambda: self.ask(w, clock.now))

  def first_group(self, members: tuple) -> None:
    """A group with rejoined members lands: the others average among themselves and every joiner
    takes that mean (its own weight is 0, so the others' mean is kept). A group of joiners only
    averages as usual: none of them holds a newer model."""
    joiners = [m for m in members if m in self.st.joining]
    others = tuple(m for m in members if m not in self.st.joining)
    if len(others or members) > 1:
      self.clock.emit(AVG, others or members)
    for j in joiners:
      self.clock.joined(j, others[0] if others else j)
      self.st.joining.discard(j)


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
  _Adpsgd(clock, net, rng, cost).run()


@dataclasses.dataclass
class _AdpsgdState:
  """AD-PSGD's per-worker state (shared objects: _AdpsgdMembership resets the first five at a leave)."""

  landed: np.ndarray  # whether an active worker's average for its current step has landed
  held: np.ndarray  # its compute ended before the average did: the apply waits for it
  ended: np.ndarray  # when its compute ended
  paused: np.ndarray  # seconds a passive worker's current step has been paused by averages
  window: dict  # active worker -> (begin, end) of its average in flight
  channel_free: np.ndarray  # when a passive worker's channel is free
  partner_life: dict  # active worker -> its partner's epoch when the average began (leave/join only)

  @classmethod
  def fresh(cls, n: int) -> "_AdpsgdState":
    return cls(np.ones(n, bool), np.zeros(n, bool), np.zeros(n), np.zeros(n), {}, np.zeros(n), {})


class _Adpsgd:
  """The AD-PSGD protocol of `_adpsgd`: each method below handles one clock event."""

  def __init__(self, clock: _Clock, net: Network, rng: np.random.Generator, cost: AdpsgdCost):
    self.clock, self.net, self.rng, self.cost = clock, net, rng, cost
    self.passive = np.arange(0, clock.n, 2)
    self.alive = clock.alive  # None without leave/join
    self.st = _AdpsgdState.fresh(clock.n)
    clock.trace.pairs = []

  def run(self) -> None:
    clock = self.clock
    if clock.plan:
      hooks = _AdpsgdMembership(clock, self.net, self.rng, self.cost, self.st, self.start, self.serve)
      clock.plan_membership(hooks.leave, hooks.rejoin)
    for w in range(clock.n):
      self.start(w)
    clock.run()

  def start(self, w: int) -> None:
    clock, st, alive, passive = self.clock, self.st, self.alive, self.passive
    clock.start_compute(w, self.on_finish)
    if w % 2 == 0:
      return
    live = passive if alive is None else passive[alive[passive]]
    if not len(live):  # every passive worker is gone: this step has no average (3.10)
      return
    j = int(self.rng.choice(live))
    d = self.net.allreduce(2, hide=False) + self.cost.fixed
    begin = self.serve(j, d)
    clock.trace.pairs.append((w, j))
    st.landed[w], st.window[w] = False, (begin, begin + d)
    if alive is not None:
      st.partner_life[w] = clock.epoch[j]
    clock.at_w(begin + d, w, self.pair_end, w, j)

  def serve(self, j: int, d: float) -> float:
    """When passive j's channel can serve an exchange of d seconds; books it."""
    st, clock = self.st, self.clock
    begin = max(clock.now, st.channel_free[j]) if self.cost.serial else clock.now
    st.channel_free[j] = max(st.channel_free[j], begin + d)
    if self.cost.passive_blocks:
      st.paused[j] += d
    return begin

  def on_finish(self, w: int) -> None:
    st, clock = self.st, self.clock
    if st.paused[w] > 0:  # the step is not done: it lost this long to the averages it served
      d, st.paused[w] = st.paused[w], 0.0
      clock.interval(w, COMM, clock.now, clock.now + d)
      clock.at_w(clock.now + d, w, self.on_finish, w)
      return
    if not st.landed[w]:  # the gradient is applied to the averaged model: wait for the average
      st.held[w], st.ended[w] = True, clock.now
      return
    self.apply(w)

  def pair_end(self, w: int, j: int) -> None:
    st, clock = self.st, self.clock
    # A passive partner that left meanwhile never answers: the active one goes on without the average.
    if self.alive is None or clock.epoch[j] == st.partner_life[w]:
      clock.emit(AVG, (j, w))
    st.landed[w] = True
    if st.held[w]:  # the compute ended first: what of the average outlasted it shows
      st.held[w] = False
      begin, end = st.window[w]
      clock.interval(w, WAIT, st.ended[w], max(st.ended[w], begin))
      clock.interval(w, COMM, max(st.ended[w], begin), end)
      self.apply(w)

  def apply(self, w: int) -> None:
    self.clock.applied(w, w)
    if not self.clock.stopped:
      self.start(w)


class _AdpsgdMembership:
  """Leaving and joining under AD-PSGD (3.10): an active worker picks its partner among the live
  passive ones; an average whose partner leaves before it lands fails, and the active worker applies
  its gradient to its own model. A rejoined worker first copies a random live passive worker other
  than itself (the pair average with its own weight 0, served on that worker's channel like an
  average), then steps as before."""

  def __init__(self, clock: _Clock, net: Network, rng, cost: AdpsgdCost, st: _AdpsgdState, start, serve):
    self.clock, self.net, self.rng, self.cost, self.st = clock, net, rng, cost, st
    self.start, self.serve = start, serve

  def leave(self, w: int) -> None:
    st = self.st
    if st.held[w]:  # it was waiting for its average
      self.clock.interval(w, WAIT, st.ended[w], self.clock.now)
    st.landed[w], st.held[w], st.paused[w] = True, False, 0.0
    st.window.pop(w, None)

  def rejoin(self, w: int) -> None:
    clock, n = self.clock, self.clock.n
    passive = np.arange(0, n, 2)  # the side that serves (the runtime's rule: runtime/adpsgd.py)
    live = passive[clock.alive[passive] & (passive != w)]
    if not len(live):  # no passive worker to copy: its own parameters, fresh optimizer state
      clock.joined(w, w)
      self.start(w)
      return
    j = int(self.rng.choice(live))
    d = self.net.allreduce(2, hide=False) + self.cost.fixed
    begin = self.serve(j, d)
    clock.interval(w, WAIT, clock.now, begin)
    clock.interval(w, COMM, begin, begin + d)
    clock.at_w(begin + d, w, self._copied, w, j, clock.epoch[j])

  def _copied(self, w: int, j: int, life: int) -> None:
    if self.clock.epoch[j] != life:  # the neighbour left meanwhile: another one
      self.rejoin(w)
      return
    self.clock.joined(w, j)
    self.start(w)


def _ps_async(clock: _Clock, net: Network) -> None:
  """Asynchronous parameter server in slot n: pull, compute, push; the server applies on arrival.

  Transfers share the server's one link (first come first served), which is what limits PS at scale.
  """
  n = clock.n
  server = n
  link_free = [0.0]

  def transfer(w, then, early=0.0):
    # A push may start `early` before now (behind the backward pass, net.hidden): the link is FIFO and
    # link_free is the end of its last booking, so any time after it is free, even in the past.
    begin = max(clock.now - early, link_free[0])
    d = net.ps_transfer()
    link_free[0] = begin + d
    end = max(begin + d, clock.now)
    clock.interval(w, WAIT, clock.now, max(begin, clock.now))
    clock.interval(w, COMM, max(begin, clock.now), end)
    clock.at_w(end, w, then, w)

  def push(w):
    transfer(w, pushed, net.hidden)

  def pulled(w):
    clock.emit(PULL, w, server)
    clock.start_compute(w, push)

  def pushed(w):
    clock.applied(server, w)
    if not clock.stopped:
      transfer(w, pulled)

  def rejoined(w):  # its first pull after a rejoin: the server's model, fresh optimizer state (3.10)
    clock.joined(w, server)
    clock.start_compute(w, push)

  # Leaving needs nothing more here: what the worker had in flight dies with it (clock.at_w), and the
  # server's link time it had booked is spent.
  clock.plan_membership(lambda w: None, lambda w: transfer(w, rejoined))
  for w in range(n):
    transfer(w, pulled)
  clock.run()


# Phase of each event kind inside one engine round (engine.make_sim_round_fn): apply, average, pull, start.
_PHASE = {APPLY: 0, AVG: 1, RING: 1, PULL: 2, JOIN: 2, START: 3}


def pack_rounds(events: list, num_workers: int, num_slots: int):
  """Greedily packs the ordered events into engine rounds without changing what any slot sees.

  A round runs phases apply < average < pull < start. An event joins the current round only if every
  slot it touches has had nothing at this phase or later in the round; otherwise a new round begins.
  Then each slot's events keep their clock order, and an average reads every member exactly at its
  place in that order, so the rounds compute what the ordered events describe.

  Yields dicts of numpy arrays: apply_src, gid, ring, pull_src, start, plus `time` (of the round's last
  event), `applied` (workers whose gradient landed) and `started`; a round with a JOIN also has `reset`
  (the slots whose optimizer state restarts; a JOIN is a pull that resets, 3.10).
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
    elif kind == PULL or kind == JOIN:
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
    elif kind == JOIN:
      cur["pull_src"][a] = b
      cur.setdefault("reset", np.zeros(num_slots, bool))[a] = True
    else:
      cur["start"][a] = True
    for s in touched:
      last[s] = phase
    cur["time"] = t
    empty = False
  if not empty:
    yield cur

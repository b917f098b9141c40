"""The hybrid's clock: R pipeline replicas of K stages, each stage's replicas averaging in groups
(docs/design.md 4.7). Host-side numpy, deterministic under a seed; it decides every event first, the
numerics (hybrid/sim.py) execute them after.

A replica is one pipeline (its K stages on K devices, links overlapped with compute as in DSP), so its
tick takes as long as its slowest stage's forward and backward that tick: stage_s[k] x the device's
slowdown x a lognormal jitter per device and tick. After every `sync_every`-th tick the replica takes the
head of its queue in the Group Buffer (asking the Group Generator when the queue is empty: Ripples'
protocol, schedule/group_gen.py) and, when every member has reached that group, each stage k averages
its own parameters with the members' stage k: K P-Reduces at once, each on its own device and link,
costing a ring all-reduce of stage k's bytes among the members. The replica's next tick starts when the
longest of them ends (its stages' links tie them together). No group (Smart GG's skip): no wait.

One group serves every stage, and the stages' averages never mix stages: parameters of stage k meet only
stage k's. Independent generators per stage were tried first and deadlock: replica m waits at its sync
point for its stage-1 group, whose member q waits for its stage-0 group, which holds m only at m's next
sync point (a cross-stage cycle the Group Buffer's one global order cannot see; Random GG stopped within
five ticks at R=4, K=2). With one buffer the lowest unfinished group's members all have it at their head
and reach it when their tick ends, so nothing cycles. Since a replica ticks at its slowest device's pace,
what Smart GG needs of per-device speed is that replica's tick time, which it is given.
"""

import dataclasses
import heapq

import numpy as np

from ripples_jax.collectives import ring_allreduce_time
from ripples_jax.schedule import group_gen, online
from ripples_jax.timeline import APPLY, AVG, COMM, COMPUTE, WAIT, Trace

# The events, the timeline's kinds (timeline.pack_rounds packs them): (t, TICK_END, r, i) replica r's tick i
# ended, its updates applied (the timeline's APPLY of r's own step i); (t, AVG, members, None) the
# group's K stage averages ended.
TICK_END = APPLY


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the clock needs. `slow`: (replica, stage) of the slow device, or None; with `rotate_every` >
  0 the slow device moves to the next replica (same stage) every that many seconds."""

  stage_s: tuple  # seconds of one tick's forward + backward of each stage on a device at full speed
  stage_bytes: tuple  # bytes of each stage's parameters (what a P-Reduce of stage k moves)
  replicas: int
  total_ticks: int  # the run ends when the replicas' ticks sum to this
  gen: object  # a Group Generator (schedule.group_gen), group_gen.Fixed, or None (no averaging)
  sync_every: int = 1
  slow: tuple | None = None
  slowdown: float = 1.0
  rotate_every: float = 0.0
  jitter: float = 0.0
  alpha: float = 5e-6
  bandwidth: float = 1.25e9
  seed: int = 0
  avg_s: float = 0.0  # > 0: every group's averages take this long (measured), replacing the ring model

  def slow_at(self, t: float) -> tuple | None:
    return slow_device(self.slow, self.slowdown, self.replicas, self.rotate_every, t)


def slow_device(slow, slowdown: float, replicas: int, rotate_every: float, t: float) -> tuple | None:
  """(replica, stage) of the slow device at time t (virtual in the clock, wall in hybrid/devices.py);
  None without one."""
  if not slow or slowdown == 1.0:
    return None
  r, k = slow
  if rotate_every:
    r = (r + int(t // rotate_every)) % replicas
  return (r, k)


def averages(trace: Trace) -> int:
  """The groups a run averaged (each one P-Reduce per stage)."""
  return sum(ev[1] == AVG for ev in trace.events)


class Groups:
  """The replicas' groups at their sync points: Ripples' protocol over the R replicas, from the
  simulator's and the runtime's own parts. A generator is driven by one schedule/online.Service (its
  Group Buffer, its request path, its view, its state); a fixed schedule's group is online.fixed_entry's,
  with no authority, as in the runtime.

  A replica's group is the head of its Group Buffer queue until the group is done (`done`): the
  hybrid's executors wait in it, and one resumed inside a group (hybrid/devices.py) waits there again
  without asking. With nothing pending it asks: a Service request, whose entries the buffer's queues
  hold in the same order (so the Service's own entry queues are trimmed at once). `started_at` and
  `estimates` are the Service's: the executor writes when each replica started its tick and how long
  it should take (0 at a sync point: ready now), which Smart GG reads."""

  def __init__(self, replicas: int, gen, estimate: float):
    self.gen, self.fixed = gen, isinstance(gen, group_gen.Fixed)
    self.service = online.Service(replicas, None if self.fixed else gen, estimate=estimate)
    self.buffer = self.service.buffer
    self.started_at, self.estimates = self.service.started_at, self.service.estimates

  def head(self, r: int, sync: int, now: float) -> group_gen.Group | None:
    """Replica r's group at its sync-th sync point (None: no group this time)."""
    if self.gen is None:
      return None
    if self.fixed:  # All-Reduce, Static GG: known locally, no generator (gid -1: no buffer)
      entry = online.fixed_entry(self.gen.layouts, self.buffer.n, r, sync)
      return group_gen.Group(-1, entry[2], now, entry[1]) if entry[0] == online.GROUP else None
    svc = self.service
    if not self.buffer.pending(r):
      svc.request(r, svc.appended(r), now)
      svc.trim([svc.appended(w) for w in range(self.buffer.n)])
    return self.buffer.queues[r][0] if self.buffer.pending(r) else None

  def done(self, r: int, gid: int) -> None:
    """Replica r has averaged in group gid (a fixed schedule's, gid -1, is in no buffer)."""
    if gid >= 0:
      self.buffer.done(r, gid)

  def state(self) -> dict:
    """The Group Buffer's pending queues and the generator's hidden state, as JSON (a consistent cut of
    hybrid/devices.py, or a checkpoint marker of hybrid/processes.py)."""
    return {"buffer": self.buffer.state(), "gen": self.service.state()["gg"]}

  def load(self, state: dict) -> None:
    self.buffer.load(state.get("buffer", state))  # a cut of before the Groups: the buffer's keys at the top
    if state["gen"] is not None:
      self.gen.load(state["gen"])


def simulate_replicas(spec: Spec) -> Trace:
  """Runs the clock to `total_ticks` (the module docstring has the rules): the timeline's Trace of R
  replicas, its worker_steps their ticks, its intervals where each replica's time went."""
  return _ReplicaClock(spec).run()


class _ReplicaClock:
  """The replicas' event heap (a replica's tick is its slowest device's; the timeline's clock steps
  workers by a speed model of one device each)."""

  def __init__(self, spec: Spec):
    R, K = spec.replicas, len(spec.stage_s)
    self.spec, self.R, self.K = spec, R, K
    self.rng = np.random.default_rng([6, spec.seed])
    self.protocol = Groups(R, spec.gen, estimate=max(spec.stage_s))
    self.heap, self.seq, self.trace = [], 0, Trace(R)
    self.ticks = self.trace.worker_steps
    self.started_at, self.estimates = self.protocol.started_at, self.protocol.estimates  # Smart GG reads them
    self.arrived_at = np.zeros(R)
    self.reached = {}  # gid, or (request, members) of a fixed schedule -> {member: arrival time}
    self.done = 0
    self.stopped = False

  def at(self, t, fn, *args):
    heapq.heappush(self.heap, (t, self.seq, fn, args))
    self.seq += 1

  def run(self) -> Trace:
    for r in range(self.R):
      self.start(0.0, r)
    now = 0.0
    while self.heap and not self.stopped:
      now, _, fn, args = heapq.heappop(self.heap)
      fn(now, *args)
    self.trace.end_time = now
    return self.trace

  def tick_time(self, r: int, now: float) -> float:
    spec = self.spec
    t_K = np.array(spec.stage_s, float)
    if spec.jitter:  # one draw per device and tick, in a fixed order: the same run for a seed
      t_K = t_K * np.exp(spec.jitter * self.rng.standard_normal(self.K))
    slow = spec.slow_at(now)
    if slow is not None and slow[0] == r:
      t_K[slow[1]] *= spec.slowdown
    return float(t_K.max())  # the pipeline ticks at its slowest stage's pace

  def start(self, now: float, r: int) -> None:
    d = self.tick_time(r, now)
    self.started_at[r], self.estimates[r] = now, d
    self.trace.intervals.append((r, COMPUTE, now, now + d))
    self.at(now + d, self.tick_end, r)

  def tick_end(self, now: float, r: int) -> None:
    i = int(self.ticks[r])
    self.ticks[r] += 1
    self.trace.events.append((now, TICK_END, r, i))
    self.done += 1
    if self.done >= self.spec.total_ticks:
      self.stopped = True
      return
    if (i + 1) % self.spec.sync_every:
      self.start(now, r)
      return
    self.arrive(now, r, (i + 1) // self.spec.sync_every - 1)

  def arrive(self, now: float, r: int, sync: int) -> None:
    """Replica r at its sync-th sync point: it joins its group, whose K averages run when all are in."""
    self.arrived_at[r] = now
    self.started_at[r], self.estimates[r] = now, 0.0  # not computing: ready now
    g = self.protocol.head(r, sync, now)
    if g is None:
      self.start(now, r)
      return
    got = self.reached.setdefault(g.gid if g.gid >= 0 else (g.request, g.members), {})
    got[r] = now
    if len(got) == len(g.members):  # the last member is here: every stage's P-Reduce runs
      del self.reached[g.gid if g.gid >= 0 else (g.request, g.members)]
      spec = self.spec
      cost = spec.avg_s or max(
        ring_allreduce_time(len(g.members), b, spec.alpha, spec.bandwidth) for b in spec.stage_bytes
      )
      self.at(now + cost, self.avg_end, g, cost)

  def avg_end(self, now: float, g, cost: float) -> None:
    self.trace.events.append((now, AVG, g.members, None))
    for m in g.members:
      self.protocol.done(m, g.gid)
      self.trace.intervals.append((m, WAIT, self.arrived_at[m], now - cost))
      self.trace.intervals.append((m, COMM, now - cost, now))
      self.start(now, m)

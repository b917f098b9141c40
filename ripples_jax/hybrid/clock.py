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
from ripples_jax.schedule import group_gen
from ripples_jax.schedule.online import GROUP, fixed_entry

TICK, AVG = "tick", "avg"


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


@dataclasses.dataclass
class Trace:
  """The run's events in time order: (time, TICK, replica, its tick index) at a tick's end (its
  updates applied), (time, AVG, members) when the last of the group's K stage averages ends; and where
  each replica's time went."""

  events: list
  end_time: float
  ticks: np.ndarray  # per replica
  compute_s: np.ndarray  # per replica
  wait_s: np.ndarray  # waiting for groups' members
  comm_s: np.ndarray  # in averages
  groups: int  # groups averaged (each one P-Reduce per stage)


class Space:
  """The Group Buffer and its generator."""

  def __init__(self, replicas: int, gen):
    self.gen, self.fixed = gen, isinstance(gen, group_gen.Fixed)
    self.buffer = group_gen.GroupBuffer(replicas)

  def state(self) -> dict:
    """The buffer's pending queues and the generator's hidden state, as JSON (a consistent cut of
    hybrid/devices.py: no group is half reached then)."""
    b = self.buffer
    return {
      "count": b.count,
      "requests": b.requests,
      "conflicts": b.conflicts.tolist(),
      "queues": [[[g.gid, list(g.members), g.request] for g in q] for q in b.queues],
      "gen": self.gen.state() if hasattr(self.gen, "state") else None,
    }

  def load(self, state: dict) -> None:
    b, groups = self.buffer, {}
    b.first, b.groups, b.requests = state["count"], [], state["requests"]
    b.conflicts[:] = state["conflicts"]
    for w, q in enumerate(state["queues"]):
      b.queues[w] = [groups.setdefault(gid, group_gen.Group(gid, tuple(m), 0.0, req)) for gid, m, req in q]
      b.npending[w] = len(q)
    if state["gen"] is not None:
      self.gen.load(state["gen"])

  def head(self, r: int, sync: int, view) -> group_gen.Group | None:
    """Replica r's group at its sync-th sync point (None: no group this time)."""
    if self.gen is None:
      return None
    if self.fixed:  # All-Reduce, Static GG: known locally, no generator (gid -1: no buffer)
      entry = fixed_entry(self.gen.layouts, self.buffer.n, r, sync)
      return group_gen.Group(-1, entry[2], view.now, entry[1]) if entry[0] == GROUP else None
    if not self.buffer.pending(r):
      self.buffer.requests += 1
      self.gen(r, view)
    return self.buffer.queues[r][0] if self.buffer.pending(r) else None


def simulate(spec: Spec) -> Trace:
  """Runs the clock to `total_ticks`; see the module docstring for the rules."""
  return _Clock(spec).run()


class _Clock:
  def __init__(self, spec: Spec):
    R, K = spec.replicas, len(spec.stage_s)
    self.spec, self.R, self.K = spec, R, K
    self.rng = np.random.default_rng([6, spec.seed])
    self.space = Space(R, spec.gen)
    self.heap, self.seq, self.events = [], 0, []
    self.ticks = np.zeros(R, np.int64)
    self.started_at = np.zeros(R)
    self.estimates = np.full(R, max(spec.stage_s))
    self.arrived_at = np.zeros(R)
    self.reached = {}  # gid, or (request, members) of a fixed schedule -> {member: arrival time}
    self.split = {k: np.zeros(R) for k in ("compute", "wait", "comm")}
    self.groups = 0
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
    s = self.split
    return Trace(self.events, now, self.ticks.copy(), s["compute"], s["wait"], s["comm"], self.groups)

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
    self.split["compute"][r] += d
    self.at(now + d, self.tick_end, r)

  def tick_end(self, now: float, r: int) -> None:
    i = int(self.ticks[r])
    self.ticks[r] += 1
    self.events.append((now, TICK, r, i))
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
    view = group_gen.GGView(now, self.space.buffer, self.started_at.copy(), self.estimates.copy(), None)
    g = self.space.head(r, sync, view)
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
    self.events.append((now, AVG, g.members))
    self.groups += 1
    for m in g.members:
      if g.gid >= 0:
        self.space.buffer.done(m, g.gid)
      spent = now - self.arrived_at[m]
      self.split["comm"][m] += cost
      self.split["wait"][m] += spent - cost
      self.start(now, m)

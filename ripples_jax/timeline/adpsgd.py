"""AD-PSGD on the clock (Lian et al.'s order) and its leave/join rules."""

import dataclasses

import numpy as np

from ripples_jax.timeline.clock import _Clock
from ripples_jax.timeline.costs import AdpsgdCost, Network
from ripples_jax.timeline.trace import AVG, COMM, WAIT


def _adpsgd(clock: _Clock, net: Network, rng: np.random.Generator, cost: AdpsgdCost) -> None:
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
    ahead = w % 2 == 1 and self.cost.hidden < 1  # part of the average runs before the compute
    if not ahead:
      clock.start_compute(w, self.on_finish)
    if w % 2 == 0:
      return
    live = passive if alive is None else passive[alive[passive]]
    if not len(live):  # every passive worker is gone: this step has no average (3.10)
      if ahead:
        clock.start_compute(w, self.on_finish)
      return
    j = int(self.rng.choice(live))
    d = self.net.allreduce(2, hide=False) + self.cost.fixed
    begin = self.serve(j, d)
    clock.trace.pairs.append((w, j))
    st.landed[w], st.window[w] = False, (begin, begin + d)
    if alive is not None:
      st.partner_life[w] = clock.epoch[j]
    if ahead:  # the unhidden share: waited for and communicated before the compute starts
      lead = begin + (1 - self.cost.hidden) * d
      clock.interval(w, WAIT, clock.now, begin)
      clock.interval(w, COMM, begin, lead)
      st.window[w] = (lead, begin + d)  # what may still outlast the compute
      clock.at_w(lead, w, clock.start_compute, w, self.on_finish)
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

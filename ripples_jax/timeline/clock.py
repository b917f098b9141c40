"""_Clock: the event heap and the bookkeeping every asynchronous protocol shares (leave/join included)."""

import heapq
from typing import Callable

import numpy as np

from ripples_jax.timeline.costs import SpeedModel
from ripples_jax.timeline.trace import APPLY, COMPUTE, JOIN, START, Trace


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

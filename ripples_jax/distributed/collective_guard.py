"""Collectives of an executor that drives several devices of one process (spmd): a window of rounds
in flight, and a guard that ends a stuck run with one line instead of XLA's abort (docs/design.md 5.2).

Why a window: XLA:CPU runs each device's part of a program on a launch pool thread, which holds the
thread while the part waits for its inputs; a participant of a collective holds a thread while it waits
in the rendezvous. Dispatching rounds without bound let the launches of later rounds, all waiting for
inputs, take every thread while a participant of an earlier round's collective still waited for one: a
deadlock, which XLA ends with a C++ abort after 40 s (8 devices on 2 cores: within seconds of a tight
loop, after thousands of steps of the training loop). `admit` keeps at most MAX_IN_FLIGHT rounds
outstanding, so the threads held at once are bounded (host.cpu_pool_size covers the bound); the host
still prepares round k+1 while round k computes.

Why a guard: a round that still never completes (a device wedged for another reason) would end in the
same abort, losing every step since the last checkpoint with a stack trace. A thread polls the oldest
round not yet complete; when one has not completed `timeout_s` after the previous one did (or after its
dispatch, if later), it writes one line naming the collective, the step and the workdir and ends the
process with EXIT_STUCK. The newest committed checkpoint is intact (a round that never completes never
reaches one: RunLog's fingerprint waits on the state) and a rerun resumes from it. `timeout_s`
(config.stuck_timeout_s, 30 s) stays under XLA's own termination timeout (40 s) so the guard speaks first.
"""

import collections
import os
import sys
import threading
import time

EXIT_STUCK = 75  # sysexits' EX_TEMPFAIL, as coord.EXIT_LOST: run the same command again to resume
MAX_IN_FLIGHT = 2  # rounds dispatched and not complete: the host's next round overlaps the device's


class CollectiveGuard:
  """The window and the guard of one loop.

  Per round: `admit()` before its dispatch (blocks while MAX_IN_FLIGHT rounds are outstanding),
  `dispatched(step, out, what)` after (out: any jax.Array the round produces); `drain()` before work
  that is no round (an evaluation, a checkpoint: its collectives then have the pools to themselves);
  `close()` at the end. Compile time is outside the watch: a round is handed over once its call has
  returned.
  """

  def __init__(self, timeout_s: float, workdir: str, checkpoint, poll_s: float = 0.05, exit_fn=None):
    self.timeout_s, self.workdir, self.checkpoint, self.poll_s = timeout_s, workdir, checkpoint, poll_s
    self.exit_fn = exit_fn or os._exit
    self._window = collections.deque()  # the main thread's outstanding rounds (admit, drain)
    self._pending = collections.deque()  # the watch thread's: (step, out, what, handed_at)
    self._lock = threading.Lock()
    self._done_at = time.monotonic()  # when the last watched round completed
    self._stop = threading.Event()
    self.fired = None  # the line written, once fired
    self._thread = threading.Thread(target=self._watch, name="collective-guard", daemon=True)
    if timeout_s > 0:
      self._thread.start()

  def admit(self) -> None:
    while len(self._window) >= MAX_IN_FLIGHT:
      self._window.popleft().block_until_ready()

  def drain(self) -> None:
    while self._window:
      self._window.popleft().block_until_ready()

  def dispatched(self, step: int, out, what: str) -> None:
    self._window.append(out)
    if self.timeout_s > 0:
      with self._lock:
        self._pending.append((step, out, what, time.monotonic()))

  def close(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()

  def _watch(self) -> None:
    while not self._stop.wait(self.poll_s):
      with self._lock:
        while self._pending and self._pending[0][1].is_ready():
          self._pending.popleft()
          self._done_at = time.monotonic()
        oldest = self._pending[0] if self._pending else None
      if oldest is None:
        continue
      step, _, what, handed = oldest
      waited = time.monotonic() - max(handed, self._done_at)
      if waited > self.timeout_s:
        self._fire(step, what, waited)
        return

  def _fire(self, step: int, what: str, waited: float) -> None:
    self.fired = (
      f"error: stuck collective: {what} of step {step} has not completed after {waited:.0f} s "
      f"(config.stuck_timeout_s={self.timeout_s:g}); workdir {self.workdir}: its newest checkpoint "
      f"({self.checkpoint()}) is intact; run the same command again to resume from it"
    )
    sys.stderr.write(self.fired + "\n")
    sys.stderr.flush()
    self.exit_fn(EXIT_STUCK)

"""Coordination through the jax.distributed service: agreed estimates, heartbeats, a watchdog.

Why a watchdog: a member that never reaches a collective leaves the others blocked in it forever
(gloo has no timeout once a group is set up), and JAX catches SIGTERM. So every process beats a
heartbeat into the coordination service's key-value store and watches everybody else's; when a worker
stops beating, or no worker completes anything for a configured time, the process prints one line
naming the lost worker(s) and the last step each worker completed, and exits hard (os._exit: the main
thread may be stuck inside a collective and cannot be unwound).
"""
import os
import sys
import threading
import time

PREFIX = "ripples"
EXIT_LOST = 75  # a peer was lost: distinct from crashes (1) and bad input (2)


def client():
  from jax._src import distributed  # the coordination-service client jax.distributed set up
  if distributed.global_state.client is None:
    raise RuntimeError("executor=async needs jax.distributed.initialize() first (--jax_distributed)")
  return distributed.global_state.client


def publish_estimate(kv, block: int, worker: int, seconds: float) -> None:
  # repr round-trips a float exactly, so every process plans with bit-identical numbers.
  kv.key_value_set(f"{PREFIX}/est/{block}/{worker}", repr(float(seconds)), allow_overwrite=True)


def fetch_estimates(kv, block: int, num_workers: int, timeout_s: float) -> list[float]:
  return [float(kv.blocking_key_value_get(f"{PREFIX}/est/{block}/{w}", int(timeout_s * 1000)))
          for w in range(num_workers)]


class Watchdog:
  """A daemon thread: beats this worker's heartbeat and checks everybody's.

  The heartbeat value is "<beat counter> <completed steps> <completed events> <done flag>". A counter,
  not a timestamp, so hosts need not share a clock: only changes are compared, on the local clock.
  """

  def __init__(self, kv, worker: int, num_workers: int, progress, interval_s: float,
               timeout_s: float, stall_timeout_s: float, log=None, exit_fn=os._exit):
    self.kv, self.worker, self.n = kv, worker, num_workers
    self.progress = progress            # () -> (completed steps, completed events, done)
    self.interval, self.timeout, self.stall_timeout = interval_s, timeout_s, stall_timeout_s
    self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    self.exit_fn = exit_fn
    self._stop = threading.Event()
    self._beat = 0
    now = time.monotonic()
    self.seen = {w: (None, now) for w in range(num_workers)}      # last value, when it changed
    self.moved = {w: (None, now) for w in range(num_workers)}     # last events count, when it changed
    self.steps = {w: 0 for w in range(num_workers)}
    self.done = {w: False for w in range(num_workers)}
    self._contact = now
    self.fired = False
    self._thread = threading.Thread(target=self._run, name="ripples-watchdog", daemon=True)

  def start(self):
    self._thread.start()
    return self

  def stop(self):
    self._stop.set()
    self._thread.join(timeout=5 * self.interval)

  def await_verdict(self, seconds: float) -> None:
    """Waits for the watchdog to name a lost peer (it exits the process); returns if none is found."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and self._thread.is_alive():
      time.sleep(0.1)

  def _run(self):
    while not self._stop.wait(self.interval):
      try:
        self.check(time.monotonic())
      except SystemExit:
        raise
      except Exception as e:  # noqa: BLE001  the service itself is gone (its host process died)
        if time.monotonic() - self._contact > self.timeout:
          self._lost(f"lost contact with the coordination service (hosted by worker 0's process): {e}", [0])

  def check(self, now: float) -> None:
    if self.fired:
      return
    steps, events, done = self.progress()
    self._beat += 1
    self.kv.key_value_set(f"{PREFIX}/hb/{self.worker}", f"{self._beat} {steps} {events} {int(done)}",
                          allow_overwrite=True)
    values = dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/"))
    self._contact = now
    for w in range(self.n):
      value = values.get(f"{PREFIX}/hb/{w}")
      if value is None:
        continue
      if value != self.seen[w][0]:
        self.seen[w] = (value, now)
      _, s, e, d = value.split()
      self.steps[w], self.done[w] = int(s), d == "1"
      if e != self.moved[w][0]:
        self.moved[w] = (e, now)
    if self._stop.is_set():
      return
    silent = [w for w in range(self.n) if w != self.worker and now - self.seen[w][1] > self.timeout]
    if silent:
      return self._lost(f"worker(s) {silent} lost: no heartbeat for {self.timeout:.0f} s", silent)
    running = [w for w in range(self.n) if not self.done[w]]
    if running and all(now - self.moved[w][1] > self.stall_timeout for w in running):
      stalled = min(running, key=lambda w: self.moved[w][1])
      self._lost(f"no progress for {self.stall_timeout:.0f} s; worker {stalled} stalled first "
                 f"(workers {running} are blocked)", [])

  def _lost(self, why: str, lost: list) -> None:
    self.fired = True
    last = " ".join(f"w{w}:{self.steps[w]}" for w in range(self.n))
    self.log(f"worker {self.worker}: {why}; last completed step per worker: {last}; exiting")
    if self.worker == 0:
      self._outlive_peers(set(lost))
    self.exit_fn(EXIT_LOST)

  def _outlive_peers(self, lost: set) -> None:
    """Process 0 hosts the coordination service: when it goes, every other process's JAX client aborts
    at once (SIGABRT), before its own watchdog can name the lost worker. So process 0 exits last: once
    the other survivors' heartbeats have stopped (they exited), or after one more timeout."""
    deadline = time.monotonic() + self.timeout
    while time.monotonic() < deadline:
      time.sleep(self.interval)
      try:
        values = dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/"))
      except Exception:  # noqa: BLE001
        return
      now = time.monotonic()
      for w in range(self.n):
        value = values.get(f"{PREFIX}/hb/{w}")
        if value is not None and value != self.seen[w][0]:
          self.seen[w] = (value, now)
      alive = [w for w in range(1, self.n)
               if w not in lost and now - self.seen[w][1] < 2.5 * self.interval]
      if not alive:
        return


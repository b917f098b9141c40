"""The watchdog: every process's heartbeat in the key-value store, and the thread that watches them.

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

from ripples_jax.distributed import wire
from ripples_jax.distributed.kvstore import PREFIX
from ripples_jax.distributed.roles import COORDINATOR, EXIT_LOST, EXIT_REMOVED, EXIT_TERM


def _say(log, line: str) -> None:
  """The exit line, if it can be written: with the launcher gone, stderr is a broken pipe, and the
  process must exit all the same."""
  try:
    log(line)
  except Exception:  # noqa: BLE001
    pass


def beat_key(worker: int, inc: int | None = 0) -> str:
  """Worker w's heartbeat key in its incarnation inc (elastic, runtime/membership.py): one key per life,
  so an earlier life's process (stopped, then continued) can neither beat for the life that replaced
  it nor bring it back once removed. Incarnation 0 (and every non-elastic process): hb/<w>."""
  return f"{PREFIX}/hb/{worker}" if not inc else f"{PREFIX}/hb/{worker}.{inc}"


def newest_beats(values: dict, n: int) -> dict:
  """{worker: its newest life's heartbeat value} of a hb/ listing (a worker's view of its peers); a
  key or value that is no heartbeat of a worker of [0, n) is dropped (distributed/wire.py)."""
  out, lives = {}, {}
  for key, value in values.items():
    got = wire.life_key(key, n)
    if got is None or wire.beat(key, value) is None:
      continue
    w, inc = got
    if inc >= lives.get(w, -1):
      out[w], lives[w] = value, inc
  return out


def read_beat(value: str) -> tuple[int, str, bool, int]:
  """A heartbeat value (Watchdog's format) as (completed steps, events, done, incarnation)."""
  _, steps, events, done, *inc = value.split()
  return int(steps), events, done == "1", int(inc[0]) if inc else 0


class Watchdog:
  """A daemon thread: beats this worker's heartbeat and checks everybody's.

  The heartbeat value is "<beat counter> <completed steps> <completed events> <done flag>". A counter,
  not a timestamp, so hosts need not share a clock: only changes are compared, on the local clock.
  worker=None: the coordinator's, which beats nothing and watches all `num_workers`. `hosts_service`
  (default: worker 0) makes this process exit after its peers when it fires (_outlive_peers);
  `service_host` names who hosts the service in the lost-contact line.
  """

  def __init__(
    self,
    kv,
    worker: int,
    num_workers: int,
    progress,
    interval_s: float,
    timeout_s: float,
    stall_timeout_s: float,
    log=None,
    exit_fn=os._exit,
    role: str = "worker",
    hosts_service: bool | None = None,
    service_host: str = "worker 0",
    on_lost=None,
    incarnation: int | None = None,
    lives: int | None = None,
  ):
    self.kv, self.worker, self.n = kv, worker, num_workers
    self.role = role  # what the exit line calls a process: worker, or stage (pipeline)
    self.hosts_service = worker == 0 if hosts_service is None else hosts_service
    self.service_host = service_host
    self.progress = progress  # () -> (completed steps, completed events, done)
    self.interval, self.timeout, self.stall_timeout = interval_s, timeout_s, stall_timeout_s
    self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    self.exit_fn = exit_fn
    self._stop = threading.Event()
    self._beat = 0
    now = time.monotonic()
    self.seen = {w: (None, now) for w in range(num_workers)}  # last value, when it changed
    self.moved = {w: (None, now) for w in range(num_workers)}  # last events count, when it changed
    self.steps = {w: 0 for w in range(num_workers)}
    self.done = {w: False for w in range(num_workers)}
    self._contact = now
    # Elastic membership (runtime/membership.py). The coordinator's: on_lost(w) for a worker silent for
    # timeout_s, which the run then goes on without (`gone` until a new life of it is accepted:
    # watch_life). A worker's (incarnation not None): peers are not its concern; it exits when the
    # coordinator removed it.
    self.on_lost, self.incarnation, self.gone = on_lost, incarnation, set()
    self.lives = lives  # the coordinator's: lives per worker (membership.lives_of); None: unknown
    self._all_gone_since = None  # elastic: when the last live worker left (none done)
    # Each worker's life: the coordinator's are the ones it was told (watch_life at each accepted
    # rejoin: only that life's key is read); another process's, its newest beat's.
    self.incarnations = {w: 0 for w in range(num_workers)}
    self._told = {}  # worker -> a life watch_life announced, applied by the next check
    self.fired = False
    self._fire_lock = threading.RLock()  # the watchdog thread and a SIGTERM may want to exit at once
    self._thread = threading.Thread(target=self._run, name="ripples-watchdog", daemon=True)

  def start(self):
    # Silence counts from here, not from construction: the start barrier between the two can outlast
    # the timeout, and a peer's first beat comes an interval after its own start.
    now = time.monotonic()
    self.seen = {w: (None, now) for w in self.seen}
    self.moved = {w: (None, now) for w in self.moved}
    self._contact = now
    self._thread.start()
    return self

  def stop(self):
    self._stop.set()
    self._thread.join(timeout=5 * self.interval)

  def resume_members(self, out) -> None:
    """The coordinator's (elastic, resumed): the workers out at the marker the run resumes from are
    gone (not waited for, not lost again) until a rejoin brings each back (watch_life)."""
    self.gone |= set(out)

  def watch_life(self, w: int, inc: int) -> None:
    """The coordinator's (elastic): worker w's life inc was accepted (a rejoin). From the next check it
    is watched from now, beat or not: one that dies before its first beat is lost after timeout_s."""
    self._told[w] = inc

  def _beats(self, values: dict) -> dict:
    """{worker: heartbeat value} of the lives this watchdog watches (see incarnations)."""
    if self.on_lost is None:
      return newest_beats(values, self.n)
    return {
      w: values[k]
      for w in range(self.n)
      if (k := beat_key(w, self.incarnations[w])) in values and wire.beat(k, values[k]) is not None
    }

  def _apply_told(self, now: float) -> None:
    for w in list(self._told):
      self.incarnations[w] = self._told.pop(w)
      self.seen[w], self.moved[w] = (None, now), (None, now)
      self.done[w] = False
      self.gone.discard(w)

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
          host = COORDINATOR if self.service_host == f"the {COORDINATOR}" else 0
          why = f"lost contact with the coordination service (hosted by {self.service_host}'s process)"
          self._lost(f"{why}: {e}", [host])

  def check(self, now: float) -> None:
    if self.fired:
      return
    steps, events, done = self.progress()
    self._beat += 1
    if self.worker is not None:
      inc = f" {self.incarnation}" if self.incarnation else ""  # an elastic worker's later lives
      self.kv.key_value_set(
        beat_key(self.worker, self.incarnation),
        f"{self._beat} {steps} {events} {int(done)}{inc}",
        allow_overwrite=True,
      )
    self._apply_told(now)
    beats = self._beats(dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/")))
    self._contact = now
    for w, value in beats.items():
      if value != self.seen[w][0]:
        self.seen[w] = (value, now)
      self.steps[w], e, self.done[w], life = read_beat(value)
      if self.on_lost is None:
        self.incarnations[w] = life
      # A worker finishing is progress too: the last worker out of a long collective (DiLoCo's outer
      # all-reduce behind a straggler) is done a beat before its peers' beats show them leaving it.
      if (e, self.done[w]) != self.moved[w][0]:
        self.moved[w] = ((e, self.done[w]), now)
    if self._stop.is_set():
      return
    if self.incarnation is not None:
      return self._removed()
    silent = [w for w in range(self.n) if w != self.worker and now - self.seen[w][1] > self.timeout]
    if self.on_lost is not None:
      for w in silent:
        if w not in self.gone and not self.done[w]:
          self.gone.add(w)
          self.on_lost(w, self.incarnations[w])  # the life that went silent (a newer one may be joining)
      silent = []
    if silent:
      return self._lost(f"{self.role}(s) {silent} lost: no heartbeat for {self.timeout:.0f} s", silent)
    running = [w for w in range(self.n) if not self.done[w] and w not in self.gone]
    if self.on_lost is not None and not running and not any(self.done.values()):
      # Every worker left an elastic run before its end: nobody can post STOP or finish it. A restart
      # may still rejoin (a beat of it makes it a member again); after stall_timeout without one the
      # run ends resumable, instead of waiting for workers that will never come.
      self._all_gone_since = self._all_gone_since or now
      if self.lives is not None and all(self.incarnations[w] + 1 >= self.lives for w in self.gone):
        # No worker has a life left (membership.exhausted): no restart can be taken back, so waiting
        # for one would only delay the line by stall_timeout.
        return self._lost(
          f"every {self.role} left the run ({self.role}s {sorted(self.gone)}) and none has a life left "
          f"to rejoin with ({self.lives} per {self.role}: --max_restarts={self.lives - 1}); run the same "
          "command again to resume from the newest checkpoint",
          [],
        )
      if now - self._all_gone_since > self.stall_timeout:
        return self._lost(
          f"every {self.role} left the run ({self.role}s {sorted(self.gone)}) and none rejoined for "
          f"{self.stall_timeout:.0f} s; run the same command again to resume from the newest checkpoint",
          [],
        )
      return
    self._all_gone_since = None
    # Stalled: nobody still in the run (done or running) completed anything for stall_timeout.
    members = [w for w in range(self.n) if w not in self.gone]
    if running and all(now - self.moved[w][1] > self.stall_timeout for w in members):
      stalled = min(running, key=lambda w: self.moved[w][1])
      self._lost(
        f"no progress for {self.stall_timeout:.0f} s; {self.role} {stalled} stalled first "
        f"({self.role}s {running} are blocked)",
        [],
      )

  def _removed(self) -> None:
    """An elastic worker: exits (EXIT_REMOVED) once the coordinator has removed this incarnation."""
    key = f"{PREFIX}/removed/{self.worker}"
    value = dict(self.kv.key_value_dir_get(f"{PREFIX}/removed/")).get(key)
    removed = None if value is None else wire.life(key, value)
    # This life, or a later one (this process is an earlier life's, stopped and continued since): out.
    if removed is not None and removed >= self.incarnation:
      self._finish(
        f"removed from the run (no heartbeat reached the coordinator for {self.timeout:.0f} s: it "
        "stalled); restart it to rejoin",
        [],
        EXIT_REMOVED,
      )

  def _lost(self, why: str, lost: list) -> None:
    self._finish(why, lost, EXIT_LOST)

  def terminate(self, why: str) -> None:
    """Stops this process now (SIGTERM): the same line and exit path as a lost peer, code EXIT_TERM."""
    if not self.fired:
      self._refresh_steps(timeout_s=1.0)
    self._finish(why, [], EXIT_TERM)

  def _refresh_steps(self, timeout_s: float) -> None:
    """Every worker's newest completed step for the exit line (the last check may be a beat old);
    best effort, bounded: the service may be gone."""

    def read():
      try:
        for w, value in self._beats(dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/"))).items():
          self.steps[w] = read_beat(value)[0]
        if self.worker is not None:
          self.steps[self.worker] = int(self.progress()[0])
      except Exception:  # noqa: BLE001
        pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout_s)

  def _finish(self, why: str, lost: list, code: int) -> None:
    with self._fire_lock:
      if self.fired:
        return
      self.fired = True
    last = " ".join(f"w{w}:{self.steps[w]}" for w in range(self.n))
    me = COORDINATOR if self.worker is None else f"{self.role} {self.worker}"
    role = "worker" if self.worker is None else self.role
    _say(self.log, f"{me}: {why}; last completed step per {role}: {last}; exiting")
    if self.hosts_service:
      self._outlive_peers(set(lost))
    self.exit_fn(code)

  def _outlive_peers(self, lost: set) -> None:
    """Process 0 hosts the coordination service: when it goes, every other process's JAX client aborts
    at once (SIGABRT), before its own watchdog can name the lost worker. So process 0 exits last: once
    the other survivors' heartbeats have stopped (they exited), or after one more timeout."""
    deadline = time.monotonic() + self.timeout
    while time.monotonic() < deadline:
      time.sleep(self.interval)
      try:
        beats = self._beats(dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/")))
      except Exception:  # noqa: BLE001
        return
      now = time.monotonic()
      for w, value in beats.items():
        if value != self.seen[w][0]:
          self.seen[w] = (value, now)
      alive = [
        w
        for w in range(self.n)
        if w != self.worker and w not in lost and now - self.seen[w][1] < 2.5 * self.interval
      ]
      if not alive:
        return

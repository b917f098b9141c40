"""Coordination through the jax.distributed service: agreed estimates, heartbeats, a watchdog.

Why a watchdog: a member that never reaches a collective leaves the others blocked in it forever
(gloo has no timeout once a group is set up), and JAX catches SIGTERM. So every process beats a
heartbeat into the coordination service's key-value store and watches everybody else's; when a worker
stops beating, or no worker completes anything for a configured time, the process prints one line
naming the lost worker(s) and the last step each worker completed, and exits hard (os._exit: the main
thread may be stuck inside a collective and cannot be unwound).

SIGTERM (the launcher stopping the job, a scheduler's cancel or preemption) takes the same path
(SigtermStop): one line naming why and each worker's last completed step, exit code EXIT_TERM. JAX's
own SIGTERM handler (its preemption service) only logs the signal and keeps running, so
host.init_distributed turns that service off.

Where the service listens: bind_address and port_problem, used by host.init_distributed (process 0)
and the local launcher; collectives_host, where gloo's listeners go.

What a worker's last lines say about a failure, for the local launcher: lost_named (the workers a
watchdog named) and intruder_task (a task id registered by a process nobody started as a worker).

Roles: in an executor=async run, process 0 is the coordinator (COORDINATOR): it hosts the coordination
service and the Group Generator's authority and trains nothing; worker w is process w + 1
(worker_process). Its watchdog watches every worker and exits last. Elsewhere (the pipeline) process k
is stage k and process 0 hosts the service.
"""

import ctypes
import errno
import ipaddress
import os
import re
import signal
import socket
import sys
import threading
import time

PREFIX = "ripples"
EXIT_LOST = 75  # a peer was lost: distinct from crashes (1) and bad input (2); resume to go on
EXIT_TERM = 143  # stopped by SIGTERM: 128 + 15, what a shell reports for a SIGTERM death; resume to go on
EXIT_REMOVED = 76  # runtime.elastic: this worker was removed (it stalled); restart it to rejoin
EXIT_REFUSED = 78  # runtime.elastic: a rejoin the run cannot take (the line says why); not restarted
LAUNCHER_PID_ENV = "RIPPLES_LAUNCHER_PID"  # set by the local launcher: its workers stop when it dies
COORDINATOR = "coordinator"  # process 0 of an executor=async run (its watchdog's name in exit lines)
WARMUP = "warmup"  # publish_estimate's block of the workers' warm-up step times (the authority's first plan)


def worker_process(worker: int) -> int:
  """The process id of worker `worker` in an executor=async run (process 0 is the coordinator)."""
  return worker + 1


def worker_of(process: int) -> int:
  """The worker a process of an executor=async run is (-1: the coordinator)."""
  return process - 1


def client():
  from jax._src import distributed  # the coordination-service client jax.distributed set up

  if distributed.global_state.client is None:
    raise RuntimeError("executor=async needs jax.distributed.initialize() first (--jax_distributed)")
  return distributed.global_state.client


def publish_estimate(kv, block: int, worker: int, seconds: float) -> None:
  # repr round-trips a float exactly, so every process plans with bit-identical numbers.
  kv.key_value_set(f"{PREFIX}/est/{block}/{worker}", repr(float(seconds)), allow_overwrite=True)


def fetch_estimates(kv, block: int, num_workers: int, timeout_s: float) -> list[float]:
  return [
    float(kv.blocking_key_value_get(f"{PREFIX}/est/{block}/{w}", int(timeout_s * 1000)))
    for w in range(num_workers)
  ]


def _say(log, line: str) -> None:
  """The exit line, if it can be written: with the launcher gone, stderr is a broken pipe, and the
  process must exit all the same."""
  try:
    log(line)
  except Exception:  # noqa: BLE001
    pass


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
    # timeout_s, which the run then goes on without (`gone` until it beats again: a rejoin). A worker's
    # (incarnation not None): peers are not its concern; it exits when the coordinator removed it.
    self.on_lost, self.incarnation, self.gone = on_lost, incarnation, set()
    self.incarnations = {w: 0 for w in range(num_workers)}  # each worker's, as its heartbeat says
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
        f"{PREFIX}/hb/{self.worker}", f"{self._beat} {steps} {events} {int(done)}{inc}", allow_overwrite=True
      )
    values = dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/"))
    self._contact = now
    for w in range(self.n):
      value = values.get(f"{PREFIX}/hb/{w}")
      if value is None:
        continue
      if value != self.seen[w][0]:
        self.seen[w] = (value, now)
        self.gone.discard(w)
      self.steps[w], e, self.done[w], self.incarnations[w] = read_beat(value)
      if e != self.moved[w][0]:
        self.moved[w] = (e, now)
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
    if running and all(now - self.moved[w][1] > self.stall_timeout for w in running):
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
    if value is not None and int(value) == self.incarnation:
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
        values = dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/"))
        for w in range(self.n):
          if (value := values.get(f"{PREFIX}/hb/{w}")) is not None:
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
        values = dict(self.kv.key_value_dir_get(f"{PREFIX}/hb/"))
      except Exception:  # noqa: BLE001
        return
      now = time.monotonic()
      for w in range(self.n):
        value = values.get(f"{PREFIX}/hb/{w}")
        if value is not None and value != self.seen[w][0]:
          self.seen[w] = (value, now)
      alive = [
        w
        for w in range(self.n)
        if w != self.worker and w not in lost and now - self.seen[w][1] < 2.5 * self.interval
      ]
      if not alive:
        return


# The watchdog's exit lines (Watchdog.check, _run) and the worker(s) each one names.
# -- values in order through the key-value store (the runtime's transport) ------------------------

_GET_MS = 1000  # blocking gets wake this often to see whether the run is over
PAGE = 8  # queue batches (requests) per store directory: one delete call removes a page


def paged(prefix: str, j: int) -> str:
  """The key of the j-th value under `prefix`, in its page's directory."""
  return f"{prefix}/{j // PAGE}/{j}"


def _is_timeout(e: Exception) -> bool:
  text = str(e)
  return "DEADLINE_EXCEEDED" in text or "NOT_FOUND" in text or "timed out" in text.lower()


class Either:
  """Set when either event is (the run's stop, or one listener's own)."""

  def __init__(self, a: threading.Event, b: threading.Event):
    self.a, self.b = a, b

  def is_set(self) -> bool:
    return self.a.is_set() or self.b.is_set()


def values_in_order(kv, prefix: str, stop: threading.Event | None = None, page: bool = False):
  """The values of <prefix>/0, <prefix>/1, ... (with `page`: paged(prefix, j)) as each is set, until
  `stop` is set: blocking gets that wake every _GET_MS to look at it. Any other error of the service
  (it is gone) is raised."""
  j = 0
  while stop is None or not stop.is_set():
    try:
      value = kv.blocking_key_value_get(paged(prefix, j) if page else f"{prefix}/{j}", _GET_MS)
    except Exception as e:  # noqa: BLE001
      if _is_timeout(e):
        continue
      raise
    yield value
    j += 1


_WHO = r"^(?:(?:worker|stage) \d+|coordinator)"
_LOST_LINES = (
  re.compile(_WHO + r": (?:worker|stage)\(s\) \[([\d, ]+)\] lost: no heartbeat"),
  re.compile(_WHO + r": no progress for .*; (?:worker|stage) (\d+) stalled first"),
  re.compile(
    _WHO + r": lost contact with the coordination service \(hosted by (?:worker (0)|the (coordinator))'s"
  ),
)


def lost_named(line: str) -> list:
  """The worker(s) a watchdog's exit line names as lost or stalled first (ints; COORDINATOR for the
  coordinator); [] for any other line."""
  for pattern in _LOST_LINES:
    if m := pattern.search(line):
      if m.lastindex and m.lastindex > 1 and m.group(2):
        return [COORDINATOR]
      return [int(w) for w in m.group(1).split(",")]
  return []


# What the coordination service reports (process 0's log, every client's abort line) when a task id that
# has already registered registers again: under the local launcher, nobody restarts a worker, so another
# process connected to the (unauthenticated) coordinator as that task.
_REREGISTERED = re.compile(r"\b(\d+) unexpectedly tried to connect with a different incarnation")


def intruder_task(line: str) -> int | None:
  """The task id in the coordination service's "registered again" error, or None."""
  m = _REREGISTERED.search(line)
  return int(m.group(1)) if m else None


class SigtermStop:
  """SIGTERM ends this worker: one line naming why, exit code EXIT_TERM, through the watchdog once it
  exists (`.watchdog = ...`: the line then has every worker's last completed step, and process 0 waits
  for its peers to go first, as it does for a lost peer), directly during start-up.

  The handler must run even while the main thread is stuck inside a collective (where Python signal
  handlers wait): the C-level handler also writes the signal's number to a wakeup pipe, which a daemon
  thread watches. Under the local launcher (LAUNCHER_PID_ENV), the kernel sends SIGTERM when the
  launcher dies, even by SIGKILL (PR_SET_PDEATHSIG), so no worker outlives it.
  """

  def __init__(self, worker: int | None = None, log=None, exit_fn=os._exit, name: str | None = None):
    if worker is None and name is None:
      from jax._src import distributed

      worker = distributed.global_state.process_id
    self.worker = worker
    self.name = name or f"worker {worker}"  # what its start-up exit line calls this process
    self.watchdog = None
    self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    self.exit_fn = exit_fn
    self._lock = threading.RLock()
    self._stopping = False

  def install(self) -> "SigtermStop":
    if threading.current_thread() is not threading.main_thread():
      return self  # signal handlers can only be set from the main thread
    signal.signal(signal.SIGTERM, lambda signum, frame: self.stop("received SIGTERM"))
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=self._listen, args=(read,), name="ripples-sigterm", daemon=True).start()
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher:
      try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
      except (OSError, AttributeError):  # not Linux
        pass
      if os.getppid() != int(launcher):
        self.stop(f"its launcher (pid {launcher}) is gone")
    return self

  def _listen(self, fd: int) -> None:
    while True:
      data = os.read(fd, 64)
      if not data:
        return
      if signal.SIGTERM in data:
        self.stop("received SIGTERM")

  def stop(self, why: str) -> None:
    with self._lock:
      if self._stopping:
        return
      self._stopping = True
    why = f"{why} (stopped by the launcher or the scheduler)"
    if self.watchdog is not None:
      self.watchdog.terminate(why)  # exits, unless the watchdog is already exiting (lost peer)
    else:
      _say(self.log, f"{self.name}: {why} during start-up; exiting")
      self.exit_fn(EXIT_TERM)


# -- where the coordination service listens ---------------------------------------------------------


def split_address(address: str) -> tuple[str, int]:
  """'host:port', '[v6]:port' -> (host without brackets, port)."""
  host, port = address.rsplit(":", 1)
  return host.strip("[]"), int(port)


def bind_address(coordinator_address: str) -> str | None:
  """The address process 0's coordination service (an unauthenticated key-value store) binds.

  It follows the coordinator address: a loopback address (127.0.0.1, ::1, localhost) binds loopback
  only, any other IP address that interface only. A host name gives None: JAX's default, every
  interface ([::]:port), since a host's own name may resolve to a loopback address on that host
  (Debian's 127.0.1.1) while the other hosts reach it through its network address.
  """
  host, port = split_address(coordinator_address)
  if host == "localhost":
    return f"127.0.0.1:{port}"
  try:
    ip = ipaddress.ip_address(host)
  except ValueError:
    return None
  return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def collectives_host(coordinator_address: str) -> str | None:
  """The address gloo's TCP listeners (the CPU collectives: unauthenticated tensor traffic) should bind:
  loopback when the coordinator is a loopback address (every process is on this host: the local
  launcher's case), else None, JAX's default (what this host's name resolves to; other hosts must reach it).
  """
  host, _ = split_address(coordinator_address)
  if host == "localhost":
    return "127.0.0.1"
  try:
    return host if ipaddress.ip_address(host).is_loopback else None
  except ValueError:  # a host name
    return None


def port_problem(bind: str) -> int | None:
  """None when the service could bind `bind` ('host:port'; '[::]:port' for every interface), else the
  errno: EADDRINUSE (a process listens there: gRPC would fail or, with SO_REUSEPORT, share the port
  with it) or EADDRNOTAVAIL (not an address of this host)."""
  host, port = split_address(bind)
  every = host in ("", "::", "0.0.0.0")
  try:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  except OSError:  # IPv6 off on this host
    s, host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
  with s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
    if s.family == socket.AF_INET6 and every:
      s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] covers IPv4 too
    try:
      s.bind((host, port))
      s.listen(1)
    except OSError as e:
      return e.errno or errno.EADDRINUSE
  return None

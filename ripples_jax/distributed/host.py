"""Host set-up before the first device use: the console's log filter, forced CPU devices, jax.distributed."""

import logging as std_logging
import math
import os
import re
import socket
import sysconfig
import time

import jax
from absl import logging


def use_cpu_devices(count: int) -> None:
  """Gives the CPU backend `count` devices (accelerators are unaffected) and an intra-op pool that
  their collectives cannot exhaust (size_cpu_pool).

  Call before the first device use. XLA_FLAGS's --xla_force_host_platform_device_count, when set (the
  tests' conftest, the local launcher, users), takes precedence; so does a backend already started.
  """
  forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
  size_cpu_pool(int(forced.group(1)) if forced else count)
  if forced:
    return
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError as e:  # the backend is already up: its device count stands
    logging.warning("cpu devices: keeping %d (%s)", jax.device_count(), str(e).splitlines()[0][:80])


def cpu_pool_size(devices: int) -> int:
  """Threads for XLA:CPU's two pools (the launch pool that runs each device's program, the intra-op pool
  that runs its parallel ops) with `devices` CPU devices in this process: two per device plus one per
  core (docs/design.md 5.2).

  A device's launch holds a launch thread while it waits for its inputs, and a participant of a
  collective holds a thread while it waits in the rendezvous for the others. With the executors'
  window of two rounds in flight (collective_guard.CollectiveGuard.admit) at most one launch per device
  waits for inputs and one participant per device waits in a rendezvous, so 2 x devices threads can be
  held at once and the cores' share stays free for the participants still on their way. XLA's default
  is max(cores, devices) threads (8 with 8 devices on 2 cores); the window alone with those ran 15,000
  rounds of the tight-loop provocation clean once, and the margin covers what the model leaves out.
  """
  return 2 * devices + (os.cpu_count() or 1)


def size_cpu_pool(devices: int) -> None:
  """Sets NPROC, which XLA:CPU's DefaultThreadPoolSize reads for its launch and intra-op pools (after
  PJRT_NPROC), to cpu_pool_size(devices) unless the user set either. Read once, when the CPU backend
  starts: call first."""
  if "PJRT_NPROC" in os.environ:
    return
  os.environ.setdefault("NPROC", str(cpu_pool_size(devices)))


def collective_timeout_s(rt) -> float:
  """An elastic run's collective timeout (--xla_cpu_collective_timeout_seconds, `recoverable`): longer
  than a removal takes, so a stalled peer is gone by the time its exchanges fail (config.py checks
  runtime.stall_timeout against it; the runtime sets it)."""
  return 2 * rt.heartbeat_timeout


def recoverable(collective_timeout_s: float) -> None:
  """Elastic membership (runtime.elastic; docs/design.md 3.8): the survivors of a dead process live on
  (jax_enable_recoverability, before jax.distributed.initialize), and a collective whose peer never
  comes (a stalled worker's) fails after collective_timeout_s instead of gloo's 1,800 s. Call before
  the backend starts: XLA reads its flags once."""
  jax.config.update("jax_enable_recoverability", True)
  flags = re.sub(r"--xla_cpu_collective_timeout_seconds=\S+", "", os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = (
    f"{flags} --xla_cpu_collective_timeout_seconds={int(math.ceil(collective_timeout_s))}".strip()
  )


def init_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_ids=None,
) -> None:
  """jax.distributed.initialize(); unset arguments are resolved by JAX (SLURM, TPU pods, env vars).

  CPU processes talk through gloo (the default CPU backend has no cross-process collectives), whose
  TCP listeners (unauthenticated tensor traffic) go on loopback when the coordinator address is loopback
  (place_collectives: the local launcher's case); elsewhere on JAX's default, named once by process 0.
  Process 0's coordination service (an unauthenticated key-value store) binds where the coordinator
  address points (addresses.bind_address): loopback for 127.0.0.1/localhost/::1, that interface for another
  IP address, every interface (JAX's default) for a host name; JAX_COORDINATOR_BIND_ADDRESS overrides.
  Process 0 checks the port first: a taken one ends it with one line and exit code 2 (JAX would crash).
  JAX's preemption service is off: its SIGTERM handler only logs "SIGTERM caught" and carries on, and
  nothing here uses its sync points, so SIGTERM stops a process (an async worker says why first:
  coord.SigtermStop).
  """
  import errno
  import sys

  from ripples_jax.distributed import addresses

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_preemption_service", False)
  ids = [int(i) for i in local_device_ids] if local_device_ids else None
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or (
    addresses.bind_address(address) if address else None
  )
  if process_id == 0 and address:
    port = addresses.split_address(address)[1]
    problem = addresses.port_problem(bind or f"[::]:{port}")
    if problem == errno.EADDRNOTAVAIL and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
      logging.warning("coordinator %s is not an address of this host: listening on every interface", address)
      bind = None
    elif problem:
      sys.stderr.write(
        f"error: coordinator port {port} ({bind or 'every interface'}) is not free: "
        f"{os.strerror(problem)}; pick another port in --coordinator_address\n"
      )
      sys.stderr.flush()
      sys.exit(2)
  jax.distributed.initialize(
    coordinator_address, num_processes, process_id, local_device_ids=ids, coordinator_bind_address=bind
  )
  place_collectives()


def place_collectives() -> None:
  """gloo's listeners on loopback for a loopback coordinator (addresses.collectives_host), else where JAX puts
  them: process 0 says where once (only when the CPU backend, which hosts them, is in use)."""
  from jax._src import distributed

  from ripples_jax.distributed import addresses

  state = distributed.global_state
  host = addresses.collectives_host(state.coordinator_address)
  if host:
    bind_collectives(host)
  elif state.process_id == 0 and (not jax.config.jax_platforms or "cpu" in jax.config.jax_platforms):
    logging.info(
      "gloo (the CPU collectives: unauthenticated tensor traffic) listens on %s, what this host's "
      "name %r resolves to (on every host its own): keep the hosts' network trusted (README)",
      default_collectives_address(),
      socket.gethostname(),
    )


def bind_collectives(host: str) -> None:
  """The CPU backend with gloo's TCP listeners on `host` (make_gloo_tcp_collectives(hostname=host)).

  jax 0.10.2 has no option for it: its CPU factory (xla_bridge.make_cpu_client) calls
  make_gloo_tcp_collectives without a hostname or interface, and gloo then binds what this host's name
  resolves to (a network address on most hosts). So the "cpu" factory is registered again, before the
  backend starts (the first device use), with collectives made that way.
  """
  from jax._src import distributed, xla_bridge
  from jax._src.lib import _jax

  def make_cpu_client():
    collectives = _jax.make_gloo_tcp_collectives(
      distributed_client=distributed.global_state.client, hostname=host
    )
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def default_collectives_address() -> str:
  """Where gloo listens without a hostname or interface: the first address this host's name resolves to
  that can be bound (gloo's lookupAddrForHostname)."""
  name = socket.gethostname()
  try:
    found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
  except OSError:
    return f"nothing ({name!r} does not resolve)"
  for family, kind, proto, _, addr in found:
    try:
      with socket.socket(family, kind, proto) as s:
        s.bind((addr[0], 0))
      return addr[0]
    except OSError:
      continue
  return f"nothing ({name!r} resolves to no address of this host)"


# This project's source folders (also when installed: ripples_jax/ then holds experiments/ and configs/).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ripples_jax/
_OWN = tuple(
  os.path.join(os.path.dirname(_PACKAGE), d) + os.sep
  for d in ("ripples_jax", "experiments", "benchmarks", "configs", "tests")
)
# Where other libraries live: installed packages and the standard library.
_LIBRARY_DIRS = tuple(
  sorted(
    {
      os.path.abspath(p) + os.sep
      for k in ("stdlib", "platstdlib", "purelib", "platlib")
      if (p := sysconfig.get_paths().get(k))
    }
  )
)


def from_library(pathname: str | None) -> bool:
  """Whether a log record's source file belongs to another library (an installed package such as
  orbax or jax, or the standard library) rather than to this project or a user's own script."""
  if not pathname or pathname.startswith("<"):  # python -c, an interactive session
    return False
  path = os.path.abspath(pathname)
  if path.startswith(_OWN):
    return False
  return (
    path.startswith(_LIBRARY_DIRS)
    or f"{os.sep}site-packages{os.sep}" in path
    or f"{os.sep}dist-packages{os.sep}" in path
  )


class LibraryFilter(std_logging.Filter):
  """Keeps other libraries' INFO and DEBUG lines (orbax's ~46 per checkpoint, jax's "Unable to
  initialize backend 'tpu'") off the console, keyed on each record's source file (from_library). Their
  warnings and errors still show, as the message alone: a traceback they carry is left out (one line
  says so). Records of this project pass unchanged. Lines that pass first clear a progress bar drawn
  on the terminal (progress.clear_bar), so a line from any thread starts on a clean line."""

  def __init__(self, handler: std_logging.Handler, verbose: bool = False):
    super().__init__()
    self.handler, self.verbose = handler, verbose

  def filter(self, record: std_logging.LogRecord) -> bool:
    if not self.verbose and from_library(record.pathname):
      if record.levelno < std_logging.WARNING:
        return False
      if record.exc_info or record.exc_text or record.stack_info:
        # Not this record: other handlers may want its traceback. A copy without it, on this handler.
        short = std_logging.makeLogRecord(record.__dict__)
        short.exc_info = short.exc_text = short.stack_info = None
        short.msg = f"{record.getMessage()} (traceback hidden; --verbose_libraries shows it)"
        short.args = None
        self.handler.handle(short)
        return False
    from ripples_jax import progress

    progress.clear_bar()
    return True


class ConsoleFormatter(std_logging.Formatter):
  """absl's prefix without its thread id and microseconds: `I1201 11:26:34.123 file.py:12] message`
  (absl's is `I1201 11:26:34.123456 140556851072 file.py:12] message`)."""

  def format(self, record: std_logging.LogRecord) -> str:
    t = time.localtime(record.created)
    level = logging.converter.get_initial_for_level(record.levelno)
    stamp = f"{t.tm_mon:02d}{t.tm_mday:02d} {time.strftime('%H:%M:%S', t)}.{int(record.msecs):03d}"
    return f"{level}{stamp} {record.filename}:{record.lineno}] {super().format(record)}"


def quiet_library_logs(verbose: bool = False) -> LibraryFilter:
  """Installs LibraryFilter and ConsoleFormatter on absl's handler (the console of every entry point;
  replaces an earlier filter). verbose=True (--verbose_libraries) lets every line through, tracebacks
  included."""
  handler = logging.get_absl_handler()
  handler.setFormatter(ConsoleFormatter())
  for f in list(handler.filters):
    if isinstance(f, LibraryFilter):
      handler.removeFilter(f)
  f = LibraryFilter(handler, verbose)
  handler.addFilter(f)
  return f


def pin_threads(cores: set) -> None:
  """Every thread of this process on `cores`. os.sched_setaffinity(0, ...) sets the calling thread's
  mask only, and XLA's intra-op thread pool exists once JAX has started; threads made later inherit
  the mask of the thread that makes them."""
  tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
  for tid in tids:
    try:
      os.sched_setaffinity(tid, cores)
    except OSError:  # a thread that ended meanwhile
      pass

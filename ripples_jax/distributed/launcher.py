"""Starts N local worker processes on 127.0.0.1, streams their logs with a worker prefix, fails fast.

Every child is polled every 0.1 s. The first to exit non-zero fails the job: one line names it and its
exit code, the others are stopped, and launch() returns that code. That line names the cause when the
workers' last lines show one: a worker the first one's watchdog named as lost (a stalled worker, e.g.
SIGSTOPped, outlives the peers that give up on it: they are the first to exit, with coord.EXIT_LOST),
or a process this launcher did not start that registered at the coordinator as one of the tasks (the
coordination service is unauthenticated; it then aborts every worker). Stopping: SIGTERM to workers
1..N-1 first and to process 0 once they are gone (it hosts the coordination service: when it goes
first, its peers' JAX clients abort before they can say why), bounded by the grace period, then
SIGKILL to each remaining child's whole process group (a SIGCONT follows each SIGTERM: a stopped worker
acts on it at once instead of at the end of the grace period). A SIGTERM, SIGINT or SIGHUP to the launcher
does the same (returning 128 + the signal; a second one skips the grace period), and the workers get
SIGTERM from the kernel if the launcher itself is killed (coord.SigtermStop). A worker answers SIGTERM
with one line and exit code coord.EXIT_TERM (143).

The coordinator is 127.0.0.1:<port>, a free port unless one is given; process 0's coordination service
binds that loopback address only, and so do gloo's listeners (the CPU collectives) in every worker
(host.init_distributed).

gloo prints a line per peer for every group a worker connects (C++, on the worker's stderr): each
worker's first such line shows (its collectives are up) and the rest are counted into one line at the
end, unless the entry point's --verbose_libraries is among the arguments.

Bad input (launch's arguments) raises ValueError before anything starts; more workers than this process's
CPU cores is one warning line, and the job runs.
"""

import dataclasses
import errno
import importlib.util
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from ripples_jax import allocator
from ripples_jax.distributed import addresses, auth, coord

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MEANING = {
  coord.EXIT_LOST: "it lost a peer",
  coord.EXIT_TERM: "it was stopped by SIGTERM",
  coord.EXIT_REMOVED: "it was removed from the run after a stall",
  coord.EXIT_REFUSED: "the run could not take it back",
  coord.EXIT_STORAGE: "the disk refused a write",
}
# A full disk stays full: nothing is restarted on it, every process is stopped, and the job ends 74.
STORAGE_LINE = "free space (or make the folder writable) and run the same command again to resume"
RESTART_ENV = "RIPPLES_RESTART"  # a restarted process's restart count (its fault injection stays off)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def local_gpus() -> list[str]:
  """This host's NVIDIA GPUs as CUDA_VISIBLE_DEVICES entries (honouring one already set), or []."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return [d for d in visible.split(",") if d.strip()]
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def resolve_platform(platform: str) -> str:
  """'auto': the launcher's own JAX_PLATFORMS when set (the tests force cpu), else cuda when this host
  has NVIDIA GPUs, else cpu; anything else is kept (it becomes the children's JAX_PLATFORMS)."""
  if platform != "auto":
    return platform
  if os.environ.get("JAX_PLATFORMS"):
    return os.environ["JAX_PLATFORMS"]
  return "cuda" if local_gpus() else "cpu"


MALLOC = ("default", "tuned")


def child_env(
  cpu_devices: int, platform: str, index: int = 0, coordinator: bool = False, malloc: str = "default"
) -> dict:
  """The environment of worker `index`: forced CPU devices, JAX_PLATFORMS, and on cuda one GPU each
  (worker i sees GPU i mod the host's GPU count; launch() refuses more workers than GPUs: check_platform).
  The coordinator (which trains nothing, but takes part in the devices' start-up exchange) shares
  GPU 0 without preallocating its memory. malloc="tuned": ripples_jax.allocator's glibc tunables (read
  at process start only, so set here): a per-process pipeline stage whose programs allocate large
  temporaries every call reuses them instead of faulting fresh pages (measured: docs/design.md 5.1)."""
  env = dict(os.environ) if malloc == "default" else allocator.env()
  if platform == "cuda":
    gpus = local_gpus()
    if gpus:
      env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    if coordinator:
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
  if platform:
    env["JAX_PLATFORMS"] = platform
  env["PYTHONUNBUFFERED"] = "1"
  env[coord.LAUNCHER_PID_ENV] = str(os.getpid())
  return env


def describe(code: int) -> str:
  """'-9 (SIGKILL)', '75 (it lost a peer)', '1'."""
  if code < 0:
    try:
      return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
      return str(code)
  return f"{code} ({MEANING[code]})" if code in MEANING else str(code)


class _Clues:
  """What the workers' lines say about a failure: the workers each one's watchdog named as lost
  (coord.lost_named), and a task id registered by a process nobody started (coord.intruder_task)."""

  def __init__(self):
    self.lost, self.intruder = {}, None

  def read(self, worker: int, line: str) -> None:
    if named := coord.lost_named(line):
      self.lost[worker] = named
    if (task := coord.intruder_task(line)) is not None:
      self.intruder = task


GLOO_LINE = re.compile(r"^\[Gloo\] ")
VERBOSE_FLAG = re.compile(r"^--verbose_libraries(=(true|True|1|yes))?$")


class _LibraryLines:
  """Which worker lines reach the console: all when verbose, else each worker's first gloo line only."""

  def __init__(self, verbose: bool):
    self.verbose, self.seen, self.hidden, self.lock = verbose, set(), 0, threading.Lock()

  def show(self, worker: int, text: str) -> bool:
    if self.verbose or not GLOO_LINE.match(text):
      return True
    with self.lock:  # one reader thread per worker
      if worker not in self.seen:
        self.seen.add(worker)
        return True
      self.hidden += 1
      return False


@dataclasses.dataclass(frozen=True)
class Node:
  """Which node of a multi-node job this launcher is (torchrun's --nnodes/--node_rank): every node runs
  `num_processes` workers, node 0 also the coordinator; `coordinator_address` (host:port) is where node
  0's coordination service listens (required with nnodes > 1); `address` is where this node's gloo
  listeners bind ('' : the rule of addresses.collectives_host)."""

  nnodes: int = 1
  rank: int = 0
  coordinator_address: str = ""
  address: str = ""


class Roles:
  """Who each process this launcher starts is. Globally, without a coordinator process p is worker p;
  with one (an executor=async run) process 0 is the coordinator and process p is worker p - 1. Node r
  of a multi-node job starts workers r * n .. r * n + n - 1 (n per node) and, on node 0, the
  coordinator. `i` below is a local index: the launcher's own list of processes, the coordinator first."""

  def __init__(self, num_workers: int, coordinator: bool, node: Node | None = None):
    self.node = node or Node()
    self.n, self.coordinator = num_workers, coordinator
    self.hosts_coordinator = coordinator and self.node.rank == 0
    self.total = num_workers * self.node.nnodes + int(coordinator)  # processes in the whole job
    self.local = num_workers + int(self.hosts_coordinator)  # processes this launcher starts
    self.first = 0 if self.hosts_coordinator else self.node.rank * num_workers + int(coordinator)

  def process_id(self, i: int) -> int:
    return self.first + i

  def worker(self, i: int) -> int | None:
    """The worker id of local process i (None: the coordinator)."""
    p = self.process_id(i)
    return None if self.coordinator and p == 0 else p - int(self.coordinator)

  def local_worker(self, i: int) -> int:
    """Local process i's index among this node's workers (its GPU on cuda)."""
    return i - int(self.hosts_coordinator)

  def name(self, i: int) -> str:
    w = self.worker(i)
    return coord.COORDINATOR if w is None else f"worker {w}"

  def prefix(self, i: int) -> str:
    w = self.worker(i)
    return "[c]" if w is None else f"[w{w}]"

  def process(self, named) -> int | None:
    """The local index of a watchdog's named peer (a worker id, or coord.COORDINATOR), None when it is
    not a process of this launcher."""
    if named == coord.COORDINATOR:
      return 0 if self.hosts_coordinator else None
    i = int(named) + int(self.coordinator) - self.first
    return i if 0 <= i < self.local else None

  def codes(self, codes: list) -> str:
    if self.hosts_coordinator:
      return f"coordinator {codes[0]}, workers {codes[1:]}"
    if self.node.nnodes > 1:
      first = self.worker(0)
      return f"workers {first}..{first + self.n - 1}: {codes}"
    return str(codes)


def _stream(i: int, pipe, out, clues: _Clues, shown: _LibraryLines, prefix: str | None = None) -> None:
  prefix = prefix or f"[w{i}]"
  for line in iter(pipe.readline, b""):
    text = line.decode(errors="replace")
    clues.read(i, text)
    if shown.show(i, text):
      out.write(f"{prefix} {text}")
      out.flush()
  pipe.close()


def _signal_group(p, sig) -> None:
  try:
    os.killpg(p.pid, sig)
    if sig == signal.SIGTERM:  # a stopped (SIGSTOP) process only acts on SIGTERM once continued
      os.killpg(p.pid, signal.SIGCONT)
  except (ProcessLookupError, PermissionError):
    pass


def failure_line(first: tuple, procs, clues: _Clues, address: str, roles: Roles | None = None) -> str:
  """The launcher's line on the first failure (process, exit code), naming the cause the workers'
  output shows: an unknown task registered at the coordinator, a lost worker (when the first to fail
  exited with coord.EXIT_LOST), else just that process."""
  roles = roles or Roles(len(procs), False)
  worker, code = first
  failed = f"{roles.name(worker)} exited with {describe(code)}"
  if clues.intruder is not None:
    return (
      f"an unknown process registered at the coordinator {address} as task {clues.intruder} (not a "
      f"worker of this launcher: the coordination service is unauthenticated, any local user can "
      f"connect; README) and the service aborted the workers: {failed}"
    )
  named = clues.lost.get(worker, []) if code == coord.EXIT_LOST else []
  lost = [i for i in (roles.process(w) for w in named) if i is not None and i < len(procs)]
  if not lost:
    return failed
  states = ", ".join(
    f"{roles.name(i)} (still running: stalled)"
    if procs[i].poll() is None
    else f"{roles.name(i)} (exited with {describe(procs[i].returncode)})"
    for i in lost
  )
  many = len(lost) > 1
  return (
    f"{states} {'are' if many else 'is'} lost: {roles.name(worker)}'s "
    f"watchdog named {'them' if many else 'it'}, then {failed}"
  )


def _wait(procs, deadline: float, interrupted) -> None:
  """Until every process in `procs` has exited, the deadline passes, or `interrupted()`."""
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not interrupted():
    time.sleep(0.05)


def _stop(procs, grace_s: float, interrupted) -> None:
  """SIGTERM to workers 1..N-1, then to process 0 once they are gone (or half the grace period is
  up), SIGKILL to every process group still alive at the end of the grace period (or at once when
  `interrupted()`: a second signal)."""
  start = time.monotonic()
  peers, host = [p for p in procs[1:] if p.poll() is None], procs[:1]
  for p in peers:
    _signal_group(p, signal.SIGTERM)
  _wait(peers, start + grace_s / 2, interrupted)
  for p in host:
    if p.poll() is None:
      _signal_group(p, signal.SIGTERM)
  _wait(procs, start + grace_s, interrupted)
  for p in procs:
    if p.poll() is None:
      _signal_group(p, signal.SIGKILL)
  for p in procs:
    p.wait()


class _Signals:
  """SIGTERM/SIGINT/SIGHUP to the launcher, recorded for its loop (handlers need the main thread;
  elsewhere, e.g. launch() in a test's thread, nothing is installed)."""

  def __init__(self):
    self.got, self._old = [], {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in STOP_SIGNALS:
        self._old[s] = signal.signal(s, lambda signum, frame: self.got.append(signum))
    return self

  def __exit__(self, *exc):
    for s, old in self._old.items():
      signal.signal(s, old if old is not None else signal.SIG_DFL)


def usable_cores() -> int:
  """The CPU cores this process may run on (its affinity), else the machine's."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def check_args(
  num_processes: int, cpu_devices: int, grace_s: float, port: int, max_restarts: int = 0
) -> None:
  """ValueError, one line naming the flag and what is allowed, for launch()'s arguments that cannot run."""
  if max_restarts < 0:
    raise ValueError(f"--max_restarts={max_restarts} is not allowed: an integer >= 0")
  if num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} is not allowed: at least 1 process is needed")
  if cpu_devices < 1:
    raise ValueError(f"--cpu_devices={cpu_devices} is not allowed: at least 1 CPU device per process")
  if not (math.isfinite(grace_s) and grace_s >= 0):
    raise ValueError(f"--grace_s={grace_s} is not allowed: a finite number of seconds >= 0")
  if not 0 <= port <= 65535:
    raise ValueError(f"--port={port} is not allowed: 0 (a free one) or 1..65535")
  if port and (problem := coord.port_problem(f"127.0.0.1:{port}")):
    raise ValueError(
      f"--port={port} is not allowed: {port_refusal(port, problem)}; pick another, or 0 for a free one"
    )


def check_node(node: Node, port: int = 0) -> None:
  """ValueError, one line naming the flag and what is allowed, for a node that cannot run: --nnodes < 1,
  --node_rank outside 0..nnodes-1, several nodes without --coordinator_address (host:port: every node
  must reach node 0's coordinator), --port beside --coordinator_address, node 0's coordinator port
  taken on a loopback address."""
  if node.nnodes < 1:
    raise ValueError(f"--nnodes={node.nnodes} is not allowed: at least 1 node")
  if not 0 <= node.rank < node.nnodes:
    raise ValueError(f"--node_rank={node.rank} is not allowed: 0..{node.nnodes - 1} (--nnodes={node.nnodes})")
  if node.nnodes > 1 and not node.coordinator_address:
    raise ValueError(
      f"--nnodes={node.nnodes} needs --coordinator_address=HOST:PORT (node 0's address, which every node "
      "reaches, and a fixed port)"
    )
  if not node.coordinator_address:
    return
  if port:
    raise ValueError(f"--port={port} is not allowed with --coordinator_address: the address holds the port")
  if not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s]+):\d{1,5}", node.coordinator_address):
    raise ValueError(
      f"--coordinator_address={node.coordinator_address} is not allowed: HOST:PORT ([V6]:PORT for IPv6)"
    )
  host, number = addresses.split_address(node.coordinator_address)
  if not 1 <= number <= 65535:
    raise ValueError(f"--coordinator_address={node.coordinator_address} is not allowed: a port in 1..65535")
  bind = addresses.bind_address(node.coordinator_address)
  if node.rank == 0 and bind and (problem := coord.port_problem(bind)):  # node 0 binds it: free here?
    raise ValueError(
      f"--coordinator_address={node.coordinator_address} is not allowed: {os.strerror(problem)} on this "
      "node (node 0 hosts the coordinator there)"
    )


def devices_per_process(cpu_devices: int, max_restarts: int, elastic: bool) -> int:
  """The CPU devices each process gets: --cpu_devices, and in an elastic run at least one per life of
  a worker (max_restarts + 1): life i runs on local device i, so a restart connects on device ids no
  earlier life used (runtime/membership.py; docs/design.md 3.12)."""
  return max(cpu_devices, max_restarts + 1) if elastic else cpu_devices


def check_platform(num_processes: int, platform: str, elastic: bool = False) -> None:
  """ValueError, one line, for a GPU job that cannot run as asked: several workers on one GPU (NCCL
  refuses a communicator with two ranks on one device: "Duplicate GPU detected"), or an elastic run
  (it relies on a collective with a dead member failing as an exception, which the CPU's gloo does
  under jax_enable_recoverability; NCCL has no cancellation here, and elastic has never run on GPUs)."""
  if platform != "cuda":
    return
  if elastic:
    raise ValueError(
      "--config.runtime.elastic=True is not allowed on platform cuda: elastic membership needs a "
      "collective with a dead member to fail and be cancelled, which NCCL does not do here (it has run "
      "on the CPU's gloo only); --platform=cpu, or --max_restarts without elastic"
    )
  gpus = local_gpus()
  if gpus and num_processes > len(gpus):
    raise ValueError(
      f"--num_processes={num_processes} is not allowed on platform cuda: at most the {len(gpus)} GPUs "
      "this host shows, one per worker (several workers on one GPU: NCCL refuses two ranks of a "
      "communicator on one device, 'Duplicate GPU detected'); fewer workers, or --platform=cpu"
    )


def port_refusal(port: int, problem: int) -> str:
  """Why 127.0.0.1:port cannot be bound, from coord.port_problem's errno."""
  if problem == errno.EADDRINUSE:
    return f"127.0.0.1:{port} is taken (a process listens there)"
  if problem == errno.EACCES:  # Linux: below net.ipv4.ip_unprivileged_port_start (1024)
    return (
      f"127.0.0.1:{port} cannot be bound: {os.strerror(problem)} (a privileged port: it needs root "
      f"or CAP_NET_BIND_SERVICE)"
    )
  return f"127.0.0.1:{port} cannot be bound: {os.strerror(problem)}"


def resolve_module(module: str) -> str:
  """The entry point to run: `experiments.X` outside a checkout (no top-level `experiments` package to
  import) is the installed package's `ripples_jax.experiments.X`, which ships the same entry points."""
  if module.startswith("experiments.") and importlib.util.find_spec("experiments") is None:
    shipped = f"ripples_jax.{module}"
    try:
      if importlib.util.find_spec(shipped) is not None:
        return shipped
    except ModuleNotFoundError:  # no ripples_jax.experiments either: the module's own error will say
      pass
  return module


def start_worker(
  i: int,
  n: int,
  module: str,
  args,
  address: str,
  cpu_devices: int = 1,
  platform: str = "cpu",
  cwd=None,
  launched: bool = True,
  text: bool = False,
  coordinator: bool = False,
  restart: int = 0,
  gpu: int | None = None,
  collectives_host: str = "",
  malloc: str = "default",
  secret: str = "",
):
  """Process i of n: `python -m module args` with the coordinator flags, in a session of its own (the
  launcher, not the terminal, decides when a worker dies); stdout and stderr in one pipe (bytes, or
  str with `text`). launched=False: a process on its own, as on a cluster (no launcher whose death it
  follows). coordinator=True: process 0 is an async run's coordinator, process i worker i - 1. gpu: its
  index among this host's workers (default: its worker id); collectives_host: where its gloo listeners
  bind (a node's address; '' : addresses.collectives_host's rule); secret: the run's (auth.py), in
  its environment with the run id (the coordinator's address); '': values bare."""
  cmd = [
    sys.executable,
    "-m",
    module,
    *args,
    "--jax_distributed",
    f"--coordinator_address={address}",
    f"--num_processes={n}",
    f"--process_id={i}",
    f"--cpu_devices={cpu_devices}",
  ]
  gpu = max(i - int(coordinator), 0) if gpu is None else gpu
  env = child_env(cpu_devices, platform, gpu, coordinator and i == 0, malloc)
  if collectives_host:
    env[addresses.COLLECTIVES_HOST_ENV] = collectives_host
  if secret:
    env[auth.SECRET_ENV], env[auth.RUN_ID_ENV] = secret, address
  if not launched:
    env.pop(coord.LAUNCHER_PID_ENV, None)
  if restart:
    env[RESTART_ENV] = str(restart)
  return subprocess.Popen(
    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, text=text
  )


def _watch(procs, threads, signals, clues, address: str, grace_s: float, out, roles=None):
  """Polls every child every 0.1 s until all succeed, one fails ((worker, code): named in one line) or
  a signal arrives; returns the first failure or None."""
  while not signals.got:
    codes = [p.poll() for p in procs]  # every child, every time
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      threads[failed[0][0]].join(timeout=2)  # its last lines (why it failed) read to the end
      out.write(
        f"[launch] {failure_line(failed[0], procs, clues, address, roles)}; stopping the others "
        f"(SIGTERM, SIGKILL after {grace_s:.0f} s)\n"
      )
      return failed[0]
    if None not in codes:
      return None
    time.sleep(0.1)
  return None


class _Elastic:
  """An elastic run's policy (runtime.elastic): a worker that exits non-zero is restarted alone, under
  its process id, up to max_restarts times (it rejoins; runtime/membership.py), and otherwise left
  out: the others go on. Only the coordinator's failure stops the job. A worker the run refused
  (coord.EXIT_REFUSED) or that was given bad input (2) is not restarted; one whose disk refused a
  write (coord.EXIT_STORAGE) stops every process (the job ends 74)."""

  def __init__(self, max_restarts: int, start, out, roles: Roles, grace_s: float):
    self.max_restarts, self.start, self.out, self.roles = max_restarts, start, out, roles
    self.grace_s = grace_s
    self.restarts, self.left = {}, set()

  def watch(self, procs, threads, signals, clues, address: str):
    """Polls every child every 0.1 s until the coordinator exits (on a node without it: until every
    worker of this node has ended or been left out); returns (0, code) on its failure, or None. On a
    node without the coordinator, a worker that lost the coordination service ends the node's run:
    (i, its code) (the coordinator's death; docs/design.md 3.12 says why no node restarts it)."""
    hosts = self.roles.hosts_coordinator
    while not signals.got:
      code0 = procs[0].poll() if hosts else None
      if code0 not in (None, 0):
        threads[0].join(timeout=2)
        self.out.write(
          f"[launch] {failure_line((0, code0), procs, clues, address, self.roles)}; stopping the others\n"
        )
        return (0, code0)
      for i in range(int(hosts), len(procs)):
        code = procs[i].poll()
        if code in (None, 0) or i in self.left:
          continue
        threads[i].join(timeout=2)
        if code == coord.EXIT_STORAGE:  # the disk is full for every process of the run: stop them all
          self.out.write(
            f"[launch] {self.roles.name(i)} exited with {describe(code)}; stopping every process\n"
          )
          return (i, code)
        if not hosts and coord.COORDINATOR in clues.lost.get(i, ()):
          self.out.write(
            f"[launch] {self.roles.name(i)} lost the coordinator (node 0): the run cannot go on here; "
            "stopping this node's workers (rerun every node's command to resume from the newest marker)\n"
          )
          return (i, code)
        self._failed(i, code, procs, threads)
      if code0 == 0:  # the run is over: the live workers follow it out (the rest are stopped)
        _wait(procs, time.monotonic() + self.grace_s, lambda: bool(signals.got))
        return None
      if not hosts and all(p.poll() is not None for p in procs):  # each ended, or was left out
        return None
      time.sleep(0.1)
    return None

  def _failed(self, i: int, code: int, procs, threads) -> None:
    name, done = self.roles.name(i), self.restarts.get(i, 0)
    if done < self.max_restarts and code not in (coord.EXIT_REFUSED, 2):
      self.restarts[i] = done + 1
      self.out.write(
        f"[launch] {name} exited with {describe(code)}; restarting it ({done + 1} of {self.max_restarts}): "
        f"it rejoins the run\n"
      )
      procs[i], threads[i] = self.start(i, done + 1)
      return
    self.left.add(i)
    self.out.write(f"[launch] {name} exited with {describe(code)}; the run goes on without it\n")
    self.out.flush()


def launch(
  num_processes: int,
  args: list[str],
  module: str = "experiments.train",
  cpu_devices: int = 1,
  platform: str = "auto",
  grace_s: float = 30.0,
  out=None,
  on_start=None,
  cwd=None,
  port: int = 0,
  coordinator: bool = False,
  max_restarts: int = 0,
  elastic: bool = False,
  node: Node | None = None,
  malloc: str = "default",
  secret_file: str = "",
) -> int:
  """Runs `python -m module args --jax_distributed ...` N times (N + 1 with `coordinator`: an
  executor=async run's process 0, which trains nothing); returns the first non-zero exit code (a
  signal's -k as 128 + k), 128 + k after signal k to the launcher, 0 when every process succeeds.

  max_restarts (torchrun's name): with `elastic` (runtime.elastic) a failed worker is restarted alone
  and rejoins while the others go on (_Elastic; the exit code is the coordinator's), and every process
  gets at least max_restarts + 1 CPU devices (a worker's life i runs on its device i); the coordinator's
  death (coordinator_died) restarts every process. Otherwise every process is stopped and the whole job
  started again, resuming from the newest checkpoint (torchrun's elastic restart). Either restart of
  the whole job happens up to max_restarts times. malloc: "default" or "tuned" (child_env).

  node (Node): one node of a multi-node job; this launcher starts the node's workers (and on node 0 the
  coordinator) and restarts its own. An elastic node's restarted worker rejoins the run like any other;
  a worker that lost the coordinator ends its node's run (rerun every node's command to resume; node 0
  does not restart the coordinator when the job spans nodes: docs/design.md 3.12).

  Raises ValueError, before starting anything, for arguments that cannot run (check_args): fewer than
  1 process or CPU device, a negative or non-finite grace period, a port outside 0..65535 or one that
  cannot be bound, a negative max_restarts; on cuda, more workers than GPUs or an elastic run
  (check_platform); a job over several nodes without one run secret (auth.run_secret: every value its
  processes write carries a MAC under it; one node makes a fresh one, secret_file names a shared one).
  """
  node = node or Node()
  if malloc not in MALLOC:
    raise ValueError(f"--malloc={malloc} is not allowed: one of {', '.join(MALLOC)}")
  check_args(num_processes, cpu_devices, grace_s, port, max_restarts)
  check_node(node, port)
  check_platform(num_processes, resolve_platform(platform), elastic)
  secret = auth.run_secret(node.nnodes, secret_file)  # one for every start of the job
  cpu_devices = devices_per_process(cpu_devices, max_restarts, elastic)
  kw = dict(module=module, cpu_devices=cpu_devices, platform=platform, grace_s=grace_s, out=out, cwd=cwd)
  kw.update(port=port, coordinator=coordinator, elastic=elastic, node=node, malloc=malloc, secret=secret)
  attempt = 0
  while True:
    code, signalled = _launch_once(num_processes, args, on_start, max_restarts, attempt, **kw)
    if code == coord.EXIT_STORAGE:
      (out or sys.stdout).write(f"[launch] the disk refused a write: nothing restarted; {STORAGE_LINE}\n")
      return code
    if signalled or code in (0, 2) or attempt >= max_restarts or (elastic and not coordinator_died(code)):
      return code
    if elastic and node.nnodes > 1:  # no node restarts the coordinator alone (launch()'s docstring)
      return code
    attempt += 1
    who = "the coordinator died: " if elastic else ""
    (out or sys.stdout).write(
      f"[launch] {who}restarting every process ({attempt} of {max_restarts}): they resume from the "
      "newest checkpoint\n"
    )


def coordinator_died(code: int) -> bool:
  """Whether an elastic run's exit code (the coordinator's) is its death rather than its verdict. An
  elastic worker is restarted alone, but the coordinator hosts the coordination service, which no
  process can rejoin once it is gone (docs/design.md 3.8): its death is survived by restarting every
  process from the newest marker, the run's last consistent cut. Its own verdicts are not: a lost run
  (coord.EXIT_LOST: every worker gone with no life left, no progress, a stuck collective) says why and
  is resumed by hand, and a refusal or bad input (coord.EXIT_REFUSED, 2) would only recur."""
  return code not in (0, 2, coord.EXIT_LOST, coord.EXIT_REFUSED, coord.EXIT_STORAGE)


def _launch_once(
  num_processes: int,
  args: list[str],
  on_start,
  max_restarts: int,
  attempt: int,
  module: str,
  cpu_devices: int,
  platform: str,
  grace_s: float,
  out,
  cwd,
  port: int,
  coordinator: bool,
  elastic: bool,
  node: Node,
  malloc: str = "default",
  secret: str = "",
) -> tuple[int, bool]:
  """One start of the job (launch()'s docstring); returns (its exit code, whether a signal ended it)."""
  out = out or sys.stdout
  _warn_oversubscribed(num_processes, out)
  address = node.coordinator_address or f"127.0.0.1:{port or free_port()}"
  platform, module = resolve_platform(platform), resolve_module(module)
  procs, threads, clues = [], [], _Clues()
  roles = Roles(num_processes, coordinator, node)
  shown = _LibraryLines(any(VERBOSE_FLAG.match(a) for a in args))
  first = None  # (worker, exit code) of the first failure

  def start(i: int, restart: int = 0):
    p = start_worker(
      roles.process_id(i),
      roles.total,
      module,
      args,
      address,
      cpu_devices,
      platform,
      cwd,
      coordinator=coordinator,
      restart=restart,
      gpu=max(roles.local_worker(i), 0),
      collectives_host=node.address,
      malloc=malloc,
      secret=secret,
    )
    t = threading.Thread(target=_stream, args=(i, p.stdout, out, clues, shown, roles.prefix(i)), daemon=True)
    t.start()
    return p, t

  with _Signals() as signals:
    try:
      _start_all(start, attempt, procs, threads, signals, roles)
      out.write(f"[launch] {_who(roles)} on {address} ({platform}), pids {[p.pid for p in procs]}\n")
      out.flush()
      if on_start and not signals.got:
        on_start([p.pid for p in procs])
      restarter = _Elastic(max_restarts, start, out, roles, grace_s) if elastic and coordinator else None
      first = _supervise(procs, threads, signals, clues, address, roles, out, grace_s, restarter)
    finally:  # whatever happened above, no worker outlives launch()
      seen = len(signals.got)
      _stop(procs, grace_s, lambda: len(signals.got) > seen)
  codes = _report_exits(procs, threads, shown, roles, out)
  return _exit_code(first, signals.got, codes, elastic and roles.hosts_coordinator)


def _warn_oversubscribed(num_processes: int, out) -> None:
  """Warns, and goes on, when the processes outnumber the CPU cores this launcher may use."""
  if num_processes > (cores := usable_cores()):
    out.write(
      f"[launch] warning: --num_processes={num_processes} exceeds the {cores} CPU core"
      f"{'s' if cores > 1 else ''} this launcher may use: the workers share them (each runs slower); "
      f"running anyway\n"
    )


def _start_all(start, attempt: int, procs: list, threads: list, signals, roles: Roles) -> None:
  """Starts process 0, 1, ... in turn until all run or a signal arrives; each is appended to procs
  and threads as soon as it starts, so that the caller's _stop reaches it whatever happens next."""
  for i in range(roles.local):
    if signals.got:
      break
    p, t = start(i, attempt)
    procs.append(p)
    threads.append(t)


def _who(roles: Roles) -> str:
  """The processes started, in words: "N workers", and "and a coordinator" where there is one."""
  who = f"{roles.n} workers and a coordinator" if roles.hosts_coordinator else f"{roles.n} workers"
  if roles.node.nnodes > 1:
    first = roles.worker(int(roles.hosts_coordinator))
    who += f" (workers {first}..{first + roles.n - 1}; node {roles.node.rank} of {roles.node.nnodes})"
  return who


def _supervise(procs, threads, signals, clues, address: str, roles: Roles, out, grace_s: float, restarter):
  """Watches the processes until the run ends, one fails or a signal arrives; returns the first
  failure, (process, exit code), or None. With a `restarter` (_Elastic: an elastic run with a
  coordinator) a failed worker is restarted or left out instead of failing the run."""
  if restarter is not None:
    first = restarter.watch(procs, threads, signals, clues, address)
  else:
    first = _watch(procs, threads, signals, clues, address, grace_s, out, roles)
  if signals.got and not first:
    out.write(
      f"[launch] received {signal.Signals(signals.got[0]).name}; stopping the workers "
      f"(SIGTERM, SIGKILL after {grace_s:.0f} s)\n"
    )
  out.flush()
  return first


def _report_exits(procs, threads, shown: _LibraryLines, roles: Roles, out) -> list:
  """The stopped processes' exit codes, after their output (each stream's thread is given 5 s to
  finish) and a count of the library lines hidden; the codes are printed too."""
  for t in threads:
    t.join(timeout=5)
  codes = [p.returncode for p in procs]
  if shown.hidden:
    out.write(f"[launch] {shown.hidden} more gloo connection lines hidden (--verbose_libraries shows them)\n")
  out.write(f"[launch] exit codes: {roles.codes(codes)}\n")
  out.flush()
  return codes


def _exit_code(first, got: list, codes: list, by_coordinator: bool) -> tuple[int, bool]:
  """(the job's exit code, whether a signal ended it): the first failure's code, else 128 + the first
  signal to the launcher, else the coordinator's (`by_coordinator`: an elastic run, where the others
  may have died) or the first non-zero code, else 0."""
  if first:
    code = first[1]
  elif got:
    return 128 + got[0], True
  elif by_coordinator:
    code = codes[0]
  else:
    code = next((c for c in codes if c), 0)
  # A signal's negative return code becomes the shell's 128 + signal.
  return (128 - code if code < 0 else code), bool(got)

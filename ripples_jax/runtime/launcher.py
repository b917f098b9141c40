"""Starts N local worker processes on 127.0.0.1, streams their logs with a worker prefix, fails fast.

Every child is polled every 0.1 s. The first to exit non-zero fails the job: one line names it and its
exit code, the others are stopped, and launch() returns that code. Stopping: SIGTERM to workers
1..N-1 first and to process 0 once they are gone (it hosts the coordination service: when it goes
first, its peers' JAX clients abort before they can say why), bounded by the grace period, then
SIGKILL to each remaining child's whole process group. A SIGTERM, SIGINT or SIGHUP to the launcher
does the same (returning 128 + the signal; a second one skips the grace period), and the workers get
SIGTERM from the kernel if the launcher itself is killed (coord.SigtermStop). A worker answers SIGTERM
with one line and exit code coord.EXIT_TERM (143).

The coordinator is 127.0.0.1:<port>, a free port unless one is given; process 0's coordination service
binds that loopback address only (platform.init_distributed).
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from ripples_jax.runtime import coord

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MEANING = {coord.EXIT_LOST: "it lost a peer", coord.EXIT_TERM: "it was stopped by SIGTERM"}


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


def child_env(cpu_devices: int, platform: str, index: int = 0) -> dict:
  """The environment of worker `index`: forced CPU devices, JAX_PLATFORMS, and on cuda one GPU each
  (worker i sees GPU i mod the host's GPU count: several workers may share one when there are fewer)."""
  env = dict(os.environ)
  if platform == "cuda":
    gpus = local_gpus()
    if gpus:
      env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
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


def _stream(i: int, pipe, out) -> None:
  for line in iter(pipe.readline, b""):
    out.write(f"[w{i}] {line.decode(errors='replace')}")
    out.flush()
  pipe.close()


def _signal_group(p, sig) -> None:
  try:
    os.killpg(p.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


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


def launch(num_processes: int, args: list[str], module: str = "experiments.train", cpu_devices: int = 1,
           platform: str = "auto", grace_s: float = 30.0, out=None, on_start=None, cwd=None,
           port: int = 0) -> int:
  """Runs `python -m module args --jax_distributed ...` N times; returns the first non-zero exit code
  (a signal's -k as 128 + k), 128 + k after signal k to the launcher, 0 when every worker succeeds.

  Raises ValueError, before starting anything, for num_processes < 1 or a `port` that is taken.
  """
  if num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} is not allowed: at least 1 process is needed")
  if port and coord.port_problem(f"127.0.0.1:{port}"):
    raise ValueError(f"--port={port} is not allowed: 127.0.0.1:{port} is taken (a process listens there); "
                     f"pick another, or 0 for a free one")
  out = out or sys.stdout
  address = f"127.0.0.1:{port or free_port()}"
  platform = resolve_platform(platform)
  procs, threads = [], []
  first = None  # (worker, exit code) of the first failure
  with _Signals() as signals:
    try:
      for i in range(num_processes):
        if signals.got:
          break
        cmd = [sys.executable, "-m", module, *args, "--jax_distributed", f"--coordinator_address={address}",
               f"--num_processes={num_processes}", f"--process_id={i}", f"--cpu_devices={cpu_devices}"]
        # A session of its own: the launcher, not the terminal, decides when a worker dies.
        p = subprocess.Popen(cmd, env=child_env(cpu_devices, platform, i), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=cwd)
        procs.append(p)
        t = threading.Thread(target=_stream, args=(i, p.stdout, out), daemon=True)
        t.start()
        threads.append(t)
      out.write(f"[launch] {num_processes} workers on {address} ({platform}), pids {[p.pid for p in procs]}\n")
      out.flush()
      if on_start and not signals.got:
        on_start([p.pid for p in procs])
      while not signals.got:
        codes = [p.poll() for p in procs]  # every child, every time
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
          first = failed[0]
          out.write(f"[launch] worker {first[0]} exited with {describe(first[1])}; stopping the others "
                    f"(SIGTERM, SIGKILL after {grace_s:.0f} s)\n")
          break
        if None not in codes:
          break
        time.sleep(0.1)
      if signals.got and not first:
        out.write(f"[launch] received {signal.Signals(signals.got[0]).name}; stopping the workers "
                  f"(SIGTERM, SIGKILL after {grace_s:.0f} s)\n")
      out.flush()
    finally:  # whatever happened above, no worker outlives launch()
      seen = len(signals.got)
      _stop(procs, grace_s, lambda: len(signals.got) > seen)
  for t in threads:
    t.join(timeout=5)
  codes = [p.returncode for p in procs]
  out.write(f"[launch] exit codes: {codes}\n")
  out.flush()
  if first:
    code = first[1]
  elif signals.got:
    return 128 + signals.got[0]
  else:
    code = next((c for c in codes if c), 0)
  # A signal's negative return code becomes the shell's 128 + signal.
  return 128 - code if code < 0 else code

"""Starts N local worker processes on 127.0.0.1, streams their logs with a worker prefix, fails fast.

The first child to exit non-zero fails the job: the others are asked to stop (SIGTERM, which JAX
catches, so a grace period follows) and then killed (SIGKILL, to each child's whole process group), so
no orphan is left waiting in a collective. The same happens on Ctrl-C. The peers' own watchdogs
usually exit first, naming the lost worker. Returns the first non-zero exit code (0 when all succeed).
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(cpu_devices: int, platform: str) -> dict:
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
  if platform:
    env["JAX_PLATFORMS"] = platform
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _stream(i: int, pipe, out) -> None:
  for line in iter(pipe.readline, b""):
    out.write(f"[w{i}] {line.decode(errors='replace')}")
    out.flush()
  pipe.close()


def _kill(procs, grace_s: float) -> None:
  live = [p for p in procs if p.poll() is None]
  for p in live:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and any(p.poll() is None for p in live):
    time.sleep(0.1)
  for p in live:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for p in procs:
    p.wait()


def launch(num_processes: int, args: list[str], module: str = "experiments.train", cpu_devices: int = 1,
           platform: str = "cpu", grace_s: float = 30.0, out=None, on_start=None, cwd=None) -> int:
  """Runs `python -m module args --jax_distributed ...` N times; returns the first non-zero exit code."""
  out = out or sys.stdout
  address = f"127.0.0.1:{free_port()}"
  env = child_env(cpu_devices, platform)
  procs, threads = [], []
  try:
    for i in range(num_processes):
      cmd = [sys.executable, "-m", module, *args, "--jax_distributed", f"--coordinator_address={address}",
             f"--num_processes={num_processes}", f"--process_id={i}", f"--cpu_devices={cpu_devices}"]
      # A session of its own: the launcher, not the terminal, decides when a worker dies.
      p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True, cwd=cwd)
      procs.append(p)
      t = threading.Thread(target=_stream, args=(i, p.stdout, out), daemon=True)
      t.start()
      threads.append(t)
    out.write(f"[launch] {num_processes} workers on {address}, pids {[p.pid for p in procs]}\n")
    out.flush()
    if on_start:
      on_start([p.pid for p in procs])
    first = 0
    while any(p.poll() is None for p in procs):
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed:
        first = failed[0]
        out.write(f"[launch] a worker exited with {first}; stopping the others "
                  f"(SIGKILL after {grace_s:.0f} s)\n")
        _kill(procs, grace_s)
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    out.write("[launch] interrupted; stopping the workers\n")
    _kill(procs, min(grace_s, 5.0))
    first = 130
  for t in threads:
    t.join(timeout=5)
  codes = [p.returncode for p in procs]
  if not first:
    first = next((c for c in codes if c), 0)
  out.write(f"[launch] exit codes: {codes}\n")
  # A signal's negative return code becomes the shell's 128 + signal.
  return 128 - first if first < 0 else first

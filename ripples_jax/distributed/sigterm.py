"""SIGTERM's stop: one exit line, and no worker outliving the local launcher.

SIGTERM (the launcher stopping the job, a scheduler's cancel or preemption) takes the same path
(SigtermStop): one line naming why and each worker's last completed step, exit code EXIT_TERM. JAX's
own SIGTERM handler (its preemption service) only logs the signal and keeps running, so
host.init_distributed turns that service off.
"""

import ctypes
import os
import signal
import sys
import threading

from ripples_jax.distributed.roles import EXIT_TERM
from ripples_jax.distributed.watchdog import _say

LAUNCHER_PID_ENV = "RIPPLES_LAUNCHER_PID"  # set by the local launcher: its workers stop when it dies


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

"""Fault injection at a fixed point of a run (runtime.fail_worker/fail_step, fail_stage/fail_tick):
the kill lands after a checkpoint this process has really saved."""

import os
import signal

import jax
from absl import logging

from ripples_jax import checkpoint as ckpt_lib
from ripples_jax.runlog import RunLog


def fail_now(log: RunLog, saved, step: int, who: int | None = None) -> None:
  """Fault injection (runtime.fail_worker/fail_step): SIGKILL this process at a fixed point of the run.

  Drains the saver thread first, so the kill always lands after a checkpoint this worker has really
  saved, whatever the write's speed. Only then is the manager read here: the saver thread's orbax
  manager deletes old steps (max_to_keep) while it saves, and a concurrent listing from this thread
  could read a step folder that is being deleted.
  """
  if log.mgr is not None:
    log.wait()
    if saved is not None and saved not in ckpt_lib.restorable_steps(log.mgr):
      raise RuntimeError(f"runtime.fail_worker: checkpoint {saved} was not committed before the kill")
  who = jax.process_index() if who is None else who  # a worker's index (an async run's), else the process's
  logging.warning("runtime.fail_worker: worker %d kills itself at local step %d", who, step)
  os.kill(os.getpid(), signal.SIGKILL)

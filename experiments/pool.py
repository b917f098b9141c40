"""One process per core for independent runs: a spawn pool whose workers each pin themselves to a core.

Spawned, not forked: each worker starts a fresh jax (no forked XLA threads). Pinned: two runs never
share a core, so each run's own timings (if it takes any) are not each other's noise."""

import concurrent.futures
import multiprocessing
import os

from ripples_jax.distributed.host import quiet_library_logs


def _pin(cores) -> None:
  """A worker's initializer: one core of its own, taken from the queue."""
  os.sched_setaffinity(0, {cores.get()})
  quiet_library_logs()


def pinned_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
  """`workers` processes, worker i on core i (mod the cores this process may use)."""
  ctx = multiprocessing.get_context("spawn")
  cores = ctx.Queue()
  mine = sorted(os.sched_getaffinity(0))
  for i in range(workers):
    cores.put(mine[i % len(mine)])
  return concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_pin, initargs=(cores,))

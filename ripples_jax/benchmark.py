"""Side-by-side timing on a noisy shared machine: interleave the variants, report medians and ratios."""
import time
from typing import Callable

import jax
import numpy as np


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int = 30, warmup: int = 2) -> dict:
  """Median seconds per call of each zero-argument fn, measured round-robin so drift hits all alike.

  Each fn must return jax values; the call is timed up to block_until_ready.
  """
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t)
  return {k: float(np.median(v)) for k, v in times.items()}


def compile_seconds(jitted, *args) -> float:
  """Wall time to lower and compile `jitted` for these arguments (the cache is bypassed by lowering)."""
  t = time.perf_counter()
  jitted.lower(*args).compile()
  return time.perf_counter() - t


def markdown_table(header: list[str], rows: list[list]) -> str:
  fmt = lambda r: "| " + " | ".join(str(c) for c in r) + " |"
  return "\n".join([fmt(header), fmt(["---"] * len(header))] + [fmt(r) for r in rows])

"""Side-by-side timing on a noisy shared machine: interleave the variants, report medians and ratios."""

import json
import os
import time

import numpy as np

from ripples_jax.pipeline.timing import time_interleaved  # noqa: F401  (one definition, shared)
from ripples_jax.tables import Table, markdown_table, write_table  # noqa: F401  (the benchmarks' tables)


def compile_seconds(jitted, *args) -> float:
  """Wall time to lower and compile `jitted` for these arguments (the cache is bypassed by lowering)."""
  t = time.perf_counter()
  jitted.lower(*args).compile()
  return time.perf_counter() - t


def print_json(result, path: str = "") -> None:
  """Prints a benchmark's figures as JSON and, given a path, writes the same text there (arrays as lists)."""
  text = json.dumps(result, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
  print(text)
  if path:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
      f.write(text + "\n")


def spread(values) -> dict:
  """The median and range of repeated measurements (a benchmark's rows carry them, never one figure)."""
  v = np.asarray(values, np.float64)
  return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}


def fmt_spread(d: dict, scale: float = 1.0, spec: str = ".2f") -> str:
  """A spread as "median [min, max]", each times `scale`."""
  return f"{scale * d['median']:{spec}} [{scale * d['min']:{spec}}, {scale * d['max']:{spec}}]"

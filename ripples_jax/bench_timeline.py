"""Events per second of the clock and the Group Generators alone (no numerics)."""
import time

import numpy as np

from ripples_jax import sim, timeline
from ripples_jax.benchmark import markdown_table
from ripples_jax.schedule import ALGORITHMS


def run(config_fn, workers: list[int], steps: int) -> str:
  """config_fn(algorithm, n) -> a sim config; times timeline.simulate and pack_rounds per algorithm."""
  rows = []
  for n in workers:
    for algorithm in ALGORITHMS:
      config = config_fn(algorithm, n)
      speed, net = sim.build_clock(config, model_bytes=4.8e4, base_time=0.01)
      gg = sim.make_group_generator(config, np.random.default_rng(0))
      t = time.perf_counter()
      trace = timeline.simulate(algorithm, speed, net, steps * n, gg=gg)
      dt = time.perf_counter() - t
      t = time.perf_counter()
      rounds = sum(1 for _ in timeline.pack_rounds(trace.events, n, n + 1))
      dp = time.perf_counter() - t
      rows.append([n, algorithm, len(trace.events), f"{len(trace.events) / dt:,.0f}", rounds,
                   f"{len(trace.events) / dp:,.0f}"])
  header = ["workers", "algorithm", "events", "clock events/s", "engine rounds", "packing events/s"]
  return markdown_table(header, rows)

r"""Throughput of the clock and schedulers alone (no numerics): events per second per algorithm.

  python -m benchmarks.bench_timeline      # 16 and 256 workers, one worker 5x slower, 5% jitter

Times timeline.simulate and pack_rounds per algorithm. Target: at least 100,000 events/s for every
algorithm.
"""

import time

import numpy as np
from absl import app, flags

from benchmarks.timing import Table, write_table
from configs import default as default_config
from ripples_jax import sim, timeline
from ripples_jax.algorithms import names

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_list("workers", ["16", "256"], "Worker counts.")
  flags.DEFINE_integer("steps", 2000, "Steps per worker.")
  flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def make_config(algorithm, n):
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.hetero.slow_workers, config.hetero.slowdown, config.hetero.jitter = (3,), 5.0, 0.05
  return config


def run(workers=(16, 256), steps: int = 2000, config_fn=make_config) -> Table:
  """config_fn(algorithm, n) -> a sim config; one row per (worker count, algorithm)."""
  rows = []
  for n in workers:
    for algorithm in names():
      config = config_fn(algorithm, n)
      speed, net = sim.build_clock(config, model_bytes=4.8e4, base_time=0.01)
      gg = sim.make_group_generator(config, np.random.default_rng(0))
      t = time.perf_counter()
      trace = timeline.simulate(timeline.ClockSpec(algorithm, speed, net, steps * n, gg=gg))
      dt = time.perf_counter() - t
      t = time.perf_counter()
      rounds = sum(1 for _ in timeline.pack_rounds(trace.events, n, n + 1))
      dp = time.perf_counter() - t
      rows.append(
        [
          n,
          algorithm,
          len(trace.events),
          f"{len(trace.events) / dt:,.0f}",
          rounds,
          f"{len(trace.events) / dp:,.0f}",
        ]
      )
  header = ["workers", "algorithm", "events", "clock events/s", "engine rounds", "packing events/s"]
  return Table(header, rows)


def main(argv):
  del argv
  write_table(run([int(w) for w in FLAGS.workers], FLAGS.steps), FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)

r"""Throughput of the clock and schedulers alone (no numerics): events per second per algorithm.

  python -m experiments.bench_timeline      # 16 and 256 workers, one worker 5x slower, 5% jitter

Target: at least 100,000 events/s for every algorithm.
"""
from absl import app, flags

from configs import default as default_config
from ripples_jax.bench_timeline import run
from ripples_jax.platform import write_table

_WORKERS = flags.DEFINE_list("workers", ["16", "256"], "Worker counts.")
_STEPS = flags.DEFINE_integer("steps", 2000, "Steps per worker.")
_OUT = flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def make_config(algorithm, n):
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.hetero.slow_workers, config.hetero.slowdown, config.hetero.jitter = (3,), 5.0, 0.05
  return config


def main(argv):
  del argv
  write_table(run(make_config, [int(w) for w in _WORKERS.value], _STEPS.value), _OUT.value)


if __name__ == "__main__":
  app.run(main)

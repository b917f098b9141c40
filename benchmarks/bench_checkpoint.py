r"""Checkpoint overhead of the default run at the default interval (target: under 5% of run time).

  python -m benchmarks.bench_checkpoint --reps=2

The same run with and without checkpoints, interleaved. Each variant runs in a fresh folder (so no run
resumes another); the runs alternate, off then on, and the ratio of the median wall times is reported.
Only the training loop is timed (data generation is cached after the first run).
"""

import copy
import shutil
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks.timing import Table, write_table
from configs import default as default_config
from ripples_jax import run as run_lib
from ripples_jax.distributed.host import use_cpu_devices

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer("reps", 2, "Runs per variant (interleaved).")
  flags.DEFINE_integer("steps", 0, "num_steps (0: the default run's).")
  flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def run(reps: int = 2, steps: int = 0, config=None, train_fn=None) -> Table:
  """config: default configs/default.py (with steps: num_steps=steps, checkpoint_every=steps // 4);
  train_fn(config, workdir): default ripples_jax.run.train_and_evaluate. One row."""
  if config is None:
    config = default_config.get_config()
    if steps:
      config.num_steps = steps
      config.checkpoint_every = max(1, steps // 4)
  train_fn = train_fn or run_lib.train_and_evaluate
  times = {"off": [], "on": []}
  every = config.checkpoint_every
  saves = config.num_steps // every + bool(config.num_steps % every) if every else 0  # the last at the end
  for _ in range(reps):
    for variant in ("off", "on"):
      c = copy.deepcopy(config)
      c.unlock()
      if variant == "off":
        c.checkpoint_every = 0
      workdir = tempfile.mkdtemp(prefix=f"ckpt_{variant}_")
      try:
        t = time.perf_counter()
        train_fn(c, workdir)
        times[variant].append(time.perf_counter() - t)
      finally:
        shutil.rmtree(workdir, ignore_errors=True)
  off, on = np.median(times["off"]), np.median(times["on"])
  rows = [
    [
      config.algorithm,
      config.executor,
      config.num_steps,
      config.checkpoint_every,
      saves,
      f"{off:.1f}",
      f"{on:.1f}",
      f"{100 * (on / off - 1):+.1f}%",
    ]
  ]
  return Table(
    [
      "algorithm",
      "executor",
      "steps",
      "checkpoint_every",
      "checkpoints",
      "off s (median)",
      "on s (median)",
      "overhead",
    ],
    rows,
  )


def main(argv):
  del argv
  use_cpu_devices(8)
  write_table(run(FLAGS.reps, FLAGS.steps), FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)

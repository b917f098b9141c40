"""Checkpoint overhead of a training run: the same run with and without checkpoints, interleaved.

Each variant runs in a fresh folder (so no run resumes another); the runs alternate, off then on, and
the ratio of the median wall times is reported. Only the training loop is timed (data generation is
cached after the first run).
"""
import copy
import shutil
import tempfile
import time

import numpy as np

from ripples_jax.benchmark import markdown_table


def run(config, reps: int = 2, train_fn=None) -> str:
  if train_fn is None:
    from ripples_jax.train import train_and_evaluate as train_fn
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
  rows = [[config.algorithm, config.executor, config.num_steps, config.checkpoint_every, saves,
           f"{off:.1f}", f"{on:.1f}", f"{100 * (on / off - 1):+.1f}%"]]
  return markdown_table(["algorithm", "executor", "steps", "checkpoint_every", "checkpoints", "off s (median)",
                         "on s (median)", "overhead"], rows)

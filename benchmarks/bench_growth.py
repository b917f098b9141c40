r"""Bounded state over a long run: the coordination store's key count, the coordinator's memory and
open files, sampled every 5 s by the coordinator itself (growth.jsonl, runtime/coordinator.py).

  python -m benchmarks.bench_growth --out=results/growth        # ~6 minutes on 2 cores

AD-PSGD and the asynchronous parameter server on 4 worker processes (MLP, MNIST-1D, unpadded steps),
--steps steps per worker: the two algorithms whose every step writes a key (a channel word per
exchange or push). Before consumed keys were deleted the store grew by one key per exchange; now a
channel's reader deletes each word once it has taken it (kvstore.values_in_order(consume=True)), and
the key count stays O(workers). Flat means: the last sample's key count within --slack_keys of the
first one taken after the start, and the coordinator's RSS within --slack_rss of it (fractional).
Every run's growth.jsonl is kept under --out/<algorithm>/.
"""

import json
import os
import shutil
import time

from absl import app, flags

from benchmarks.timing import Table
from ripples_jax.distributed.launcher import launch

FLAGS = flags.FLAGS
ALGORITHMS = ("adpsgd", "ps_async")


def define_flags() -> None:
  flags.DEFINE_string("out", "results/growth", "Output folder.")
  flags.DEFINE_list("algorithms", list(ALGORITHMS), "Algorithms.")
  flags.DEFINE_integer("num_processes", 4, "Worker processes.")
  flags.DEFINE_integer("steps", 5000, "Steps per worker.")
  flags.DEFINE_integer("slack_keys", 8, "Keys the last sample may hold beyond the first (O(workers)).")
  flags.DEFINE_float("slack_rss", 0.10, "Fractional RSS growth allowed from the first sample to the last.")


def run_one(out_dir: str, algorithm: str, n: int, steps: int) -> tuple[list[dict], int, float]:
  """(the run's growth samples, its exit code, its wall seconds)."""
  workdir = os.path.join(out_dir, algorithm)
  shutil.rmtree(workdir, ignore_errors=True)
  args = [
    f"--config=configs/default.py:executor=async,num_workers={n},algorithm={algorithm},model=mlp",
    f"--config.num_steps={steps}",
    "--config.runtime.step_time=0",
    f"--config.eval_every={steps}",
    f"--config.log_every={max(1, steps // 10)}",
    f"--workdir={workdir}",
  ]
  t0 = time.perf_counter()
  with open(os.path.join(out_dir, f"{algorithm}.log"), "w") as log:
    code = launch(n, args, out=log, grace_s=10, coordinator=True)
  wall = time.perf_counter() - t0
  path = os.path.join(workdir, "growth.jsonl")
  samples = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
  return samples, code, wall


def verdict(samples: list[dict], slack_keys: int, slack_rss: float) -> dict:
  """First and last sample (the first after the start: the run's keys are all made by then) and
  whether the run stayed flat."""
  if len(samples) < 3:
    return {"flat": False, "why": f"{len(samples)} samples: run longer"}
  first, last = samples[1], samples[-1]
  keys_ok = last["keys"] <= first["keys"] + slack_keys
  rss_ok = last["rss_mb"] <= first["rss_mb"] * (1 + slack_rss)
  return {
    "first": first,
    "last": last,
    "max_keys": max(s["keys"] for s in samples),
    "flat": keys_ok and rss_ok,
    "why": "" if keys_ok and rss_ok else ("keys grew" if not keys_ok else "RSS grew"),
  }


def main(argv):
  del argv
  os.makedirs(FLAGS.out, exist_ok=True)
  rows, record = [], {}
  for a in FLAGS.algorithms:
    samples, code, wall = run_one(FLAGS.out, a, FLAGS.num_processes, FLAGS.steps)
    v = verdict(samples, FLAGS.slack_keys, FLAGS.slack_rss)
    record[a] = {"exit": code, "wall_s": round(wall, 1), "samples": samples, **v}
    f, l = v.get("first", {}), v.get("last", {})
    rows.append(
      [
        a,
        code,
        f"{wall:.0f}",
        len(samples),
        f"{f.get('step', '-')} -> {l.get('step', '-')}",
        f"{f.get('keys', '-')} -> {l.get('keys', '-')} (max {v.get('max_keys', '-')})",
        f"{f.get('rss_mb', '-')} -> {l.get('rss_mb', '-')}",
        f"{f.get('fds', '-')} -> {l.get('fds', '-')}",
        "flat" if v["flat"] else f"NOT flat: {v['why']}",
      ]
    )
  table = Table(
    [
      "algorithm",
      "exit",
      "wall s",
      "samples",
      "step",
      "store keys",
      "coordinator RSS MB",
      "its fds",
      "verdict",
    ],
    rows,
  )
  print(table, flush=True)
  with open(os.path.join(FLAGS.out, "growth.json"), "w") as f:
    json.dump({"steps": FLAGS.steps, "num_processes": FLAGS.num_processes, "runs": record}, f, indent=1)
  with open(os.path.join(FLAGS.out, "growth.md"), "w") as f:
    f.write(f"{table}\n")


if __name__ == "__main__":
  define_flags()
  app.run(main)

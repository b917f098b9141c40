r"""The simulator at scale: wall seconds, peak memory, events per second and compiles per worker count.

  python -m benchmarks.bench_sim_scale --workers=64,256,1024,4096 --steps=100 --json_out=PATH

Each worker count is one run of experiments.train in a process of its own (executor=sim, Smart GG,
the MLP, one worker 5x slower, MNIST-1D with enough generated examples for --per_worker examples a
worker, evaluated once at the end), timed whole from the parent, start-up included. Peak RSS is the
child's own (os.wait4's ru_maxrss). Events are the clock's; `cost_per_worker_step_ms` is wall seconds
over workers x steps; `compiles` counts the XLA compiles while the rounds ran (summary.json). --plot
writes the cost per worker-step against the workers as a PNG.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.timing import print_json

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags() -> None:
  flags.DEFINE_list("workers", ["64", "256", "1024", "4096"], "Worker counts.")
  flags.DEFINE_integer("steps", 100, "Steps per worker.")
  flags.DEFINE_integer("per_worker", 100, "Training examples per worker (MNIST-1D is generated to fit).")
  flags.DEFINE_string("algorithm", "ripples_smart", "The algorithm.")
  flags.DEFINE_string("json_out", "", "Also write the figures here.")
  flags.DEFINE_string("plot", "", "A PNG of the cost per worker-step against the workers.")


def samples_for(n: int, per_worker: int) -> int:
  """MNIST-1D examples to generate so that n workers get per_worker training examples each (80% of
  the generated set trains), at least the standard 5000."""
  return max(5000, -(-n * per_worker * 5 // 4))


def run_one(n: int, steps: int, per_worker: int, algorithm: str, workdir: str) -> dict:
  args = [
    sys.executable,
    "-m",
    "experiments.train",
    f"--config=configs/default.py:algorithm={algorithm},executor=sim,num_workers={n},steps={steps},model=mlp",
    "--config.hetero.slow_workers=(3,)",
    "--config.hetero.slowdown=5.0",
    f"--config.mnist1d_samples={samples_for(n, per_worker)}",
    f"--config.log_every={max(steps // 10, 1)}",
    f"--config.eval_every={steps}",
    "--config.checkpoint_every=0",
    f"--workdir={workdir}",
  ]
  t0 = time.perf_counter()
  proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  wall = time.perf_counter() - t0
  if status != 0:
    raise RuntimeError(f"{n} workers failed ({status}):\n{out[-3000:]}")
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  return {
    "workers": n,
    "steps": steps,
    "wall_s": wall,
    "peak_rss_gb": usage.ru_maxrss / 2**20,  # KiB on Linux
    "events": summary["events"],
    "events_per_s": summary["events"] / wall,
    "cost_per_worker_step_ms": 1e3 * wall / (n * steps),
    "compiles": summary["compiles"],
    "round_programs": summary["round_programs"],
    "final_test_accuracy": summary.get("final_test_accuracy"),
    "train_examples_per_worker": samples_for(n, per_worker) * 4 // 5 // n,
  }


def plot(rows: list, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot([r["workers"] for r in rows], [r["cost_per_worker_step_ms"] for r in rows], "o-")
  ax.set(
    xscale="log", xlabel="workers", ylabel="wall ms per worker-step", title="simulator cost (MLP, Smart GG)"
  )
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  rows = []
  with tempfile.TemporaryDirectory(prefix="bench_sim_scale_") as tmp:
    for n in (int(w) for w in FLAGS.workers):
      rows.append(run_one(n, FLAGS.steps, FLAGS.per_worker, FLAGS.algorithm, os.path.join(tmp, f"n{n}")))
      r = rows[-1]
      print(
        f"{n} workers: {r['wall_s']:.1f} s, {r['peak_rss_gb']:.2f} GB, {r['events_per_s']:,.0f} events/s, "
        f"{r['cost_per_worker_step_ms']:.3f} ms per worker-step, {r['compiles']} compiles",
        flush=True,
      )
  if FLAGS.plot:
    plot(rows, FLAGS.plot)
  print_json({"algorithm": FLAGS.algorithm, "rows": rows}, FLAGS.json_out)


if __name__ == "__main__":
  define_flags()
  app.run(main)

r"""The simulator at scale: wall seconds, peak memory, events per second and compiles per worker count.

  python -m benchmarks.bench_sim_scale --workers=64,256,1024,4096 --steps=100 --json_out=PATH

Each worker count is one run of experiments.train in a process of its own (executor=sim, Smart GG,
the MLP, one worker 5x slower, MNIST-1D with enough generated examples for --per_worker examples a
worker, evaluated once at the end), timed whole from the parent, start-up included. Peak RSS is the
child's own (os.wait4's ru_maxrss). Events are the clock's; `cost_per_worker_step_ms` is wall seconds
over workers x steps; `compiles` counts the XLA compiles while the rounds ran (summary.json). --plot
writes the cost per worker-step against the workers as a PNG.

--malloc: each run under glibc's default allocator, under ripples_jax.allocator's tunables (the
child starts with them), or both, alternating per worker count (docs/design.md 5.1). Each row says
which. The numbers a run computes are the same under both; its final accuracy shows it.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.timing import print_json
from ripples_jax import allocator

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags() -> None:
  flags.DEFINE_list("workers", ["64", "256", "1024", "4096"], "Worker counts.")
  flags.DEFINE_integer("steps", 100, "Steps per worker.")
  flags.DEFINE_integer("per_worker", 100, "Training examples per worker (MNIST-1D is generated to fit).")
  flags.DEFINE_string("algorithm", "ripples_smart", "The algorithm.")
  flags.DEFINE_list("malloc", ["tuned"], "Allocator settings, each a run per worker count: tuned, default.")
  flags.DEFINE_string("json_out", "", "Also write the figures here.")
  flags.DEFINE_string("plot", "", "A PNG of the cost per worker-step against the workers.")


def samples_for(n: int, per_worker: int) -> int:
  """MNIST-1D examples to generate so that n workers get per_worker training examples each (80% of
  the generated set trains), at least the standard 5000."""
  return max(5000, -(-n * per_worker * 5 // 4))


def run_one(n: int, steps: int, per_worker: int, algorithm: str, workdir: str, malloc: str) -> dict:
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
  base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  child_env = allocator.env(base) if malloc == "tuned" else base
  proc = subprocess.Popen(
    args, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  wall = time.perf_counter() - t0
  if status != 0:
    raise RuntimeError(f"{n} workers failed ({status}):\n{out[-3000:]}")
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  return {
    "workers": n,
    "malloc": malloc,
    "steps": steps,
    "wall_s": wall,
    "peak_rss_gb": usage.ru_maxrss / 2**20,  # GiB: ru_maxrss is KiB on Linux
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
  for malloc in sorted({r["malloc"] for r in rows}):
    mine = [r for r in rows if r["malloc"] == malloc]
    ax.plot([r["workers"] for r in mine], [r["cost_per_worker_step_ms"] for r in mine], "o-", label=malloc)
  ax.legend(title="allocator", fontsize=8)
  ax.set(
    xscale="log", xlabel="workers", ylabel="wall ms per worker-step", title="simulator cost (MLP, Smart GG)"
  )
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  bad = sorted(set(FLAGS.malloc) - {"tuned", "default"})
  if bad:
    sys.exit(f"error: --malloc {','.join(bad)}: allowed are tuned and default")
  rows = []
  with tempfile.TemporaryDirectory(prefix="bench_sim_scale_") as tmp:
    for i, n in enumerate(int(w) for w in FLAGS.workers):
      # Alternate which setting goes first, so neither always runs on the fresher machine.
      for malloc in FLAGS.malloc if i % 2 == 0 else FLAGS.malloc[::-1]:
        work = os.path.join(tmp, f"n{n}_{malloc}")
        rows.append(run_one(n, FLAGS.steps, FLAGS.per_worker, FLAGS.algorithm, work, malloc))
        r = rows[-1]
        print(
          f"{n} workers, {malloc} allocator: {r['wall_s']:.1f} s, {r['peak_rss_gb']:.2f} GiB, "
          f"{r['events_per_s']:,.0f} events/s, {r['cost_per_worker_step_ms']:.3f} ms per worker-step, "
          f"{r['compiles']} compiles",
          flush=True,
        )
  if FLAGS.plot:
    plot(rows, FLAGS.plot)
  print_json({"algorithm": FLAGS.algorithm, "rows": rows}, FLAGS.json_out)


if __name__ == "__main__":
  define_flags()
  app.run(main)

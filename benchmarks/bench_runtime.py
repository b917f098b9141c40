r"""The asynchronous runtime in wall-clock time: 4 worker processes, homogeneous and one 2x / 5x slower.

  python -m benchmarks.bench_runtime --out=results/runtime        # ~12 minutes on 2 cores (estimated)

Every (slowdown, algorithm) is a real run of experiments.train under the local launcher: MLP on
MNIST-1D, 150 steps per worker on average. A worker's real compute is padded to `step_time` seconds
(0.1 s) so that N processes on a few cores do not saturate them (the slow worker then sleeps (s - 1) x
its measured step). Throughput is worker steps per wall-clock second; ratios are taken against
All-Reduce in the same runtime and the same invocation. Targets (n=4): Ripples smart >= 0.85 x the
limit (s (n-1) + 1) / n at 2x and 5x, and >= 0.95x All-Reduce homogeneous.
"""

import json
import os
import shutil

import numpy as np
from absl import app, flags

from benchmarks.timing import Table
from ripples_jax import analysis
from ripples_jax.distributed.launcher import launch
from ripples_jax.runtime import trace as trace_lib

FLAGS = flags.FLAGS

ALGORITHMS = (
  "allreduce",
  "ripples_static",
  "ripples_smart",
  "ripples_division",
  "adpsgd",
  "moshpit",
  "diloco",
  "ps_sync",
  "ps_async",
)


def define_flags() -> None:
  flags.DEFINE_string("out", "results/runtime", "Output folder (tables, PNGs, every run's files).")
  flags.DEFINE_integer("num_processes", 4, "Worker processes.")
  flags.DEFINE_list("slowdowns", ["1", "2", "5"], "Slowdowns of the slow worker.")
  flags.DEFINE_list("algorithms", list(ALGORITHMS), "Algorithms (allreduce first).")
  flags.DEFINE_integer("steps", 150, "Steps per worker on average (config.num_steps).")
  flags.DEFINE_float("step_time", 0.1, "Seconds every step is padded to.")
  flags.DEFINE_string("model", "mlp", "Model.")
  flags.DEFINE_float("target", 0.5, "Test accuracy for the time-to-target column.")
  flags.DEFINE_integer("slow_worker", None, "The slow worker (default: the last).")


def run_one(
  out_dir: str, num_processes: int, algorithm: str, slowdown: float, args: list[str], slow_worker: int
) -> dict:
  workdir = os.path.join(out_dir, f"s{slowdown:g}", algorithm)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  cfg = f"--config=configs/default.py:executor=async,num_workers={num_processes},algorithm={algorithm}"
  hetero = (
    [f"--config.hetero.slow_workers=({slow_worker},)", f"--config.hetero.slowdown={slowdown}"]
    if slowdown > 1
    else []
  )
  with open(os.path.join(workdir, "launch.log"), "w") as log:
    code = launch(
      num_processes, [cfg, f"--workdir={workdir}", *hetero, *args], out=log, grace_s=10, coordinator=True
    )
  if code:
    raise RuntimeError(f"{algorithm} at {slowdown}x failed with exit code {code}: see {workdir}/launch.log")
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def run(
  out_dir: str = "results/runtime",
  num_processes: int = 4,
  slowdowns=(1.0, 2.0, 5.0),
  algorithms=ALGORITHMS,
  steps: int = 150,
  step_time: float = 0.1,
  model: str = "mlp",
  target: float = 0.5,
  slow_worker: int | None = None,
  extra_args=(),
) -> Table:
  """Runs every (slowdown, algorithm); writes table.md, accuracy_vs_time.png, gantt.png; returns the table."""
  args = [
    f"--config.num_steps={steps}",
    f"--config.runtime.step_time={step_time}",
    f"--config.model={model}",
    f"--config.target_accuracy={target}",
    f"--config.eval_every={max(1, steps // 10)}",
    # Static GG over two "nodes", so it is not All-Reduce under another name.
    f"--config.schedule.workers_per_node={max(1, num_processes // 2)}",
    *extra_args,
  ]
  os.makedirs(out_dir, exist_ok=True)
  n = num_processes
  slow_worker = n - 1 if slow_worker is None else slow_worker
  results, curves = {}, {}
  for s in slowdowns:
    name = "homogeneous" if s == 1 else f"worker {slow_worker} {s:g}x slower"
    curves[name] = {}
    for algorithm in algorithms:
      r = run_one(out_dir, n, algorithm, s, args, slow_worker)
      results[s, algorithm] = r
      with open(os.path.join(r["workdir"], "metrics.jsonl")) as f:
        records = [json.loads(l) for l in f]
      curves[name][algorithm] = [(x["time"], x["test_accuracy"]) for x in records]
      print(
        f"{name:>22} {algorithm:>16}: {r['throughput']:.1f} worker-steps/s, "
        f"{r['time']:.1f} s, acc {100 * r['final_test_accuracy']:.1f}%",
        flush=True,
      )
  analysis.accuracy_vs_time(
    curves,
    os.path.join(out_dir, "accuracy_vs_time.png"),
    f"MNIST-1D, {n} worker processes (async runtime)",
    xlabel="wall-clock time (s)",
  )
  if (max(slowdowns), "ripples_smart") in results:
    r, s = results[max(slowdowns), "ripples_smart"], max(slowdowns)
    horizon = 12 * s * max(r["step_time"], 0.01)
    trace_lib.write_gantt(
      r["workdir"],
      os.path.join(out_dir, "gantt.png"),
      f"ripples_smart, {n} processes, worker {slow_worker} {s:g}x slower: first {horizon:.1f} s (wall clock)",
      t_max=horizon,
    )
  md = table(results, n, slowdowns, algorithms, target)
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(str(md) + "\n")
  return md


def table(results: dict, n: int, slowdowns, algorithms, target: float) -> Table:
  rows = []
  for s in slowdowns:
    ar = results.get((s, "allreduce"))
    for algorithm in algorithms:
      r = results[s, algorithm]
      speed = r["throughput"] / ar["throughput"] if ar else float("nan")
      t = r["time"]
      frac = lambda k: 100 * np.mean(r[k]) / t
      ttt = r["time_to_target"]
      ttt_ratio = (
        f"{ar['time_to_target'] / ttt:.2f}x"
        if ar and ttt and ar["time_to_target"]
        else ("not reached" if not ttt else "AR did not reach")
      )
      rows.append(
        [
          f"{s:g}x",
          algorithm,
          f"{sum(r['worker_steps'])}",
          f"{t:.1f}",
          f"{r['throughput']:.1f}",
          f"{speed:.2f}x",
          f"{analysis.limit(n, s):.2f}x",
          f"{speed / analysis.limit(n, s):.2f}",
          f"{100 * r['final_test_accuracy']:.1f}%",
          f"{ttt:.1f}" if ttt else "-",
          ttt_ratio,
          f"{frac('compute_time'):.0f}/{frac('wait_time'):.0f}/{frac('comm_time'):.0f}",
        ]
      )
  header = [
    "slowdown",
    "algorithm",
    "worker steps",
    "wall s",
    "worker-steps/s",
    "vs All-Reduce",
    "limit (s(n-1)+1)/n",
    "of limit",
    "final acc",
    f"time to {100 * target:.0f}% (s)",
    "TTT speedup vs AR",
    "compute/wait/comm %",
  ]
  return Table(header, rows)


def main(argv):
  del argv
  print(
    run(
      FLAGS.out,
      FLAGS.num_processes,
      [float(s) for s in FLAGS.slowdowns],
      FLAGS.algorithms,
      FLAGS.steps,
      FLAGS.step_time,
      FLAGS.model,
      FLAGS.target,
      FLAGS.slow_worker,
    )
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)

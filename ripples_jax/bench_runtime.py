"""The asynchronous runtime measured in wall-clock time: N worker processes, one of them s x slower.

Every (slowdown, algorithm) is a real run of experiments.train under the local launcher. A worker's real
compute is padded to `step_time` seconds so that N processes on a few cores do not saturate them (the
slow worker then sleeps (s - 1) x its measured step). Throughput is worker steps per wall-clock second;
ratios are taken against All-Reduce in the same runtime and the same invocation.
"""
import json
import os
import shutil

import numpy as np

from ripples_jax import plots
from ripples_jax.benchmark import markdown_table
from ripples_jax.reproduce_ripples import limit
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.launcher import launch

ALGORITHMS = ("allreduce", "ripples_static", "ripples_smart", "ripples_division", "adpsgd")


def run_one(out_dir: str, num_processes: int, algorithm: str, slowdown: float, args: list[str],
            slow_worker: int) -> dict:
  workdir = os.path.join(out_dir, f"s{slowdown:g}", algorithm)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  cfg = f"--config=configs/default.py:executor=async,num_workers={num_processes},algorithm={algorithm}"
  hetero = [f"--config.hetero.slow_workers=({slow_worker},)", f"--config.hetero.slowdown={slowdown}"] \
      if slowdown > 1 else []
  with open(os.path.join(workdir, "launch.log"), "w") as log:
    code = launch(num_processes, [cfg, f"--workdir={workdir}", *hetero, *args], out=log, grace_s=10)
  if code:
    raise RuntimeError(f"{algorithm} at {slowdown}x failed with exit code {code}: see {workdir}/launch.log")
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def run(out_dir: str, num_processes: int = 4, slowdowns=(1.0, 2.0, 5.0), algorithms=ALGORITHMS,
        args=(), slow_worker: int | None = None, target: float = 0.0) -> str:
  """Runs every (slowdown, algorithm); writes table.md, accuracy_vs_time.png, gantt.png; returns the table."""
  os.makedirs(out_dir, exist_ok=True)
  n = num_processes
  slow_worker = n - 1 if slow_worker is None else slow_worker
  results, curves = {}, {}
  for s in slowdowns:
    name = "homogeneous" if s == 1 else f"worker {slow_worker} {s:g}x slower"
    curves[name] = {}
    for algorithm in algorithms:
      r = run_one(out_dir, n, algorithm, s, list(args), slow_worker)
      results[s, algorithm] = r
      with open(os.path.join(r["workdir"], "metrics.jsonl")) as f:
        records = [json.loads(l) for l in f]
      curves[name][algorithm] = [(x["time"], x["test_accuracy"]) for x in records]
      print(f"{name:>22} {algorithm:>16}: {r['throughput']:.1f} worker-steps/s, "
            f"{r['time']:.1f} s, acc {100 * r['final_test_accuracy']:.1f}%", flush=True)
  plots.accuracy_vs_time(curves, os.path.join(out_dir, "accuracy_vs_time.png"),
                         f"MNIST-1D, {n} worker processes (async runtime)", xlabel="wall-clock time (s)")
  if (max(slowdowns), "ripples_smart") in results:
    r, s = results[max(slowdowns), "ripples_smart"], max(slowdowns)
    horizon = 12 * s * max(r["step_time"], 0.01)
    trace_lib.write_gantt(r["workdir"], os.path.join(out_dir, "gantt.png"),
                          f"ripples_smart, {n} processes, worker {slow_worker} {s:g}x slower: first "
                          f"{horizon:.1f} s (wall clock)", t_max=horizon)
  md = table(results, n, slowdowns, algorithms, target)
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(md + "\n")
  return md


def table(results: dict, n: int, slowdowns, algorithms, target: float) -> str:
  rows = []
  for s in slowdowns:
    ar = results.get((s, "allreduce"))
    for algorithm in algorithms:
      r = results[s, algorithm]
      speed = r["throughput"] / ar["throughput"] if ar else float("nan")
      t = r["time"]
      frac = lambda k: 100 * np.mean(r[k]) / t
      ttt = r["time_to_target"]
      ttt_ratio = (f"{ar['time_to_target'] / ttt:.2f}x" if ar and ttt and ar["time_to_target"] else
                   ("not reached" if not ttt else "AR did not reach"))
      rows.append([f"{s:g}x", algorithm, f"{sum(r['worker_steps'])}", f"{t:.1f}", f"{r['throughput']:.1f}",
                   f"{speed:.2f}x", f"{limit(n, s):.2f}x", f"{speed / limit(n, s):.2f}",
                   f"{100 * r['final_test_accuracy']:.1f}%", f"{ttt:.1f}" if ttt else "-", ttt_ratio,
                   f"{frac('compute_time'):.0f}/{frac('wait_time'):.0f}/{frac('comm_time'):.0f}"])
  header = ["slowdown", "algorithm", "worker steps", "wall s", "worker-steps/s", "vs All-Reduce",
            "limit (s(n-1)+1)/n", "of limit", "final acc", f"time to {100 * target:.0f}% (s)",
            "TTT speedup vs AR", "compute/wait/comm %"]
  return markdown_table(header, rows)

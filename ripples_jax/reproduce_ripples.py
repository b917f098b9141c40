"""The Ripples heterogeneity experiment: every algorithm under {homogeneous, one worker 2x, 5x slower}.

Runs in the simulator (exact numerics, virtual time) and reports throughput and time-to-target
relative to All-Reduce beside the paper's numbers and the limit (s (n - 1) + 1) / n (DESIGN 3.5, 3.6).
"""
import copy
import json
import os
import shutil

import numpy as np

from ripples_jax import plots, sim
from ripples_jax.benchmark import markdown_table
from ripples_jax.schedule import ALGORITHMS

SCENARIOS = {"homogeneous": 1.0, "one worker 2x slower": 2.0, "one worker 5x slower": 5.0}
SLOW_WORKER = 3
# DESIGN 3.6 (arXiv Ripples / ASPLOS Prague), for the rows they exist for.
PAPER = {
    ("homogeneous", "allreduce"): "1.1x (1.2x)", ("homogeneous", "ps_sync"): "5.1x (5.3x)",
    ("homogeneous", "adpsgd"): "4.3x (3.7x)", ("one worker 2x slower", "allreduce"): "2x (4.4x)",
    ("one worker 2x slower", "ps_sync"): "3x", ("one worker 5x slower", "allreduce"): "5.01x",
    ("one worker 5x slower", "adpsgd"): "4.23x",
}


def limit(n: int, s: float) -> float:
  return (s * (n - 1) + 1) / n


def run(base, out_dir: str, algorithms=ALGORITHMS, gantt_case=("ripples_smart", "one worker 5x slower")):
  """Runs every (scenario, algorithm); writes PNGs and table.md into out_dir; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  n = base.num_workers
  results, curves = {}, {}
  for scenario, s in SCENARIOS.items():
    curves[scenario] = {}
    for algorithm in algorithms:
      config = copy.deepcopy(base)
      config.unlock()
      config.algorithm = algorithm
      config.hetero.slow_workers = (SLOW_WORKER,) if s > 1 else ()
      config.hetero.slowdown = s
      workdir = os.path.join(out_dir, scenario.replace(" ", "_"), algorithm)
      shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: metrics.jsonl is appended to
      summary, trace = sim.simulate_and_train(config, workdir)
      records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
      curves[scenario][algorithm] = [(r["time"], r["test_accuracy"]) for r in records if "test_accuracy" in r]
      results[scenario, algorithm] = summary
      if (algorithm, scenario) == gantt_case:
        horizon = 12 * s * summary["base_step_time"]
        plots.gantt(trace.intervals, n, os.path.join(out_dir, "gantt.png"),
                    f"{algorithm}, {n} workers, {scenario} (worker {SLOW_WORKER}): first {horizon:.2f} virtual s",
                    t_max=horizon)
  plots.accuracy_vs_time(curves, os.path.join(out_dir, "accuracy_vs_time.png"),
                         f"MNIST-1D, CNN1D, {n} simulated workers")
  md = tables(results, n, base.target_accuracy, algorithms)
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(md + "\n")
  return md


def tables(results: dict, n: int, target: float, algorithms) -> str:
  rows = []
  for scenario, s in SCENARIOS.items():
    ar = results[scenario, "allreduce"]
    for algorithm in algorithms:
      r = results[scenario, algorithm]
      speed = r["throughput"] / ar["throughput"]
      t = r["time"]
      frac = lambda k: 100 * np.mean(r[k]) / t
      ttt = r["time_to_target"]
      ttt_ratio = (f"{ar['time_to_target'] / ttt:.2f}x" if ttt and ar["time_to_target"] else
                   ("not reached" if not ttt else "AR did not reach"))
      rows.append([scenario, algorithm, f"{r['throughput']:.0f}", f"{speed:.2f}x", f"{limit(n, s):.2f}x",
                   f"{speed / limit(n, s):.2f}", f"{100 * r['final_test_accuracy']:.1f}%",
                   f"{ttt:.2f}" if ttt else "-", ttt_ratio,
                   f"{frac('compute_time'):.0f}/{frac('wait_time'):.0f}/{frac('comm_time'):.0f}",
                   sum(r["conflicts"]), PAPER.get((scenario, algorithm), "")])
  header = ["scenario", "algorithm", "worker-steps/s", "vs All-Reduce", "limit", "of limit",
            "final acc", f"time to {100 * target:.0f}% (s)", "TTT speedup vs AR",
            "compute/wait/comm %", "conflicts", "paper: Ripples vs this"]
  main = markdown_table(header, rows)

  vs = []
  baselines = [a for a in ("adpsgd", "ps_sync", "ps_async", "dpsgd") if a in algorithms]
  for scenario in SCENARIOS:
    for ripples in [a for a in algorithms if a.startswith("ripples_")]:
      r = results[scenario, ripples]
      cells = [scenario, ripples]
      for base in baselines:
        b = results[scenario, base]
        tt = (f"{b['time_to_target'] / r['time_to_target']:.2f}x"
              if r["time_to_target"] and b["time_to_target"] else "-")
        cells.append(f"{r['throughput'] / b['throughput']:.2f}x / {tt}")
      vs.append(cells)
  names = {"adpsgd": "vs AD-PSGD (throughput / TTT)", "ps_sync": "vs PS sync", "ps_async": "vs PS async",
           "dpsgd": "vs D-PSGD"}
  head2 = ["scenario", "Ripples GG"] + [names[b] for b in baselines]
  return main + "\n\n" + markdown_table(head2, vs)

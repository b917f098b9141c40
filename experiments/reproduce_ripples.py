r"""Ripples' heterogeneity claims in the simulator: 16 workers, MNIST-1D, every algorithm x 3 scenarios.

  python -m experiments.reproduce_ripples --out_dir=runs/reproduce_ripples
  python -m experiments.reproduce_ripples --steps=100 --algorithms=allreduce,ripples_smart   # quick
  python -m experiments.reproduce_ripples --model_bytes=5.28e8 --compute_time=0.3 --bandwidth=7e9 \
      --out_dir=runs/reproduce_ripples_vgg   # the paper's communication: VGG-16 over 56 Gb/s

Runs in the simulator (exact numerics, virtual time). Writes table.md (throughput and time-to-target
relative to All-Reduce, beside the paper's numbers and the limit (s(n-1)+1)/n; docs/design.md 3.5, 3.6),
accuracy_vs_time.png and gantt.png.
"""

import copy
import json
import os
import shutil

import numpy as np
from absl import app, flags

from configs import default as default_config
from ripples_jax import analysis, sim
from ripples_jax.algorithms import names
from ripples_jax.tables import markdown_table

ALGORITHMS = names()

SCENARIOS = {"homogeneous": 1.0, "one worker 2x slower": 2.0, "one worker 5x slower": 5.0}
SLOW_WORKER = 3
# docs/design.md 3.6 (arXiv Ripples / ASPLOS Prague), for the rows they exist for.
PAPER = {
  ("homogeneous", "allreduce"): "1.1x (1.2x)",
  ("homogeneous", "ps_sync"): "5.1x (5.3x)",
  ("homogeneous", "adpsgd"): "4.3x (3.7x)",
  ("one worker 2x slower", "allreduce"): "2x (4.4x)",
  ("one worker 2x slower", "ps_sync"): "3x",
  ("one worker 5x slower", "allreduce"): "5.01x",
  ("one worker 5x slower", "adpsgd"): "4.23x",
}


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
        analysis.gantt(
          trace.intervals,
          n,
          os.path.join(out_dir, "gantt.png"),
          f"{algorithm}, {n} workers, {scenario} (worker {SLOW_WORKER}): first {horizon:.2f} virtual s",
          t_max=horizon,
        )
  analysis.accuracy_vs_time(
    curves, os.path.join(out_dir, "accuracy_vs_time.png"), f"MNIST-1D, CNN1D, {n} simulated workers"
  )
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
      ttt_ratio = (
        f"{ar['time_to_target'] / ttt:.2f}x"
        if ttt and ar["time_to_target"]
        else ("not reached" if not ttt else "AR did not reach")
      )
      lim = analysis.limit(n, s)
      rows.append(
        [
          scenario,
          algorithm,
          f"{r['throughput']:.0f}",
          f"{speed:.2f}x",
          f"{lim:.2f}x",
          f"{speed / lim:.2f}",
          f"{100 * r['final_test_accuracy']:.1f}%",
          f"{ttt:.2f}" if ttt else "-",
          ttt_ratio,
          f"{frac('compute_time'):.0f}/{frac('wait_time'):.0f}/{frac('comm_time'):.0f}",
          sum(r["conflicts"]),
          PAPER.get((scenario, algorithm), ""),
        ]
      )
  header = [
    "scenario",
    "algorithm",
    "worker-steps/s",
    "vs All-Reduce",
    "limit",
    "of limit",
    "final acc",
    f"time to {100 * target:.0f}% (s)",
    "TTT speedup vs AR",
    "compute/wait/comm %",
    "conflicts",
    "paper: Ripples vs this",
  ]
  main_table = markdown_table(header, rows)

  vs = []
  baselines = [a for a in ("adpsgd", "ps_sync", "ps_async", "dpsgd") if a in algorithms]
  for scenario in SCENARIOS:
    for ripples in [a for a in algorithms if a.startswith("ripples_")]:
      r = results[scenario, ripples]
      cells = [scenario, ripples]
      for base in baselines:
        b = results[scenario, base]
        tt = (
          f"{b['time_to_target'] / r['time_to_target']:.2f}x"
          if r["time_to_target"] and b["time_to_target"]
          else "-"
        )
        cells.append(f"{r['throughput'] / b['throughput']:.2f}x / {tt}")
      vs.append(cells)
  names = {
    "adpsgd": "vs AD-PSGD (throughput / TTT)",
    "ps_sync": "vs PS sync",
    "ps_async": "vs PS async",
    "dpsgd": "vs D-PSGD",
  }
  head2 = ["scenario", "Ripples GG"] + [names[b] for b in baselines]
  return main_table + "\n\n" + markdown_table(head2, vs)


_OUT = flags.DEFINE_string("out_dir", "runs/reproduce_ripples", "Output folder.")
_WORKERS = flags.DEFINE_integer("workers", 16, "Simulated workers (the paper's scale: 16).")
_STEPS = flags.DEFINE_integer("steps", 500, "Steps per worker (num_steps).")
_TARGET = flags.DEFINE_float("target_accuracy", 0.8, "Test accuracy for time-to-target.")
_JITTER = flags.DEFINE_float("jitter", 0.05, "Lognormal sigma of every step time.")
_ALGOS = flags.DEFINE_list("algorithms", list(ALGORITHMS), "Algorithms (allreduce is always needed).")
_COMPUTE = flags.DEFINE_float("compute_time", 0.01, "Virtual seconds of one base step.")
_BYTES = flags.DEFINE_float(
  "model_bytes",
  0.0,
  "Bytes per model exchange (0: the CNN's real bytes; 5.28e8 is VGG-16, the paper's CIFAR model).",
)
_BANDWIDTH = flags.DEFINE_float("bandwidth", 1.25e9, "Bytes/s per link and at the parameter server.")


def main(argv):
  del argv
  config = default_config.get_config(f"executor=sim,num_workers={_WORKERS.value},steps={_STEPS.value}")
  config.target_accuracy = _TARGET.value
  config.hetero.jitter = _JITTER.value
  config.timeline.compute_time = _COMPUTE.value
  config.timeline.model_bytes = _BYTES.value
  config.timeline.bandwidth = config.timeline.ps_bandwidth = _BANDWIDTH.value
  config.eval_every = max(1, _STEPS.value // 20)
  config.log_every = max(1, _STEPS.value // 20)
  print(run(config, _OUT.value, algorithms=_ALGOS.value))


if __name__ == "__main__":
  app.run(main)

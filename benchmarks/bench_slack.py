r"""Links with slack against lockstep links, in the pipeline runtime, with and without random stragglers.

  python -m benchmarks.bench_slack --json_out=results/pipeline/slack.json

K=2 stage processes (pipeline/per_process.py) on the model of benchmarks/pipeline.py (CNN2D, synthetic
CIFAR-shaped data, batch 64). Rows, all in one run and interleaved (--reps alternations of the whole
set, so that the machine's drift lands on every row alike):
  dsp at link delay 1 and 2, recompute mode, runtime.slack on (transfers on a thread per link) and off
  (every transfer waited for at once: lockstep), each without stragglers and with random stragglers
  (each tick, each stage slowed --slowdown times with probability --p, inside its compute calls);
  model-parallel BP and GPipe (their locked links wait for every transfer either way) with the same
  stragglers, with slack on.
Reported per row: the median measured iteration (the slowest stage's steady tick spacing) and its spread
over the repetitions; tick efficiency (timing.tick_efficiency: the slowest stage's compute, median call
x calls per iteration, and transfer over the iteration); for the straggler rows, the share of throughput
kept against the mean extra compute alone, iteration without stragglers x (1 + p (s - 1)) / iteration
with them (1.0: only the extra compute is paid, no waiting for the slowed neighbour).
"""

import copy
import os
import shutil
import tempfile

import numpy as np
from absl import app, flags

from benchmarks.pipeline import bench_config, run_variant
from benchmarks.timing import print_json
from ripples_jax.pipeline import timing

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer("reps", 3, "Alternations of the whole set of rows.")
  flags.DEFINE_integer("iterations", 60, "Batches per run.")
  flags.DEFINE_float("p", 0.2, "A stage's chance per tick of being slow.")
  flags.DEFINE_float("slowdown", 3.0, "How many times longer a slow stage's compute takes.")
  flags.DEFINE_list("rows", [], "Only these rows (default: every one).")
  flags.DEFINE_string("json_out", "", "Also write the figures here.")


def rows() -> dict:
  """name -> config overrides (method, mode, delay, slack, straggler)."""
  out = {}
  for delay in (1, 2):
    for slack in (True, False):
      for strag in (False, True):
        name = f"dsp_d{delay}_{'slack' if slack else 'lockstep'}{'_stragglers' if strag else ''}"
        out[name] = dict(method="dsp", mode="recompute", delay=delay, slack=slack, stragglers=strag)
  for method, row in (("bp", "bp_model_parallel"), ("gpipe", "gpipe")):  # the ledger's row names
    for strag in (False, True):
      name = f"{row}{'_stragglers' if strag else ''}"
      out[name] = dict(method=method, mode="recompute", delay=1, slack=True, stragglers=strag)
  return out


def config_for(base, r: dict):
  c = copy.deepcopy(base)
  c.method, c.mode, c.delay, c.placement = r["method"], r["mode"], r["delay"], "per_process"
  c.runtime.slack = r["slack"]
  if r["stragglers"]:
    c.straggler_p, c.slowdown = FLAGS.p, FLAGS.slowdown
  return c


def predict(config, calm_stages) -> float:
  """This row's iteration as timing.runtime_with_stragglers predicts it from the calm run's calls and
  the runtime's own straggler draw (timing.straggler_factor)."""
  ticks = int(calm_stages[0]["ticks"])
  fac = [
    [timing.straggler_factor(config.seed, k, t, config.slowdown, -1, config.straggler_p) for k in range(2)]
    for t in range(ticks)
  ]
  method = config.method
  return timing.runtime_with_stragglers(method, calm_stages, fac, config.delay, config.runtime.slack)


def main(argv):
  del argv
  base = bench_config(2, "cnn2d", FLAGS.iterations)
  table, tmp = rows(), tempfile.mkdtemp(prefix="bench_slack_")
  table = {k: v for k, v in table.items() if not FLAGS.rows or k in FLAGS.rows}
  runs = {name: [] for name in table}
  for rep in range(FLAGS.reps):
    for name, r in table.items():
      summary = run_variant(config_for(base, r), os.path.join(tmp, f"{name}_{rep}"))
      got = {"iteration_s": summary["iteration_s"], "tick_efficiency": timing.tick_efficiency(summary)}
      calm = runs.get(name[: -len("_stragglers")]) if name.endswith("_stragglers") else None
      if calm:  # the calm row of this repetition ran just before: the model predicts this row from it
        got["predicted_s"] = predict(config_for(base, r), calm[-1]["stages"])
      got["stages"] = summary["stages"]
      runs[name].append(got)
      print(f"rep {rep} {name}: {1e3 * summary['iteration_s']:.1f} ms", flush=True)
  shutil.rmtree(tmp, ignore_errors=True)
  out = {"p": FLAGS.p, "slowdown": FLAGS.slowdown, "reps": FLAGS.reps, "iterations": FLAGS.iterations}
  mean_extra = 1 + FLAGS.p * (FLAGS.slowdown - 1)
  for name, got in runs.items():
    its = np.array([g["iteration_s"] for g in got])
    row = {
      "iteration_ms": float(1e3 * np.median(its)),
      "iteration_ms_spread": [float(1e3 * its.min()), float(1e3 * its.max())],
      "tick_efficiency": float(np.median([g["tick_efficiency"] for g in got])),
    }
    if got and "predicted_s" in got[0]:
      pred = np.array([g["predicted_s"] for g in got])
      row["predicted_ms"] = float(1e3 * np.median(pred))
      row["prediction_error"] = float(np.median(pred / its - 1))
      row["prediction_error_spread"] = [float(min(pred / its - 1)), float(max(pred / its - 1))]
    if name.endswith("_stragglers") and name[: -len("_stragglers")] in runs:
      calm = np.array([g["iteration_s"] for g in runs[name[: -len("_stragglers")]]])
      kept = calm * mean_extra / its  # paired by repetition
      row["kept_vs_mean_extra"] = float(np.median(kept))
      row["kept_spread"] = [float(kept.min()), float(kept.max())]
    out[name] = row
  for d in (1, 2):
    for suffix in ("", "_stragglers"):
      if f"dsp_d{d}_lockstep{suffix}" not in runs or f"dsp_d{d}_slack{suffix}" not in runs:
        continue
      a = np.array([g["iteration_s"] for g in runs[f"dsp_d{d}_lockstep{suffix}"]])
      b = np.array([g["iteration_s"] for g in runs[f"dsp_d{d}_slack{suffix}"]])
      out[f"slack_speedup_d{d}{suffix}"] = {
        "median": float(np.median(a / b)),
        "spread": [float(min(a / b)), float(max(a / b))],
      }
  print_json(out, FLAGS.json_out)


if __name__ == "__main__":
  define_flags()
  app.run(main)

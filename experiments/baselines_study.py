r"""Ripples beside today's baselines: Smart GG, Random GG, AD-PSGD, All-Reduce, DiLoCo (H = 4, 16, 64),
Moshpit SGD and both parameter servers, tuned one way, on the ledger's scenarios (experiments.baselines).

  python -m experiments.baselines_study --out=results/baselines --workers=2        # hours on 2 cores
  python -m experiments.baselines_study --out=results/baselines --parts=runtime    # real processes

--parts: tune (the VGG-16 clock's step sizes: tuning.md), sim16 (6 scenarios at 16 workers:
study16.md/png), sim256 (2 at 256, step sizes tuned there: tuning_256.md, study256.md/png),
tune_light and runtime (16 worker processes: tuning_light.md, runtime.md; the killed scenario on
--runtime_killed_seeds). Every part resumes from the runs --out holds (runs.json, runtime_runs.json);
never two study processes on one --out.
"""

import os

from absl import app, flags

from experiments import baselines

FLAGS = flags.FLAGS
PARTS = ("tune", "sim16", "sim256", "tune_light", "runtime")


def define_flags():
  flags.DEFINE_string("out", "results/baselines", "Output folder.")
  flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {', '.join(PARTS)} (in this order).")
  flags.DEFINE_integer("seeds", 5, "Reported seeds at 16 workers (0..seeds-1).")
  flags.DEFINE_integer("seeds_256", 5, "Reported seeds at 256 workers.")
  flags.DEFINE_integer("workers", 1, "Simulated runs at once (one core each).")
  flags.DEFINE_integer("steps", 300, "Steps per worker of each simulated run.")
  flags.DEFINE_float("target", 0.55, "Target test accuracy.")
  flags.DEFINE_list(
    "algorithms",
    list(baselines.ALGORITHMS),
    "Algorithms (All-Reduce and Smart GG needed; default results/baselines' set, or any of baselines.LABELS, "
    "e.g. DiLoCo as published).",
  )
  flags.DEFINE_list(
    "algorithms_256",
    list(baselines.ALGORITHMS_256),
    "sim256's algorithms (of --algorithms; at 256 a run is 2-3 core-minutes).",
  )
  flags.DEFINE_list("grid", None, "Step-size grid (default: the ledger's LR_GRID).")
  flags.DEFINE_bool(
    "tune_256", True, "sim256: tune its algorithms at 256 workers (tuning_256.md); else the 16-worker choice."
  )
  flags.DEFINE_list("grid_256", list(map(str, baselines.GRID_256)), "sim256's own tuning grid.")
  flags.DEFINE_list("outer_grid", None, "DiLoCo's outer step-size grid (default: OUTER_GRID).")
  flags.DEFINE_list("adamw_grid", None, "AdamW inner steps' step-size grid (default: ADAMW_GRID).")
  flags.DEFINE_multi_string("scenario", None, "Only these scenarios of the sim parts (default: all).")
  flags.DEFINE_integer("runtime_seeds", 5, "runtime: seeds.")
  flags.DEFINE_integer("runtime_killed_seeds", 5, "runtime: the killed scenario's seeds.")
  flags.DEFINE_bool(
    "runtime_repredict", False, "runtime: predict the held killed runs again (after a simulator change)."
  )
  flags.DEFINE_integer("runtime_steps", 80, "runtime: steps per worker.")
  flags.DEFINE_float("runtime_step_time", 0.5, "runtime: seconds every step is padded to.")
  flags.DEFINE_string("runtime_workdir", "/tmp/baselines_runtime", "runtime: the runs' folders (traces).")


def main(argv):
  del argv
  unknown = [p for p in FLAGS.parts if p not in PARTS] + [
    a for a in FLAGS.algorithms + FLAGS.algorithms_256 if a not in baselines.LABELS
  ]
  needed = {"allreduce", "ripples_smart"}
  if unknown or not needed <= set(FLAGS.algorithms) or not needed <= set(FLAGS.algorithms_256):
    raise app.UsageError(
      f"--parts of {PARTS} and --algorithms of {list(baselines.LABELS)} with allreduce and "
      f"ripples_smart; got {unknown or FLAGS.algorithms}"
    )
  grid = {} if FLAGS.grid is None else {"grid": tuple(float(x) for x in FLAGS.grid)}
  if FLAGS.outer_grid is not None:
    grid["outer_grid"] = tuple(float(x) for x in FLAGS.outer_grid)
  if FLAGS.adamw_grid is not None:
    grid["adamw_grid"] = tuple(float(x) for x in FLAGS.adamw_grid)
  os.makedirs(FLAGS.out, exist_ok=True)
  args = dict(algorithms=tuple(FLAGS.algorithms), **grid)
  if {"tune", "sim16", "sim256"} & set(FLAGS.parts):
    chosen = baselines.tune(FLAGS.out, "heavy", FLAGS.steps, FLAGS.target, FLAGS.workers, **args)
    for part, scenarios, seeds, own in (
      ("sim16", baselines.STUDY_16, FLAGS.seeds, True),
      ("sim256", baselines.STUDY_256, FLAGS.seeds_256, False),  # the averaged model only (256 own: slow)
    ):
      scenarios = [s for s in scenarios if not FLAGS.scenario or s in FLAGS.scenario]
      if part not in FLAGS.parts or not scenarios:
        continue
      if part == "sim256":
        chosen = {a: c for a, c in chosen.items() if a in FLAGS.algorithms_256}
        tuned = "at 16 workers (tuning.md)"
        if FLAGS.tune_256:  # one grid for every algorithm at 256, by the same rule (tuning_256.md)
          args256 = {
            **args,
            "grid": tuple(float(x) for x in FLAGS.grid_256),
            "algorithms": tuple(FLAGS.algorithms_256),
          }
          chosen = baselines.tune(FLAGS.out, "heavy256", FLAGS.steps, FLAGS.target, FLAGS.workers, **args256)
          tuned = "at 256 workers (tuning_256.md)"
      out = baselines.run_study(
        FLAGS.out, scenarios, seeds, FLAGS.steps, FLAGS.target, FLAGS.workers, chosen, own
      )
      n = 16 if part == "sim16" else 256
      head = baselines.header(n, seeds, FLAGS.steps, FLAGS.target, *([tuned] if n == 256 else []))
      print(baselines.publish(FLAGS.out, f"study{n}", out, FLAGS.target, head))
  if {"tune_light", "runtime"} & set(FLAGS.parts):
    chosen = baselines.tune(FLAGS.out, "light", FLAGS.steps, FLAGS.target, FLAGS.workers, **args)
    if "runtime" in FLAGS.parts:
      baselines.runtime_study(
        FLAGS.out,
        FLAGS.runtime_seeds,
        FLAGS.runtime_steps,
        FLAGS.steps,
        FLAGS.runtime_step_time,
        FLAGS.target,
        chosen,
        FLAGS.runtime_workdir,
        killed_seeds=FLAGS.runtime_killed_seeds,
        repredict=FLAGS.runtime_repredict,
      )


if __name__ == "__main__":
  define_flags()
  app.run(main)

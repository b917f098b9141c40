r"""Compares finished runs: one table, and accuracy against time in one figure.

  python -m experiments.compare runs/smart runs/ar --plot=runs/compare.png
  python -m experiments.compare runs/smart runs/ar --target=0.8

Each RUN_DIR is a run's folder (summary.json, metrics.jsonl). Time is wall seconds, or the simulator's
virtual seconds (a separate panel). Time to target: the first evaluation at or above --target (default:
each run's config.target_accuracy); '-' when no evaluation reached it.
"""

import sys

from absl import app, flags

from ripples_jax import analysis

_PLOT = flags.DEFINE_string("plot", None, "PNG path for accuracy against time (default: no figure).")
_TARGET = flags.DEFINE_float("target", None, "Target accuracy, a fraction (default: each run's config).")


def main(argv):
  workdirs = argv[1:]
  if not workdirs:
    sys.stderr.write("error: RUN_DIR: none given: at least one run's folder, e.g. runs/smart runs/ar\n")
    sys.exit(2)
  if _TARGET.value is not None and not 0 < _TARGET.value <= 1:
    sys.stderr.write(f"error: --target={_TARGET.value} is not allowed: a fraction in (0, 1]\n")
    sys.exit(2)
  try:
    runs = [analysis.read_run(w, _TARGET.value) for w in workdirs]
  except (FileNotFoundError, ValueError) as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(2)
  print(analysis.compare_table(runs))
  if _PLOT.value:
    analysis.compare_plot(runs, _PLOT.value)
    print(f"figure: {_PLOT.value}")


def cli():  # the console script (pyproject [project.scripts])
  app.run(main)


if __name__ == "__main__":
  app.run(main)

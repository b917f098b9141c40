r"""Regenerates every table and figure of WORKSPACE.md.

  python -m experiments.reproduce --all              # the numbers (~1 h on 2 cores, estimated)
  python -m experiments.reproduce --quick            # every step at small sizes (under 10 min)
  python -m experiments.reproduce --steps=spectral,runtime

Tables and PNGs go to --results/<step>/ with provenance.json (command, machine, date); runs to --work.
"""
import sys

from absl import app, flags

from ripples_jax.reproduce import STEPS, run

_ALL = flags.DEFINE_bool("all", False, "Every step at full size.")
_QUICK = flags.DEFINE_bool("quick", False, "Every step at small size.")
_STEPS = flags.DEFINE_list("steps", [], f"Some steps only: {', '.join(STEPS)}.")
_RESULTS = flags.DEFINE_string("results", None, "Tables and figures (default: results, or "
                               "runs/reproduce_quick/results with --quick).")
_WORK = flags.DEFINE_string("work", "runs/reproduce", "Work folder for the runs.")


def main(argv):
  del argv
  names = _STEPS.value or list(STEPS)
  unknown = [s for s in names if s not in STEPS]
  if unknown or not (_ALL.value or _QUICK.value or _STEPS.value):
    sys.exit(f"error: --steps: {unknown} is not allowed: any of {', '.join(STEPS)}" if unknown
             else "error: pass --all, --quick or --steps")
  quick = _QUICK.value
  results = _RESULTS.value or ("runs/reproduce_quick/results" if quick else "results")
  print(run(names, quick, results, _WORK.value + ("_quick" if quick else "")))


if __name__ == "__main__":
  app.run(main)

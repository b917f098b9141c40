r"""The fair fight (experiments.baselines2): every method as its paper runs it, tuned on one budget,
scored on the consensus model (its All-Reduce charged) and the median worker's own model, on held-out
seeds; results/baselines' headline rerun on new seeds.

  python -m experiments.baselines2_study --out=results/baselines2 --workers=2     # ~2 h on 2 cores

--parts: heldout_old (results/baselines' protocol on seeds 20-27: heldout_old.md), tune (homogeneous
and 5x-straggler tunings), report (the six scenarios on the held-out seeds: study.md, tuning.md),
at256 (256 workers holding 100 examples each, the tuning's choices: at256.md), long (1,920 steps,
homogeneous: DiLoCo H=64 at 30 outer steps beside All-Reduce, each tuned at that length:
long.md, tuning_long.md), runtime (16 worker processes, homogeneous and 5x: runtime.md; not in the
default --parts: run alone, on a quiet machine).
Every part resumes from --out's runs.json; never two study processes on one --out.
"""

import os

from absl import app, flags

from experiments import baselines2

FLAGS = flags.FLAGS
PARTS = ("heldout_old", "tune", "report", "at256", "long", "runtime")


def define_flags():
  flags.DEFINE_string("out", "results/baselines2", "Output folder.")
  flags.DEFINE_list("parts", list(PARTS[:5]), f"Parts to run, of {', '.join(PARTS)} (in this order).")
  flags.DEFINE_list(
    "methods",
    [k for k in baselines2.METHODS if k != "diloco64"],
    f"Methods of tune and report, of {', '.join(baselines2.METHODS)}.",
  )
  flags.DEFINE_list("seeds", list(map(str, baselines2.SEEDS)), "Reported (held-out) seeds.")
  flags.DEFINE_string(
    "old", "results/baselines", "The superseded study (heldout_old's step sizes and figures)."
  )
  flags.DEFINE_integer("workers", 1, "Simulated runs at once (one core each).")
  flags.DEFINE_string("runtime_workdir", "/tmp/baselines2_runtime", "runtime: the runs' folders (traces).")


def main(argv):
  del argv
  bad = [p for p in FLAGS.parts if p not in PARTS] + [m for m in FLAGS.methods if m not in baselines2.METHODS]
  if bad or "allreduce" not in FLAGS.methods:
    raise app.UsageError(
      f"--parts of {PARTS}, --methods of {list(baselines2.METHODS)} with allreduce; "
      f"got {bad or FLAGS.methods}"
    )
  os.makedirs(FLAGS.out, exist_ok=True)
  if "heldout_old" in FLAGS.parts:
    print(baselines2.heldout_old(FLAGS.out, FLAGS.old, FLAGS.workers), flush=True)
  if {"tune", "report"} & set(FLAGS.parts):
    choices = {
      kind: baselines2.tune(FLAGS.out, kind, FLAGS.methods, FLAGS.workers) for kind in baselines2.TUNE_ON
    }
    if "report" in FLAGS.parts:
      seeds = tuple(int(s) for s in FLAGS.seeds)
      runs = baselines2.run_report(FLAGS.out, choices, FLAGS.methods, seeds, FLAGS.workers)
      out = baselines2.collect(runs, choices, FLAGS.methods, seeds, baselines2.TARGET)
      print(baselines2.publish(FLAGS.out, choices, out, seeds, baselines2.TARGET), flush=True)
      if os.path.exists(os.path.join(FLAGS.out, "heldout_old.json")):
        print(baselines2.before_after(FLAGS.out, FLAGS.old), flush=True)
  if "at256" in FLAGS.parts:  # after report: it takes tuning.json's choices
    b = baselines2
    print(b.sim_part(FLAGS.out, b.AT256, b.METHODS_256, b.SEEDS_256, FLAGS.workers), flush=True)
  if "long" in FLAGS.parts:
    seeds = tuple(int(s) for s in FLAGS.seeds)
    print(
      baselines2.sim_part(FLAGS.out, baselines2.LONG, baselines2.METHODS_LONG, seeds, FLAGS.workers),
      flush=True,
    )
  if "runtime" in FLAGS.parts:
    baselines2.runtime_study(FLAGS.out, FLAGS.old, FLAGS.runtime_workdir)
    print(open(os.path.join(FLAGS.out, "runtime.md")).read(), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)

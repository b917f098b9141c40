r"""The claims ledger of the Ripples paper: each claim judged on time to accuracy over paired seeds.

  python -m experiments.ledger --out=results/ledger3 --seeds=5 --workers=2 --tta   # hours on 2 cores
  python -m experiments.ledger --out=results/ledger3 --verdicts_only                # from stored runs

Numerics and clock, named on every table: the numbers are an MNIST-1D MLP's (40-256-256-10, 16 workers)
trained in the simulator; the clock is one of SETTINGS, each constant with its source in
docs/ledger_sources.md: "light" (MNIST-1D-sized messages, 10 Gb/s links, 10 ms steps), "heavy", the
VGG-16 clock (528e6-byte messages: ImageNet VGG-16; 56 Gb/s; 0.3 s steps; which VGG-16 the paper ran
is unknown: its evaluation section could not be read), "resnet50" (102.2e6 bytes, 0.101 s steps:
sourced; the link is not), and two variants of the VGG-16 clock (2/3 overlap, the CIFAR VGG-16's 58.9 MB).

Fair comparison: every algorithm's step size is tuned per clock from one grid (LR_GRID) on a
validation split (VALIDATION_EXAMPLES held-out training examples), least median validation time to
the target over TUNE_SEEDS seeds (tuning.md); reported runs use it and report test accuracy. Every
run's curve (test and validation accuracy of the averaged model, the mean of the workers' own models)
is kept in runs.json, which a study resumes from (only this process writes it; never two ledger
processes on one --out). --workers runs that many at once, one core each.

The verdicts (verdicts.md) take the paper's metric, time to a target test accuracy of the averaged
model in virtual time, baseline over Ripples, paired by seed, and judge every published figure (arXiv
abstract, ASPLOS abstract, the body's figures known only from a summary) by ripples_jax.verdict: a 95%
interval over at least 5 seeds, seeds that miss the target counted and censored at their run's end.
Then: what each verdict rests on; the same claims at every target (TARGETS) and for the workers' own
models; on the clock's variants; the accuracy after a fixed time (the ResNet-50 claim, on the
ResNet-50 clock); the claims no run compares (sync overhead, conflicts); Smart GG by worker count.

The throughput runs (the clock alone, every claim in both settings, AD-PSGD's cost variants, Smart GG
against All-Reduce by worker count) write ledger.md / ledger.json. With --tta the training runs of
every scenario in TTA_SCENARIOS: tuning.md, tta.md, tta.json (per seed: times to every target for both
evaluations, steps, the run's end, final accuracies, throughput, the step size), seed 0's curves for
the figures (tta_curves.json; runs.json holds them all) and one figure per scenario. --tta_scenario runs
some scenarios alone, merged into --out's tta.json (the others kept; ledger.json is made first if --out
has none):

  python -m experiments.ledger --out=results/ledger3 --seeds=5 --workers=2 \
      --tta_scenario="5x straggler, VGG-16 clock, overlap 2/3"

Clock studies alone (no training, ~10 minutes): --sensitivity, every claim's throughput ratio as one
constant of the VGG-16 clock moves (SWEEPS: bandwidth 0.25x-4x, the message's size, overlap 0-1);
--sync_overhead, each algorithm's synchronisation overhead per iteration beside the paper's 5.10x:

  python -m experiments.ledger --out=results/ledger3 --seeds=5 --sensitivity --sync_overhead

On real processes (--runtime, ~an hour on 2 cores at 5 seeds): the homogeneous, 2x and 5x straggler
claims against All-Reduce and AD-PSGD in the asynchronous runtime, 16 worker processes, wall-clock time
to --target, paired by seed, each row beside the simulator's prediction (experiments.ledger_runtime):

  python -m experiments.ledger --runtime --out=results/ledger_runtime --seeds=5

This module is the entry point (flags, main); the ledger's parts: ledger_claims (the claims, their
published figures, the clocks), ledger_throughput (the clock runs and studies), ledger_tta (the training
runs, the step-size tuning, tta.json), ledger_tables (the fixed-time and scale tables), ledger_verdicts
(verdicts.md), ledger_runtime (the claims on real processes).
"""

import json
import os

from absl import app, flags

from experiments import ledger_runtime
from experiments.ledger_throughput import adpsgd_sweep, run, sensitivity, sync_overhead
from experiments.ledger_tta import MODELS, TTA_SCENARIOS, tta, tta_table
from experiments.ledger_verdicts import claim_estimate, verdicts_text

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", "results/ledger", "Output folder.")
  flags.DEFINE_bool(
    "tta", False, "Also the time-to-accuracy runs of every scenario (training; hours on 2 cores)."
  )
  flags.DEFINE_float("target", 0.55, "Target test accuracy for time to accuracy.")
  flags.DEFINE_integer("tta_steps", 300, "Steps per worker of each training run.")
  flags.DEFINE_bool("verdicts_only", False, "Only the verdict table, from the JSON files in --out.")
  flags.DEFINE_bool("sensitivity", False, "Only the clock's sensitivity sweeps (SWEEPS), into --out.")
  flags.DEFINE_bool("sync_overhead", False, "Only each algorithm's sync overhead per iteration, into --out.")
  flags.DEFINE_integer("seeds", 3, "Seeds per cell.")
  flags.DEFINE_integer("steps", 300, "Steps per worker in each clock run.")
  flags.DEFINE_multi_string(
    "tta_scenario",
    None,
    "Only these time-to-accuracy scenarios (repeat the flag; "
    "names as in TTA_SCENARIOS), merged into --out's tta.json; no throughput runs.",
  )
  flags.DEFINE_list("tta_algorithms", None, "With --tta_scenario: only these of each scenario's algorithms.")
  flags.DEFINE_integer("workers", 1, "Training runs at once, each in its own process on one core.")
  flags.DEFINE_enum("model", "mlp", list(MODELS), "The training runs' numerics (one model per --out).")
  flags.DEFINE_bool("adpsgd_sweep", False, "Only AD-PSGD's cost sweep (the clock alone), into --out.")
  flags.DEFINE_string("beside", "", "Another ledger's folder (another --model): its verdicts beside these.")
  flags.DEFINE_bool(
    "runtime", False, "Only the claims on real processes (experiments.ledger_runtime), into --out."
  )
  flags.DEFINE_integer("runtime_steps", 80, "--runtime: steps per worker of each run.")
  flags.DEFINE_float("runtime_step_time", 0.5, "--runtime: seconds every step is padded to.")
  flags.DEFINE_string(
    "runtime_tuned", "results/ledger4/tuning.json", "--runtime: the step sizes (light clock)."
  )
  flags.DEFINE_string("runtime_workdir", "/tmp/ledger_runtime", "--runtime: the runs' folders (traces).")


def main(argv):
  del argv
  if FLAGS.runtime:  # the claims on real processes alone
    held = ledger_runtime.runtime_ledger(
      FLAGS.out,
      FLAGS.seeds,
      FLAGS.runtime_steps,
      FLAGS.tta_steps,
      FLAGS.runtime_step_time,
      FLAGS.target,
      FLAGS.runtime_tuned,
      FLAGS.runtime_workdir,
    )
    print(f"{len(held)} runs; {os.path.join(FLAGS.out, 'verdicts.md')}")
    return
  if FLAGS.sensitivity or FLAGS.sync_overhead or FLAGS.adpsgd_sweep:  # clock studies alone
    os.makedirs(FLAGS.out, exist_ok=True)
    if FLAGS.sensitivity:
      sensitivity(FLAGS.out, FLAGS.seeds, FLAGS.steps)
    if FLAGS.sync_overhead:
      sync_overhead(FLAGS.out, FLAGS.seeds, FLAGS.steps)
    if FLAGS.adpsgd_sweep:  # with the ledger's measured Smart GG vs AD-PSGD, where --out holds it
      held = os.path.join(FLAGS.out, "tta.json")
      measured = (
        claim_estimate(json.load(open(held)), "homogeneous vs AD-PSGD") if os.path.exists(held) else None
      )
      adpsgd_sweep(FLAGS.out, FLAGS.seeds, FLAGS.steps, measured)
    return
  if FLAGS.verdicts_only:  # the verdict table again, from the JSON files a run left
    with open(os.path.join(FLAGS.out, "ledger.json")) as f:
      ledger_out = json.load(f)
    tta_path = os.path.join(FLAGS.out, "tta.json")
    tta_out = json.load(open(tta_path)) if os.path.exists(tta_path) else None
    if tta_out:  # and tta.md, from the same records
      with open(os.path.join(FLAGS.out, "tta.md"), "w") as f:
        f.write(str(tta_table(tta_out["scenarios"], tta_out["target"])) + "\n")
  elif FLAGS.tta_scenario:  # these scenarios alone, merged into tta.json; the throughput runs read
    unknown = [s for s in FLAGS.tta_scenario if s not in TTA_SCENARIOS]
    if unknown:
      raise app.UsageError(f"unknown --tta_scenario {unknown}; known: {list(TTA_SCENARIOS)}")
    held = os.path.join(FLAGS.out, "ledger.json")
    if os.path.exists(held):
      with open(held) as f:
        ledger_out = json.load(f)
    else:  # a fresh --out: the throughput runs first
      ledger_out = run(FLAGS.out, FLAGS.seeds, FLAGS.steps)
    tta_out = {
      "scenarios": tta(
        FLAGS.out,
        FLAGS.seeds,
        FLAGS.tta_steps,
        FLAGS.target,
        tuple(FLAGS.tta_scenario),
        FLAGS.tta_algorithms,
        merge=True,
        workers=FLAGS.workers,
        model=FLAGS.model,
      ),
      "model": FLAGS.model,
    }
  else:
    ledger_out = run(FLAGS.out, FLAGS.seeds, FLAGS.steps)
    tta_out = (
      {
        "scenarios": tta(
          FLAGS.out, FLAGS.seeds, FLAGS.tta_steps, FLAGS.target, workers=FLAGS.workers, model=FLAGS.model
        ),
        "model": FLAGS.model,
      }
      if FLAGS.tta
      else None
    )
  beside = None
  if FLAGS.beside:
    with open(os.path.join(FLAGS.beside, "tta.json")) as f:
      beside = json.load(f)
  text = verdicts_text(FLAGS.out, ledger_out, tta_out, FLAGS.target, FLAGS.tta_steps, beside)
  with open(os.path.join(FLAGS.out, "verdicts.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)

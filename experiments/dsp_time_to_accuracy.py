r"""Wall-clock time to a target test accuracy: every pipeline method in the per-process runtime against
single-process BP, each at the step size the accuracy grid chose for it on validation.

  python -m experiments.dsp_time_to_accuracy --grid=results/dsp_accuracy/table.json \
      --out_dir=results/dsp_time_to_accuracy
  python -m experiments.dsp_time_to_accuracy --grid=G --epochs=2 --seeds=0 --methods=dsp --targets=0.3 \
      --out_dir=/tmp/tta   # quick

The setting is the grid's (experiments.dsp_accuracy): MNIST-1D, CNN1D, batch 64, the same held-out
validation examples (so the same training set), its epochs; K stages (--num_stages, one process each,
one core each, experiments.launch) or, for the reference `bp_single_process`, one process on every core
(placement=one_device). Both clocks are training time net of evaluation (the test set every --eval_every
batches); a method's time to target T is the clock at its first evaluation with test accuracy >= T.
The runs go seed by seed, the order of the methods rotated each seed, so drift on a shared machine lands
on every row alike; each speedup is paired with the same seed's single-process BP. A seed that never
reaches T is counted (m of n reached) and its time is censored at the run's whole training time (a
lower bound on its time to target, so the median speedup is an upper bound where m < n).

Writes into out_dir: runs.json (per run: the curve of (seconds, test accuracy), the whole time, the lr;
written after every run, a rerun skips what it holds), table.md / table.json and curves.png (test
accuracy against training seconds, seed 0).
"""

import io
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from absl import app, flags

from ripples_jax.distributed.launcher import launch
from ripples_jax.runlog import write_json
from ripples_jax.tables import markdown_table, spread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = "bp_single_process"
# name: (method, mode, placement, the grid's method whose chosen lr it takes). dsp_weight_stash runs
# mode=residuals in the runtime: the forward's vjp residuals are the stashed weights' (stash's numerics).
ROWS = {
  REFERENCE: ("bp", "recompute", "one_device", "bp"),
  "bp_model_parallel": ("bp", "recompute", "per_process", "bp"),
  "gpipe": ("gpipe", "recompute", "per_process", "gpipe"),
  "ddg": ("ddg", "recompute", "per_process", "ddg"),
  "pipedream": ("pipedream", "recompute", "per_process", "pipedream"),
  "pipemare": ("pipemare", "recompute", "per_process", "pipemare"),
  "fr": ("fr", "recompute", "per_process", "fr"),
  "dsp": ("dsp", "recompute", "per_process", "dsp"),
  "dsp_weight_stash": ("dsp", "residuals", "per_process", "dsp_weight_stash"),
}


def _args(name, K, lr, seed, epochs, eval_every, validation, workdir) -> list:
  method, mode, placement, _ = ROWS[name]
  return [
    f"--config=configs/dsp.py:method={method},num_stages={K},mode={mode},epochs={epochs}",
    f"--workdir={workdir}",
    f"--config.placement={placement}",
    f"--config.optimizer.lr={lr}",
    f"--config.seed={seed}",
    f"--config.validation_examples={validation}",
    f"--config.eval_every={eval_every}",
    f"--config.log_every={eval_every}",
    "--config.checkpoint_every=0",
  ]


def run_one(name, K, lr, seed, epochs, eval_every, validation, workdir) -> dict:
  """One run in its own process(es); its curve of (training seconds, test accuracy) and whole time."""
  args = _args(name, K, lr, seed, epochs, eval_every, validation, workdir)
  if ROWS[name][2] == "per_process":
    out = io.StringIO()
    code = launch(K, args, module="experiments.train_dsp", out=out, cwd=ROOT, grace_s=10)
    log = out.getvalue()
  else:
    p = subprocess.run(
      [sys.executable, "-m", "experiments.train_dsp", *args], cwd=ROOT, capture_output=True, text=True
    )
    code, log = p.returncode, p.stdout + p.stderr
  if code != 0:
    raise RuntimeError(f"{name} seed {seed} failed ({code}):\n{log[-3000:]}")
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  curve = [[r["time"], r["test_accuracy"]] for r in records if r.get("test_accuracy") is not None]
  return {"curve": curve, "whole_s": records[-1]["time"], "final_test_accuracy": curve[-1][1]}


def time_to(curve, target: float):
  """Seconds at the first evaluation reaching `target`, or None."""
  return next((t for t, acc in curve if acc >= target), None)


def summarise(runs: dict, names, seeds, targets) -> dict:
  """Per row and target: seeds reached (m of n), time to target and the speedup over the same seed's
  single-process BP, censored at the whole run where a seed misses."""
  out = {}
  for name in names:
    rs = [runs[f"{name}_seed{s}"] for s in seeds]
    row = {"lr": rs[0]["lr"], "final_test_accuracy": spread([r["final_test_accuracy"] for r in rs])}
    row["whole_s"] = spread([r["whole_s"] for r in rs])
    for T in targets:
      t = [time_to(r["curve"], T) for r in rs]
      ref = [time_to(runs[f"{REFERENCE}_seed{s}"]["curve"], T) for s in seeds]
      censored = [x if x is not None else r["whole_s"] for x, r in zip(t, rs)]
      pairs = [b / x for b, x in zip(ref, censored) if b is not None]
      row[f"{T:g}"] = {
        "reached": sum(x is not None for x in t),
        "of": len(t),
        "seconds": spread(censored),
        "speedup_vs_bp_single_process": spread(pairs) if pairs else None,
      }
    out[name] = row
  return out


def markdown(summary, names, seeds, targets, setting: str) -> str:
  head = [
    f"# Time to accuracy in the per-process runtime ({setting})\n",
    f"Seeds {list(seeds)}. Seconds: training time net of evaluation, median [min, max] over the seeds; a "
    "seed that misses the target is censored at its whole run (m/n says how many reached it). "
    f"Speedup: the same seed's {REFERENCE} time over the row's, median [min, max].\n",
  ]
  fmt = lambda s, f: f"{f(s['median'])} [{f(s['min'])}, {f(s['max'])}]"
  rows = []
  for name in names:
    e = summary[name]
    cells = [name, f"{e['lr']:g}", fmt(e["final_test_accuracy"], lambda x: f"{100 * x:.1f}")]
    cells.append(fmt(e["whole_s"], lambda x: f"{x:.1f}"))
    for T in targets:
      c = e[f"{T:g}"]
      sp = c["speedup_vs_bp_single_process"]
      cells.append(
        f"{c['reached']}/{c['of']}: {fmt(c['seconds'], lambda x: f'{x:.1f}')} s, "
        + ("-" if sp is None else fmt(sp, lambda x: f"{x:.2f}x"))
      )
    rows.append(cells)
  cols = ["row", "lr", "final test acc %", "whole run s"] + [
    f"to {100 * T:g}%: reached, s, speedup" for T in targets
  ]
  return "\n".join(head) + "\n" + markdown_table(cols, rows) + "\n"


def plot(runs, names, seed, path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in names:
    c = np.asarray(runs[f"{name}_seed{seed}"]["curve"])
    ax.plot(c[:, 0], 100 * c[:, 1], label=name, lw=1.2)
  ax.set_xlabel("training seconds (net of evaluation)")
  ax.set_ylabel("test accuracy (%)")
  ax.set_ylim(bottom=50)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title(f"MNIST-1D CNN1D, seed {seed}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Called only when this is the entry point (the tests import the module beside others)."""
  flags.DEFINE_string("grid", "results/dsp_accuracy/table.json", "The accuracy grid's table.json.")
  flags.DEFINE_string("out_dir", "results/dsp_time_to_accuracy", "Output folder.")
  flags.DEFINE_integer("num_stages", 2, "K: stages, one process each.")
  flags.DEFINE_list("methods", [n for n in ROWS if n != REFERENCE], "Rows beside the reference.")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  flags.DEFINE_list("targets", ["0.8", "0.85", "0.88"], "Target test accuracies.")
  flags.DEFINE_integer("epochs", None, "Epochs of every run (default: the grid's).")
  flags.DEFINE_integer("eval_every", 100, "Batches between evaluations (the curve's resolution).")


def main(argv):
  del argv
  grid = json.load(open(FLAGS.grid))
  K, seeds = FLAGS.num_stages, [int(s) for s in FLAGS.seeds]
  names = [REFERENCE] + [n for n in FLAGS.methods if n != REFERENCE]
  for n in names:
    if n not in ROWS or f"K{K}_{ROWS[n][3]}" not in grid["results"]:
      raise app.UsageError(f"--methods: {n!r} has no row here or no K={K} entry in {FLAGS.grid}")
  epochs, targets = FLAGS.epochs or grid["epochs"], [float(t) for t in FLAGS.targets]
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  path = os.path.join(FLAGS.out_dir, "runs.json")
  runs = json.load(open(path)) if os.path.exists(path) else {}
  tmp = tempfile.mkdtemp(prefix="dsp_tta_")
  for i, seed in enumerate(seeds):
    for name in names[i % len(names) :] + names[: i % len(names)]:  # rotated
      key, lr = f"{name}_seed{seed}", grid["results"][f"K{K}_{ROWS[name][3]}"]["best_lr"]
      if key in runs and runs[key]["epochs"] == epochs:
        continue
      r = run_one(
        name, K, lr, seed, epochs, FLAGS.eval_every, grid["validation_examples"], os.path.join(tmp, key)
      )
      runs[key] = {"name": name, "seed": seed, "lr": lr, "epochs": epochs, "K": K, **r}
      write_json(path, runs)
      print(
        f"{key}: lr {lr:g} final {100 * r['final_test_accuracy']:.1f}% in {r['whole_s']:.1f} s", flush=True
      )
  summary = summarise(runs, names, seeds, targets)
  setting = f"MNIST-1D, CNN1D, K={K}, {epochs} epochs, batch 64"
  md = markdown(summary, names, seeds, targets, setting)
  with open(os.path.join(FLAGS.out_dir, "table.md"), "w") as fh:
    fh.write(md)
  write_json(
    os.path.join(FLAGS.out_dir, "table.json"),
    {
      "setting": setting,
      "seeds": seeds,
      "targets": targets,
      "eval_every": FLAGS.eval_every,
      "results": summary,
    },
  )
  plot(runs, names, seeds[0], os.path.join(FLAGS.out_dir, "curves.png"))
  print(md)


if __name__ == "__main__":
  define_flags()
  app.run(main)

r"""Accuracy of the pipeline methods on MNIST-1D (CNN1D), each at its best step size from one shared grid.

  python -m experiments.dsp_accuracy --workers=2 --out_dir=results/dsp_accuracy
  python -m experiments.dsp_accuracy --epochs=2 --lrs=0.02 --seeds=0 --methods=bp,dsp --out_dir=/tmp/q  #
  quick

Every (K, method, lr, seed) of the grid is one run of configs/dsp.py with VALIDATION_EXAMPLES of the
training set held out (the same ones for every seed); `dsp_weight_stash` is method=dsp with mode=stash:
weight stashing on DSP's schedule, not DSP as published. The step size is chosen on validation and
reported on test: per (K, method) the lr with the highest mean final *validation* accuracy over the seeds
(a diverged seed counting as 0), and the test accuracy there. Writes into out_dir: runs.json (one entry per
run, written after every run; a rerun skips the runs it already holds), table.md and table.json (the chosen
lr; mean, min-max and std of the test accuracy there, train and test loss, the difference to BP's) and
lr_grid.png (mean validation accuracy against lr, one panel per K). Run folders live under --run_dir and
are deleted once their numbers are read. --workers=N runs N grid points at once, each in a process of its
own pinned to one core (the numbers do not depend on it: every run is one process's deterministic run).
"""

import concurrent.futures
import json
import math
import os
import shutil
import tempfile
import time

import numpy as np
from absl import app, flags

from configs import dsp as dsp_config
from experiments.pool import pinned_pool
from ripples_jax import run as run_lib
from ripples_jax.distributed.host import quiet_library_logs
from ripples_jax.pipeline import methods
from ripples_jax.runlog import write_json
from ripples_jax.tables import markdown_table

METHODS = methods.names() + ("dsp_weight_stash",)  # every method, and DSP's schedule with stashing
LRS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.3)  # the one shared step-size grid
VALIDATION_EXAMPLES = 500  # of MNIST-1D's 4,000 training examples (3,500 left to train on)
TRAIN_LOSS_RECORDS = 5  # final train loss: the mean of the last 5 records (each the mean of 50 batches)
CHANCE = 0.15  # a finite run ending below this test accuracy has collapsed (uniform output, loss ln 10)


def _method(name):
  """(method, mode) of a grid method name: dsp_weight_stash is DSP's schedule with the stored
  parameter versions."""
  return ("dsp", "stash") if name == "dsp_weight_stash" else (name, "recompute")


def _run_name(K, name, lr, seed):
  return f"K{K}_{name}_lr{lr:g}_seed{seed}"


def _run(base, run_dir, name, **overrides):
  """One run in run_dir/name (deleted afterwards): its final numbers, a diverged run as a result."""
  t0 = time.time()
  summary, records = run_lib.run_fresh(base, run_dir, name, **overrides)  # diverged: a result
  wall = time.time() - t0
  shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
  diverged = summary.get("diverged")
  evals = [r for r in records if r.get("test_accuracy") is not None]
  losses = [r["train_loss"] for r in records if r.get("train_loss") is not None]
  nan = float("nan")
  return {
    "diverged": diverged is not None,
    "diverged_message": diverged,
    "final_val_accuracy": nan if diverged or not evals else evals[-1].get("val_accuracy", nan),
    "final_test_accuracy": nan if diverged or not evals else evals[-1]["test_accuracy"],
    "final_test_loss": nan if diverged or not evals else evals[-1]["test_loss"],
    "final_train_loss": (nan if diverged or not losses else float(np.mean(losses[-TRAIN_LOSS_RECORDS:]))),
    "last_epoch": records[-1]["epoch"] if records else nan,
    "wall_s": wall,
  }


def _load(path):
  return json.load(open(path)) if os.path.exists(path) else {}


def _grid_point(base, run_dir, key, overrides) -> dict:
  return _run(base, run_dir, key, **overrides)


def _points(runs, stage_counts, methods, lrs, seeds, epochs):
  """(key, the run's identity, its config overrides) for every grid point runs does not hold yet."""
  for K in stage_counts:
    for name in methods:
      method, mode = _method(name)
      for lr in lrs:
        for seed in seeds:
          key = _run_name(K, name, lr, seed)
          if key in runs and runs[key]["epochs"] == epochs and "final_val_accuracy" in runs[key]:
            continue
          ident = {"K": K, "method": name, "lr": lr, "seed": seed, "epochs": epochs}
          overrides = dict(method=method, mode=mode, num_stages=K, seed=seed, num_epochs=epochs)
          yield key, ident, {**overrides, "optimizer.lr": lr}


def run_grid(base, out_dir, run_dir, stage_counts, methods, lrs, seeds, epochs, workers=1) -> dict:
  """Every run of the grid not yet in out_dir/runs.json (workers at once, one core each); returns {run
  name: result}. Only this process writes runs.json, after each run."""
  path = os.path.join(out_dir, "runs.json")
  runs = _load(path)
  todo = list(_points(runs, stage_counts, methods, lrs, seeds, epochs))
  with pinned_pool(workers) as ex:  # one core each
    futures = {ex.submit(_grid_point, base, run_dir, key, ov): (key, ident) for key, ident, ov in todo}
    for fut in concurrent.futures.as_completed(futures):
      key, ident = futures[fut]
      r = fut.result()
      runs[key] = {**ident, **r}
      write_json(path, runs)
      print(
        f"{key}: val acc {r['final_val_accuracy']:.4f} test acc {r['final_test_accuracy']:.4f} "
        f"test loss {r['final_test_loss']:.4f} train loss {r['final_train_loss']:.4f} diverged "
        f"{r['diverged']} ({r['wall_s']:.0f} s)",
        flush=True,
      )
  return runs


def _std(x):
  return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def summarise(runs, stage_counts, methods, lrs, seeds, epochs) -> dict:
  """Per (K, method): every lr's mean accuracy (diverged seed = 0) and the best lr's statistics."""
  out = {}
  for K in stage_counts:
    for name in methods:
      per_lr = {}
      for lr in lrs:
        rs = [runs[_run_name(K, name, lr, s)] for s in seeds]
        assert all(r["epochs"] == epochs for r in rs)
        ok = [r for r in rs if not r["diverged"]]
        acc = [0.0 if r["diverged"] else r["final_test_accuracy"] for r in rs]
        val = [0.0 if r["diverged"] else r["final_val_accuracy"] for r in rs]
        per_lr[lr] = {
          "mean_val_accuracy": float(np.mean(val)),
          "val_accuracy": val,
          "mean_test_accuracy": float(np.mean(acc)),
          "test_accuracy": acc,
          "min": float(min(acc)),
          "max": float(max(acc)),
          "std": _std(acc),
          "diverged_seeds": [r["seed"] for r in rs if r["diverged"]],
          "collapsed_seeds": [
            r["seed"] for r in rs if not r["diverged"] and r["final_test_accuracy"] < CHANCE
          ],
          "mean_train_loss": float(np.mean([r["final_train_loss"] for r in ok])) if ok else None,
          "mean_test_loss": float(np.mean([r["final_test_loss"] for r in ok])) if ok else None,
        }
      # Chosen on validation, reported on test; ties: the first (smaller) lr.
      best = max(lrs, key=lambda lr: per_lr[lr]["mean_val_accuracy"])
      best_on_test = max(lrs, key=lambda lr: per_lr[lr]["mean_test_accuracy"])
      out[f"K{K}_{name}"] = {
        "K": K,
        "method": name,
        "best_lr": best,
        "best": per_lr[best],
        "best_lr_at_grid_edge": best in (min(lrs), max(lrs)),
        # What choosing on test would have reported (the optimism a validation split removes).
        "best_lr_on_test": best_on_test,
        "best_on_test_mean_test_accuracy": per_lr[best_on_test]["mean_test_accuracy"],
        "per_lr": {f"{lr:g}": v for lr, v in per_lr.items()},
      }
  for K in stage_counts:
    bp = out[f"K{K}_bp"]["best"]
    for name in methods:
      e = out[f"K{K}_{name}"]
      b = e["best"]
      diff = b["mean_test_accuracy"] - bp["mean_test_accuracy"]
      combined_std = math.sqrt(b["std"] ** 2 + bp["std"] ** 2)
      combined_half_range = (b["max"] - b["min"]) / 2 + (bp["max"] - bp["min"]) / 2
      e["vs_bp"] = {
        "diff_points": 100 * diff,
        "combined_std_points": 100 * combined_std,
        "combined_half_range_points": 100 * combined_half_range,
        "exceeds_combined_std": abs(diff) > combined_std,
        "exceeds_combined_half_range": abs(diff) > combined_half_range,
        "ranges_disjoint": b["min"] > bp["max"] or b["max"] < bp["min"],
      }
  return out


def _pct(x):
  return f"{100 * x:.2f}"


def _loss(x):
  return "-" if x is None else f"{x:.4f}"


def markdown(summary, runs, stage_counts, methods, lrs, seeds, epochs) -> str:
  n = len(runs)
  wall = sum(r["wall_s"] for r in runs.values())
  head = (
    f"# Pipeline methods at their best step size (MNIST-1D, CNN1D)\n\n"
    f"Grid: K in {list(stage_counts)}, lr in {list(lrs)}, seeds {list(seeds)}, {epochs} epochs for "
    f"every run (configs/dsp.py otherwise: momentum 0.9, cosine schedule, 50 warm-up steps, "
    f"weight decay 5e-4, batch 64, delay 1), {VALIDATION_EXAMPLES} training examples held out for "
    f"validation. {n} runs, {wall / 60:.1f} min of run time, one CPU core each.\n\n"
    f"Best lr = the lr with the highest mean final *validation* accuracy over the {len(seeds)} seeds "
    f"(a diverged seed counts as 0); every accuracy below is *test* accuracy at that lr, except the "
    f"grid of validation accuracies. Accuracy in %, std with ddof=1. Final train loss = mean of "
    f"the last {TRAIN_LOSS_RECORDS} train-loss records (each the mean of 50 batches); losses "
    f"averaged over the non-diverged seeds. vs BP = mean accuracy minus BP's best mean, in "
    f"points; 'combined std' = sqrt(std_method^2 + std_bp^2); 'combined half-range' = half the "
    f"method's min-max range plus half BP's. 'div.' = NaN stop (accuracy 0); 'coll.' = finished "
    f"but collapsed to chance (test accuracy < {100 * CHANCE:.0f}%, loss ln 10; counted at its "
    f"accuracy). A best lr marked * is at the edge of the grid: that method's optimum may lie "
    f"outside it.\n"
  )
  rows = []
  for K in stage_counts:
    for name in methods:
      e = summary[f"K{K}_{name}"]
      b, v = e["best"], e["vs_bp"]
      rows.append(
        [
          K,
          name,
          f"{e['best_lr']:g}" + ("*" if e["best_lr_at_grid_edge"] else ""),
          _pct(b["mean_val_accuracy"]),
          _pct(b["mean_test_accuracy"]),
          f"{_pct(b['min'])}-{_pct(b['max'])}",
          _pct(b["std"]),
          _loss(b["mean_train_loss"]),
          _loss(b["mean_test_loss"]),
          "-" if name == "bp" else f"{v['diff_points']:+.2f}",
          "-" if name == "bp" else f"{v['combined_std_points']:.2f}",
          "-" if name == "bp" else ("yes" if v["exceeds_combined_std"] else "no"),
          "-" if name == "bp" else f"{v['combined_half_range_points']:.2f}",
          "-" if name == "bp" else ("yes" if v["exceeds_combined_half_range"] else "no"),
          ",".join(map(str, b["diverged_seeds"])) or "-",
        ]
      )
  main = markdown_table(
    [
      "K",
      "method",
      "best lr (val)",
      "mean val acc",
      "mean test acc",
      "min-max",
      "std",
      "train loss",
      "test loss",
      "vs BP (points)",
      "combined std",
      "exceeds std",
      "combined half-range",
      "exceeds half-range",
      "diverged seeds at best lr",
    ],
    rows,
  )
  grid_rows = []
  for K in stage_counts:
    for name in methods:
      per = summary[f"K{K}_{name}"]["per_lr"]
      cells = []
      for lr in lrs:
        p = per[f"{lr:g}"]
        d = ", ".join(
          f"{len(p[k])} {w}" for k, w in (("diverged_seeds", "div."), ("collapsed_seeds", "coll.")) if p[k]
        )
        d = f" ({d})" if d else ""
        cells.append(f"{_pct(p['mean_val_accuracy'])} / {_pct(p['mean_test_accuracy'])}{d}")
      grid_rows.append([K, name] + cells)
  grid = markdown_table(["K", "method"] + [f"lr {lr:g}" for lr in lrs], grid_rows)
  return "\n".join(
    [
      head,
      "## Best lr per method\n",
      main,
      "",
      "## Mean validation / test accuracy (%) over seeds at every lr\n",
      grid,
      "",
      "## Where DSP beats BP\n",
      _dsp_vs_bp(summary, stage_counts, methods),
      "",
      "### At the same lr (not the best-lr comparison)\n",
      _dsp_vs_bp_same_lr(summary, stage_counts, methods, lrs),
      "",
    ]
  )


def _dsp_vs_bp(summary, stage_counts, methods) -> str:
  """For every DSP variant and K where its best mean accuracy exceeds BP's: train and test loss."""
  lines = []
  for name in [m for m in methods if m.startswith("dsp")]:
    for K in stage_counts:
      e, bp = summary[f"K{K}_{name}"], summary[f"K{K}_bp"]
      b, p, v = e["best"], bp["best"], e["vs_bp"]
      if b["mean_test_accuracy"] <= p["mean_test_accuracy"]:
        lines.append(
          f"- {name}, K={K}: does not beat BP ({_pct(b['mean_test_accuracy'])}% at lr "
          f"{e['best_lr']:g} vs BP {_pct(p['mean_test_accuracy'])}% at lr {bp['best_lr']:g}, "
          f"{v['diff_points']:+.2f} points)."
        )
        continue
      tr_d, te_d = b["mean_train_loss"], b["mean_test_loss"]
      tr_b, te_b = p["mean_train_loss"], p["mean_test_loss"]
      if None in (tr_d, te_d, tr_b, te_b):
        reading = "losses unavailable (diverged seeds)"
      elif tr_d > tr_b and te_d < te_b:
        reading = "higher train loss but lower test loss than BP: consistent with a regularisation effect"
      elif tr_d < tr_b and te_d < te_b:
        reading = "lower train and lower test loss than BP: DSP fits better, not a regularisation effect"
      elif tr_d > tr_b and te_d >= te_b:
        reading = (
          "higher train and not lower test loss than BP: the accuracy gain is not mirrored by the loss"
        )
      else:
        reading = "lower train loss but not lower test loss than BP"
      sig = "exceeds" if v["exceeds_combined_std"] else "does not exceed"
      lines.append(
        f"- {name}, K={K}: {_pct(b['mean_test_accuracy'])}% (lr {e['best_lr']:g}, "
        f"{_pct(b['min'])}-{_pct(b['max'])}) vs BP {_pct(p['mean_test_accuracy'])}% (lr {bp['best_lr']:g}, "
        f"{_pct(p['min'])}-{_pct(p['max'])}): {v['diff_points']:+.2f} points, which {sig} the combined "
        f"std {v['combined_std_points']:.2f} "
        f"(min-max ranges {'disjoint' if v['ranges_disjoint'] else 'overlap'}). "
        f"Train loss {_loss(tr_d)} vs BP {_loss(tr_b)}; test loss {_loss(te_d)} vs BP {_loss(te_b)}: "
        f"{reading}."
      )
  return "\n".join(lines)


def _dsp_vs_bp_same_lr(summary, stage_counts, methods, lrs) -> str:
  """Every lr where a DSP variant's mean accuracy exceeds BP's at that same lr: the losses."""
  lines = []
  for name in [m for m in methods if m.startswith("dsp")]:
    for K in stage_counts:
      for lr in lrs:
        d, p = summary[f"K{K}_{name}"]["per_lr"][f"{lr:g}"], summary[f"K{K}_bp"]["per_lr"][f"{lr:g}"]
        if d["mean_test_accuracy"] <= p["mean_test_accuracy"]:
          continue
        tr = te = "-"
        if None not in (d["mean_train_loss"], p["mean_train_loss"]):
          tr = "higher" if d["mean_train_loss"] > p["mean_train_loss"] else "lower"
          te = "lower" if d["mean_test_loss"] < p["mean_test_loss"] else "higher"
        lines.append(
          f"- {name}, K={K}, lr {lr:g}: {_pct(d['mean_test_accuracy'])}% vs BP "
          f"{_pct(p['mean_test_accuracy'])}% "
          f"({100 * (d['mean_test_accuracy'] - p['mean_test_accuracy']):+.2f} "
          f"points); train loss {_loss(d['mean_train_loss'])} vs {_loss(p['mean_train_loss'])} ({tr}), "
          f"test loss {_loss(d['mean_test_loss'])} vs {_loss(p['mean_test_loss'])} ({te})."
        )
  return "\n".join(lines) or "- none"


def plot(summary, out_dir, stage_counts, methods, lrs) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(
    1, len(stage_counts), figsize=(5.5 * len(stage_counts), 4.2), squeeze=False, sharey=True
  )
  for ax, K in zip(axes[0], stage_counts):
    for name in methods:
      per = summary[f"K{K}_{name}"]["per_lr"]
      mean = [100 * per[f"{lr:g}"]["mean_val_accuracy"] for lr in lrs]
      std = [100 * _std(per[f"{lr:g}"]["val_accuracy"]) for lr in lrs]
      ax.errorbar(lrs, mean, yerr=std, marker="o", capsize=3, label=name)
    ax.set_xscale("log")
    ax.set_xticks(lrs)
    ax.set_xticklabels([f"{lr:g}" for lr in lrs])
    ax.set_title(f"MNIST-1D, K={K}")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("mean final validation accuracy (%), ± std over seeds")
    ax.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8, loc="lower left")
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "lr_grid.png"), dpi=110)
  plt.close(fig)


def run(
  base,
  out_dir,
  run_dir,
  stage_counts=(2, 4),
  methods=METHODS,
  lrs=LRS,
  seeds=(0, 1, 2),
  epochs=120,
  workers=1,
) -> str:
  """The grid, then table.md, table.json and lr_grid.png in out_dir; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  runs = run_grid(base, out_dir, run_dir, stage_counts, methods, lrs, seeds, epochs, workers)
  summary = summarise(runs, stage_counts, methods, lrs, seeds, epochs)
  md = markdown(summary, runs, stage_counts, methods, lrs, seeds, epochs)
  with open(os.path.join(out_dir, "table.md"), "w") as fh:
    fh.write(md)
  write_json(
    os.path.join(out_dir, "table.json"),
    {
      "epochs": epochs,
      "validation_examples": VALIDATION_EXAMPLES,
      "selected_on": "validation",
      "lrs": list(lrs),
      "seeds": list(seeds),
      "stage_counts": list(stage_counts),
      "train_loss_records": TRAIN_LOSS_RECORDS,
      "results": summary,
    },
  )
  plot(summary, out_dir, stage_counts, methods, lrs)
  return md


_OUT = flags.DEFINE_string("out_dir", "results/dsp_accuracy", "Output folder (runs.json, tables, PNG).")
_RUN_DIR = flags.DEFINE_string(
  "run_dir",
  None,
  "Temporary run folders, deleted per run (default: a fresh temporary folder, so two grids never share one).",
)
_STAGES = flags.DEFINE_list("stage_counts", ["2", "4"], "Stage counts K.")
_LRS = flags.DEFINE_list("lrs", [f"{lr:g}" for lr in LRS], "The shared step-size grid.")
_WORKERS = flags.DEFINE_integer("workers", 1, "Grid points run at once, each in its own process on one core.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
_METHODS = flags.DEFINE_list(
  "methods", list(METHODS), "Methods (bp is always needed; dsp_weight_stash = method=dsp, mode=stash)."
)
_EPOCHS = flags.DEFINE_integer("epochs", None, "Epochs of every run (default: the config's).")
_DATASET = flags.DEFINE_enum("dataset", "mnist1d", ["mnist1d"], "Dataset (model cnn1d).")


def main(argv):
  del argv
  quiet_library_logs()  # orbax's per-checkpoint INFO lines
  config = dsp_config.get_config(f"dataset={_DATASET.value},model=cnn1d")
  config.validation_examples = VALIDATION_EXAMPLES
  config.checkpoint_every = 0  # a grid run is never resumed: its folder is deleted once read
  epochs = _EPOCHS.value or config.num_epochs
  methods = tuple(_METHODS.value)
  if "bp" not in methods:
    raise app.UsageError("--methods must include bp (the reference)")
  print(
    run(
      config,
      _OUT.value,
      _RUN_DIR.value or tempfile.mkdtemp(prefix="dsp_accuracy_"),
      stage_counts=tuple(int(k) for k in _STAGES.value),
      methods=methods,
      lrs=tuple(float(l) for l in _LRS.value),
      seeds=tuple(int(s) for s in _SEEDS.value),
      epochs=epochs,
      workers=_WORKERS.value,
    )
  )


if __name__ == "__main__":
  app.run(main)

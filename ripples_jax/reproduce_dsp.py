"""DSP against its baselines: accuracy, modeled speed, memory, stragglers, and a staleness x lr sweep."""
import copy
import json
import os
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ripples_jax import train_dsp  # noqa: E402
from ripples_jax.benchmark import markdown_table  # noqa: E402
from ripples_jax.pipeline import timing  # noqa: E402

METHODS = ("bp", "gpipe", "ddg", "fr", "dni", "dsp")


def _run(base, out_dir, name, **overrides):
  config = copy.deepcopy(base)
  config.unlock()
  for k, v in overrides.items():
    node = config
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  workdir = os.path.join(out_dir, name)
  shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: metrics.jsonl is appended to
  try:
    summary = train_dsp.train_and_evaluate(config, workdir)
  except FloatingPointError as e:  # a diverged run is a result, not the end of the experiment
    summary = json.load(open(os.path.join(workdir, "config.json")))
    summary.update(diverged=str(e), final_test_accuracy=float("nan"), final_train_loss=float("nan"),
                   modeled_speedup_vs_bp=float("nan"), stage_forward_s=None, stage_backward_s=None,
                   stored_bytes=None, staleness=None, time=float("nan"))
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return summary, records


def run(base, out_dir: str, datasets=("mnist1d", "digits"), stage_counts=(2, 4), methods=METHODS,
        sweep_delays=(0, 1, 2), sweep_lrs=(0.01, 0.02, 0.05), sweep_epochs=40) -> str:
  os.makedirs(out_dir, exist_ok=True)
  models = {"mnist1d": "cnn1d", "digits": "cnn2d", "cifar10": "resnet20", "synthetic": "mlp"}
  results, curves = {}, {}
  for ds in datasets:
    for K in stage_counts:
      for m in methods:
        s, recs = _run(base, out_dir, f"{ds}_K{K}_{m}", dataset=ds, model=models[ds], num_stages=K, method=m)
        results[ds, K, m] = s
        curves[ds, K, m] = [(r["epoch"], r["modeled_time"], r["test_accuracy"]) for r in recs
                            if "test_accuracy" in r]
  rows = []
  for (ds, K, m), s in results.items():
    bp = results[ds, K, "bp"]["final_test_accuracy"]
    f, b = s["stage_forward_s"], s["stage_backward_s"]
    eq = timing.speedup_vs_bp(m, [1.0] * K, [2.0] * K, microbatches=base.microbatches)
    stored = ("/".join(f"{(x['inputs'] + x['param_versions'] + x['params']) / 1024:.0f}"
                       for x in s["stored_bytes"]) if s["stored_bytes"] else "-")
    rows.append([ds, K, m, f"{100 * s['final_test_accuracy']:.1f}%",
                 f"{100 * (s['final_test_accuracy'] - bp):+.1f}", f"{s['modeled_speedup_vs_bp']:.2f}",
                 f"{eq:.2f}", stored, str(s["staleness"] or "-"), f"{s['time']:.0f}"])
  main = markdown_table(["dataset", "K", "method", "final test acc", "vs BP (points)",
                         "modeled speedup (measured stages)", "modeled speedup (equal stages)",
                         "stored KB per stage (inputs + versions + params)", "staleness S_k", "wall s"], rows)

  # Stragglers: the timing model on the measured stage times of MNIST-1D K=4 (or the first case).
  key = (datasets[0], max(stage_counts), "dsp")
  f, b = results[key]["stage_forward_s"], results[key]["stage_backward_s"]
  eq_f, eq_b = [1.0] * len(f), [2.0] * len(f)
  srows = []
  for label, ff, bb in (("measured stages", f, b), ("equal stages (B=2F)", eq_f, eq_b)):
    for case, kw in (("stage 1 slowed 3x", dict(straggler_stage=1, slowdown=3.0)),
                     ("every stage 3x with p=0.1", dict(random_p=0.1, slowdown=3.0))):
      rep = timing.straggler_report(ff, bb, microbatches=base.microbatches, **kw)
      for m in methods:
        r = rep[m]
        srows.append([label, case, m, f"{r['ratio']:.2f}", f"{r['speedup']:.2f}"])
  stragglers = markdown_table(["stage times", "straggler", "method", "iteration slowdown",
                               "speedup over BP (with straggler)"], srows)

  # Staleness x step size: final training loss (the bound grows with both).
  sweep, losses = [], {}
  for d in sweep_delays:
    for lr in sweep_lrs:
      s, recs = _run(base, out_dir, f"sweep_d{d}_lr{lr}", dataset=datasets[0], model=models[datasets[0]],
                     num_stages=max(stage_counts), method="dsp", delay=d, **{"optimizer.lr": lr},
                     num_epochs=sweep_epochs)
      losses[d, lr] = s["final_train_loss"]
      sweep.append([d, lr, str(s["staleness"]), f"{s['final_train_loss']:.4f}",
                    f"{100 * s['final_test_accuracy']:.1f}%"])
  sweep_md = markdown_table(["delay d", "lr", "staleness S_k", "final train loss", "final test acc"], sweep)
  _plots(out_dir, curves, datasets, stage_counts, methods, losses, sweep_delays, sweep_lrs)
  md = "\n\n".join([main, stragglers, sweep_md])
  with open(os.path.join(out_dir, "table.md"), "w") as fh:
    fh.write(md + "\n")
  return md


def _plots(out_dir, curves, datasets, stage_counts, methods, losses, delays, lrs):
  panels = [(ds, K) for ds in datasets for K in stage_counts]
  for xi, xlabel, fname in ((0, "epoch", "accuracy_vs_epoch.png"),
                            (1, "modeled time (s, measured stage times)", "accuracy_vs_modeled_time.png")):
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (ds, K) in zip(axes[0], panels):
      for m in methods:
        pts = curves[ds, K, m]
        if pts:
          ax.plot([p[xi] for p in pts], [100 * p[2] for p in pts], marker=".", label=m)
      ax.set_title(f"{ds}, K={K}")
      ax.set_xlabel(xlabel)
      ax.set_ylabel("test accuracy (%)")
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, fname), dpi=110)
    plt.close(fig)
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for d in delays:
    ax.plot(lrs, [losses[d, lr] for lr in lrs], marker="o", label=f"delay d={d}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("learning rate")
  ax.set_ylabel("final training loss")
  ax.set_title("DSP, K=4: final loss against staleness and step size")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "staleness_lr_sweep.png"), dpi=110)
  plt.close(fig)

r"""DSP and its baselines on MNIST-1D and digits (CIFAR-10 with --cifar_dir), K in {2, 4}.

  python -m experiments.reproduce_dsp --out_dir=runs/reproduce_dsp
  python -m experiments.reproduce_dsp --epochs=2 --sweep_epochs=1 --datasets=mnist1d   # quick

Writes table.md (accuracy, modeled speedup, stored bytes, stragglers, staleness x lr sweep) and PNGs.
"""

import os

from absl import app, flags

from configs import dsp as dsp_config
from ripples_jax import analysis
from ripples_jax import run as run_lib
from ripples_jax.pipeline import timing
from ripples_jax.tables import markdown_table

METHODS = ("bp", "gpipe", "ddg", "fr", "dni", "dsp")


def run(
  base,
  out_dir: str,
  datasets=("mnist1d", "digits"),
  stage_counts=(2, 4),
  methods=METHODS,
  sweep_delays=(0, 1, 2),
  sweep_lrs=(0.01, 0.02, 0.05),
  sweep_epochs=40,
) -> str:
  """Every (dataset, K, method), the straggler model and the staleness x lr sweep; writes table.md and
  PNGs into out_dir; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  models = {"mnist1d": "cnn1d", "digits": "cnn2d", "cifar10": "resnet20", "synthetic": "mlp"}
  results, curves = {}, {}
  for ds in datasets:
    for K in stage_counts:
      for m in methods:
        s, recs = run_lib.run_fresh(
          base, out_dir, f"{ds}_K{K}_{m}", dataset=ds, model=models[ds], num_stages=K, method=m
        )
        results[ds, K, m] = s
        curves[ds, K, m] = [
          (r["epoch"], r["modeled_time"], r["test_accuracy"]) for r in recs if "test_accuracy" in r
        ]
  rows = []
  for (ds, K, m), s in results.items():
    bp = results[ds, K, "bp"]["final_test_accuracy"]
    f, b = s["stage_forward_s"], s["stage_backward_s"]
    eq = timing.speedup_vs_bp(m, [1.0] * K, [2.0] * K, microbatches=base.microbatches)
    stored = (
      "/".join(f"{(x['inputs'] + x['param_versions'] + x['params']) / 1024:.0f}" for x in s["stored_bytes"])
      if s["stored_bytes"]
      else "-"
    )
    rows.append(
      [
        ds,
        K,
        m,
        f"{100 * s['final_test_accuracy']:.1f}%",
        f"{100 * (s['final_test_accuracy'] - bp):+.1f}",
        f"{s['modeled_speedup_vs_bp']:.2f}",
        f"{eq:.2f}",
        stored,
        str(s["staleness"] or "-"),
        f"{s['time']:.0f}",
      ]
    )
  main_table = markdown_table(
    [
      "dataset",
      "K",
      "method",
      "final test acc",
      "vs BP (points)",
      "modeled speedup (measured stages)",
      "modeled speedup (equal stages)",
      "stored KB per stage (inputs + versions + params)",
      "staleness S_k",
      "wall s",
    ],
    rows,
  )

  # Stragglers: the timing model on the measured stage times of MNIST-1D K=4 (or the first case).
  key = (datasets[0], max(stage_counts), "dsp")
  f, b = results[key]["stage_forward_s"], results[key]["stage_backward_s"]
  eq_f, eq_b = [1.0] * len(f), [2.0] * len(f)
  srows = []
  for label, ff, bb in (("measured stages", f, b), ("equal stages (B=2F)", eq_f, eq_b)):
    for case, kw in (
      ("stage 1 slowed 3x", dict(straggler_stage=1, slowdown=3.0)),
      ("every stage 3x with p=0.1", dict(random_p=0.1, slowdown=3.0)),
    ):
      rep = timing.straggler_report(ff, bb, microbatches=base.microbatches, **kw)
      for m in methods:
        r = rep[m]
        srows.append([label, case, m, f"{r['ratio']:.2f}", f"{r['speedup']:.2f}"])
  stragglers = markdown_table(
    ["stage times", "straggler", "method", "iteration slowdown", "speedup over BP (with straggler)"], srows
  )

  # Staleness x step size: final training loss (the bound grows with both).
  sweep, losses = [], {}
  for d in sweep_delays:
    for lr in sweep_lrs:
      s, recs = run_lib.run_fresh(
        base,
        out_dir,
        f"sweep_d{d}_lr{lr}",
        dataset=datasets[0],
        model=models[datasets[0]],
        num_stages=max(stage_counts),
        method="dsp",
        delay=d,
        **{"optimizer.lr": lr},
        num_epochs=sweep_epochs,
      )
      losses[d, lr] = s["final_train_loss"]
      sweep.append(
        [d, lr, str(s["staleness"]), f"{s['final_train_loss']:.4f}", f"{100 * s['final_test_accuracy']:.1f}%"]
      )
  sweep_md = markdown_table(["delay d", "lr", "staleness S_k", "final train loss", "final test acc"], sweep)
  analysis.dsp_figures(out_dir, curves, datasets, stage_counts, methods, losses, sweep_delays, sweep_lrs)
  md = "\n\n".join([main_table, stragglers, sweep_md])
  with open(os.path.join(out_dir, "table.md"), "w") as fh:
    fh.write(md + "\n")
  return md


_OUT = flags.DEFINE_string("out_dir", "runs/reproduce_dsp", "Output folder.")
_EPOCHS = flags.DEFINE_integer("epochs", 120, "Epochs per run.")
_SWEEP_EPOCHS = flags.DEFINE_integer("sweep_epochs", 40, "Epochs per staleness x lr sweep run.")
_DATASETS = flags.DEFINE_list("datasets", ["mnist1d", "digits"], "Datasets (cifar10 needs --cifar_dir).")
_STAGES = flags.DEFINE_list("stages", ["2", "4"], "Stage counts K.")
_METHODS = flags.DEFINE_list("methods", list(METHODS), "Methods (bp is always needed).")
_CIFAR = flags.DEFINE_string("cifar_dir", "", "A local CIFAR-10 python-batches directory.")
_DELAYS = flags.DEFINE_list("sweep_delays", ["0", "1", "2"], "Link delays d of the sweep.")
_LRS = flags.DEFINE_list("sweep_lrs", ["0.01", "0.02", "0.05"], "Learning rates of the sweep.")


def main(argv):
  del argv
  config = dsp_config.get_config(f"epochs={_EPOCHS.value}")
  config.data_dir = _CIFAR.value
  print(
    run(
      config,
      _OUT.value,
      datasets=tuple(_DATASETS.value),
      stage_counts=tuple(int(k) for k in _STAGES.value),
      methods=tuple(_METHODS.value),
      sweep_epochs=_SWEEP_EPOCHS.value,
      sweep_delays=tuple(int(d) for d in _DELAYS.value),
      sweep_lrs=tuple(float(l) for l in _LRS.value),
    )
  )


if __name__ == "__main__":
  app.run(main)

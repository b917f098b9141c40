r"""DSP and its baselines on MNIST-1D and digits (CIFAR-10 with --cifar_dir), K in {2, 4}.

  python -m experiments.reproduce_dsp --out_dir=runs/reproduce_dsp
  python -m experiments.reproduce_dsp --epochs=2 --sweep_epochs=1 --datasets=mnist1d   # quick

Writes table.md (accuracy, modeled speedup, stored bytes, stragglers, staleness x lr sweep) and PNGs.
"""
from absl import app, flags

from configs import dsp as dsp_config
from ripples_jax.reproduce_dsp import METHODS, run

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
  print(run(config, _OUT.value, datasets=tuple(_DATASETS.value), stage_counts=tuple(int(k) for k in _STAGES.value),
            methods=tuple(_METHODS.value), sweep_epochs=_SWEEP_EPOCHS.value,
            sweep_delays=tuple(int(d) for d in _DELAYS.value), sweep_lrs=tuple(float(l) for l in _LRS.value)))


if __name__ == "__main__":
  app.run(main)

r"""Model-parallel pipeline training: DSP and its baselines (bp, gpipe, ddg, fr, dni).

  python -m experiments.train_dsp --config=configs/dsp.py --workdir=runs/dsp
  python -m experiments.train_dsp --config=configs/dsp.py:method=gpipe,num_stages=4

A rerun with the same --workdir resumes from its newest checkpoint. --jax_distributed initializes the
multi-process runtime like every entry point, but a pipeline runs inside one process (its stages on that
process's devices), so more than one process is refused with a message.
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import distributed_flags
from ripples_jax.platform import force_host_devices

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "dsp.py"),
    "Config file, optionally with ':k=v,...' variant arguments.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: a fresh folder under runs/).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "CPU devices to force when running on the host.")


def main(argv):
  del argv
  force_host_devices(_CPU_DEVICES.value)
  from ripples_jax import train_dsp
  from ripples_jax.data import DatasetError
  from ripples_jax.validation import ConfigError
  distributed_flags.maybe_initialize()
  try:
    s = train_dsp.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, DatasetError) as e:  # bad input: one line, no traceback
    sys.exit(f"error: {e}")
  print(f"method={s['method']} K={s['num_stages']} final_test_accuracy={100 * s['final_test_accuracy']:.2f}% "
        f"modeled_speedup_vs_bp={s['modeled_speedup_vs_bp']:.2f} time={s['time']:.1f}s")
  print(f"run files: {os.path.abspath(s['workdir'])}")


if __name__ == "__main__":
  app.run(main)

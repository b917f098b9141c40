r"""Decentralized training (Ripples / All-Reduce) on every device JAX sees.

  python -m experiments.train                                   # configs/default.py, runs/<time>/
  python -m experiments.train --config=configs/default.py:algorithm=allreduce --workdir=runs/ar
  python -m experiments.train --config.num_steps=100 --config.optimizer.lr=0.1

With no accelerator, 8 CPU devices are forced (--cpu_devices). On a pod pass --jax_distributed (the
coordinator, process count and id come from the flags below or from what JAX detects: SLURM, TPU pods).
The asynchronous runtime (executor=async) runs one process per worker; locally:
  python -m experiments.launch --num_processes=4 -- --config=configs/default.py:executor=async,num_workers=4
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import distributed_flags
from ripples_jax.platform import force_host_devices

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "default.py"),
    "Config file, optionally with ':k=v,...' variant arguments.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: a fresh folder under runs/).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "CPU devices to force when running on the host.")


def main(argv):
  del argv
  # Must happen before jax is imported: the host platform reads it once.
  force_host_devices(_CPU_DEVICES.value)
  from ripples_jax import metrics, train
  from ripples_jax.data import DatasetError
  from ripples_jax.validation import ConfigError

  distributed_flags.maybe_initialize()
  try:
    summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, DatasetError) as e:  # bad input: one line, no traceback
    sys.exit(f"error: {e}")
  if "final_test_accuracy" not in summary:  # an asynchronous worker other than process 0
    print(f"worker {summary['worker']}: {summary['worker_steps']} local steps")
    return
  print(metrics.summary_table([summary]))
  print(f"run files: {os.path.abspath(summary['workdir'])}")


if __name__ == "__main__":
  app.run(main)

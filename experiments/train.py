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

from absl import app

from ripples_jax import run, runlog

from . import common_flags

_CONFIG = common_flags.config_flag("default.py")


def main(argv):
  del argv
  common_flags.set_up_host(_CONFIG.value)
  summary = common_flags.run_or_exit(run.train_and_evaluate, _CONFIG.value, common_flags.WORKDIR.value)
  if "final_test_accuracy" not in summary:  # an asynchronous worker other than process 0
    print(f"worker {summary['worker']}: {summary['worker_steps']} local steps")
    return
  print(runlog.summary_table([summary]))
  print(f"run files: {os.path.abspath(summary['workdir'])}")


def cli():  # the console script (pyproject [project.scripts])
  app.run(main, flags_parser=common_flags.parse_flags)


if __name__ == "__main__":
  app.run(main, flags_parser=common_flags.parse_flags)

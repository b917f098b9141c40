r"""Model-parallel pipeline training: DSP and its baselines (bp, gpipe, ddg, fr, dni).

  python -m experiments.train_dsp --config=configs/dsp.py --workdir=runs/dsp
  python -m experiments.train_dsp --config=configs/dsp.py:method=gpipe,num_stages=4

A rerun with the same --workdir resumes from its newest checkpoint. --jax_distributed initializes the
multi-process runtime like every entry point, but a pipeline runs inside one process (its stages on that
process's devices), so more than one process is refused with a message.
"""
import os

from absl import app

from . import common_flags
from ripples_jax.pipeline import train

_CONFIG = common_flags.config_flag("dsp.py")


def main(argv):
  del argv
  common_flags.set_up_host()
  s = common_flags.run_or_exit(train.train_and_evaluate, _CONFIG.value, common_flags.WORKDIR.value)
  print(f"method={s['method']} K={s['num_stages']} final_test_accuracy={100 * s['final_test_accuracy']:.2f}% "
        f"modeled_speedup_vs_bp={s['modeled_speedup_vs_bp']:.2f} time={s['time']:.1f}s")
  print(f"run files: {os.path.abspath(s['workdir'])}")


def cli():  # the console script (pyproject [project.scripts])
  app.run(main, flags_parser=common_flags.parse_flags)


if __name__ == "__main__":
  app.run(main, flags_parser=common_flags.parse_flags)

r"""Model-parallel pipeline training: DSP and its baselines (bp, gpipe, ddg, fr, dni).

  python -m experiments.train_dsp --config=configs/dsp.py --workdir=runs/dsp
  python -m experiments.train_dsp --config=configs/dsp.py:method=gpipe,num_stages=4

  # one process per stage (pipeline/per_process.py): the launcher starts K of this entry point
  python -m experiments.launch --num_processes=2 --module=experiments.train_dsp -- \
      --config=configs/dsp.py:method=dsp,num_stages=2 --config.placement=per_process --workdir=runs/dsp_mp

A rerun with the same --workdir resumes from its newest checkpoint. With --jax_distributed and more
than one process, placement=per_process is the only placement allowed (one process per stage).
"""

import os

from absl import app

from ripples_jax import run, runlog

from . import common_flags

_CONFIG = common_flags.config_flag("dsp.py")


def main(argv):
  del argv
  common_flags.set_up_host()
  s = common_flags.run_or_exit(run.train_and_evaluate, _CONFIG.value, common_flags.WORKDIR.value)
  if "stage" in s:  # a pipeline stage process other than the last (the run's lead) prints its own line
    print(f"method={s['method']} stage={s['stage']} done time={s['time']:.1f}s")
    return
  if "replicas" in s:  # the hybrid (replicas.count > 0): virtual time, the groups it averaged
    clock = "wall" if "placement" in s else "virtual"  # placement=devices runs on the wall clock
    print(
      f"hybrid {s['algorithm']} R={s['replicas']} K={s['num_stages']} {s['method']}: test accuracy "
      f"{100 * s['final_test_accuracy']:.2f}%, {s['time']:.1f} {clock} s, {s['groups']} groups"
    )
  else:
    print(runlog.pipeline_table([s]))  # the layout of experiments.train's table
  print(f"run files: {os.path.abspath(s['workdir'])}")


def cli():  # the console script (pyproject [project.scripts])
  app.run(main, flags_parser=common_flags.parse_flags)


if __name__ == "__main__":
  app.run(main, flags_parser=common_flags.parse_flags)

r"""Merges an asynchronous run's trace-<worker>.jsonl files into a Gantt chart (the simulator's chart).

python -m experiments.gantt --workdir=runs/async --t_max=5
"""

from absl import app, flags

from ripples_jax.runtime.trace import write_gantt

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder.", required=True)
_OUT = flags.DEFINE_string("out", None, "PNG path (default: WORKDIR/gantt.png).")
_T_MAX = flags.DEFINE_float("t_max", None, "Show only the first t_max seconds.")


def main(argv):
  del argv
  print(write_gantt(_WORKDIR.value, _OUT.value, t_max=_T_MAX.value))


if __name__ == "__main__":
  app.run(main)

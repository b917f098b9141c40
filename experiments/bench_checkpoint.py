r"""Checkpoint overhead of the default run at the default interval (target: under 5% of run time).

  python -m experiments.bench_checkpoint --reps=2
"""
from absl import app, flags

from ripples_jax.platform import force_host_devices, write_table

_REPS = flags.DEFINE_integer("reps", 2, "Runs per variant (interleaved).")
_STEPS = flags.DEFINE_integer("steps", 0, "num_steps (0: the default run's).")
_OUT = flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def main(argv):
  del argv
  force_host_devices(8)
  from configs import default as default_config
  from ripples_jax.bench_checkpoint import run
  config = default_config.get_config()
  if _STEPS.value:
    config.num_steps = _STEPS.value
    config.checkpoint_every = max(1, _STEPS.value // 4)
  write_table(run(config, _REPS.value), _OUT.value)


if __name__ == "__main__":
  app.run(main)

"""train_and_evaluate(config, workdir): validates, then hands the run to its executor.

  spmd   lockstep rounds on the device mesh (ripples_jax/spmd.py)
  sim    the discrete-event clock, then exact numerics (ripples_jax/sim.py)
  async  one process per worker on jax.distributed (ripples_jax/runtime/)
The pipeline executor (DSP) has its own config and entry: ripples_jax/pipeline/train.py.
"""
import jax

from ripples_jax.config import validate_train_config


def train_and_evaluate(config, workdir: str | None = None) -> dict:
  """Runs the config; returns its summary (summary.json's dict) on process 0."""
  # Before anything loads or compiles: a bad value stops the run with one line.
  validate_train_config(config, jax.device_count(), jax.process_count(), jax.local_device_count())
  if config.executor == "async":
    from ripples_jax.runtime import worker
    return worker.run(config, workdir)
  if config.executor == "sim":
    from ripples_jax import sim
    return sim.simulate_and_train(config, workdir)[0]
  from ripples_jax import spmd
  return spmd.train(config, workdir)

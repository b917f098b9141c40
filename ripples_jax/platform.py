"""Host set-up before the first device use: forced CPU devices, jax.distributed."""
import os

import jax
from absl import logging


def use_cpu_devices(count: int) -> None:
  """Gives the CPU backend `count` devices (accelerators are unaffected).

  Call before the first device use. XLA_FLAGS's --xla_force_host_platform_device_count, when set (the
  tests' conftest, the local launcher, users), takes precedence; so does a backend already started.
  """
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError as e:  # the backend is already up: its device count stands
    logging.warning("cpu devices: keeping %d (%s)", jax.device_count(), str(e).splitlines()[0][:80])


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_ids=None) -> None:
  """jax.distributed.initialize(); unset arguments are resolved by JAX (SLURM, TPU pods, env vars).

  CPU processes talk through gloo (the default CPU backend has no cross-process collectives).
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  ids = [int(i) for i in local_device_ids] if local_device_ids else None
  jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=ids)


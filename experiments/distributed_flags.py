"""The multi-process flags every training entry point shares (--jax_distributed and its arguments)."""
from absl import flags

from ripples_jax.platform import init_distributed

_JAX_DISTRIBUTED = flags.DEFINE_bool("jax_distributed", False, "Call jax.distributed.initialize().")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (default: JAX's).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (default: JAX's).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id (default: JAX's).")
_LOCAL_DEVICE_IDS = flags.DEFINE_list("local_device_ids", None, "This process's GPUs (default: JAX's).")


def maybe_initialize() -> None:
  """jax.distributed.initialize() when --jax_distributed; unset arguments are left to JAX."""
  if _JAX_DISTRIBUTED.value:
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _LOCAL_DEVICE_IDS.value)

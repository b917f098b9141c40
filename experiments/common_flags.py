"""The flags every training entry point shares (workdir, CPU devices, --jax_distributed and its
arguments), and the host set-up and bad-input handling around the one library call."""
import os
import sys

from absl import flags
from ml_collections import config_flags

from ripples_jax.config import ConfigError
from ripples_jax.data import DatasetError
from ripples_jax.platform import init_distributed, use_cpu_devices

WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: a fresh folder under runs/).")
CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "CPU devices to use when running on the host.")
_JAX_DISTRIBUTED = flags.DEFINE_bool("jax_distributed", False, "Call jax.distributed.initialize().")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (default: JAX's).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (default: JAX's).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id (default: JAX's).")
_LOCAL_DEVICE_IDS = flags.DEFINE_list("local_device_ids", None, "This process's GPUs (default: JAX's).")


def config_flag(default_file: str):
  """--config: a file under configs/, optionally with ':k=v,...' variant arguments."""
  path = os.path.join(os.path.dirname(__file__), "..", "configs", default_file)
  return config_flags.DEFINE_config_file(
      "config", path, "Config file, optionally with ':k=v,...' variant arguments.", lock_config=True)


def set_up_host() -> None:
  """Forced CPU devices (before the first device use), then jax.distributed when asked."""
  use_cpu_devices(CPU_DEVICES.value)
  if _JAX_DISTRIBUTED.value:
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _LOCAL_DEVICE_IDS.value)


def run_or_exit(fn, *args):
  """fn(*args); bad input (a config value, a dataset) ends the process with one line, no traceback."""
  try:
    return fn(*args)
  except (ConfigError, DatasetError) as e:
    sys.exit(f"error: {e}")

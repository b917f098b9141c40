"""Host set-up that must happen before jax is imported (no jax import here)."""
import os


def force_host_devices(count: int) -> None:
  """Asks XLA for `count` CPU devices unless XLA_FLAGS already says how many (accelerators unaffected)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_ids=None) -> None:
  """jax.distributed.initialize(); unset arguments are resolved by JAX (SLURM, TPU pods, env vars).

  CPU processes talk through gloo (the default CPU backend has no cross-process collectives).
  """
  import jax  # only here: this module is imported before XLA_FLAGS is final
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  ids = [int(i) for i in local_device_ids] if local_device_ids else None
  jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=ids)


def write_table(table: str, path: str | None) -> None:
  """Prints a benchmark's markdown table and, with a path, saves it."""
  print(table)
  if path:
    with open(path, "w") as f:
      f.write(table + "\n")

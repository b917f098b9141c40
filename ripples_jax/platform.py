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
  Process 0's coordination service (an unauthenticated key-value store) binds where the coordinator
  address points (coord.bind_address): loopback for 127.0.0.1/localhost/::1, that interface for another
  IP address, every interface (JAX's default) for a host name; JAX_COORDINATOR_BIND_ADDRESS overrides.
  Process 0 checks the port first: a taken one ends it with one line and exit code 2 (JAX would crash).
  JAX's preemption service is off: its SIGTERM handler only logs "SIGTERM caught" and carries on, and
  nothing here uses its sync points, so SIGTERM stops a process (an async worker says why first:
  coord.SigtermStop).
  """
  import errno
  import sys
  from ripples_jax.runtime import coord
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_preemption_service", False)
  ids = [int(i) for i in local_device_ids] if local_device_ids else None
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or (coord.bind_address(address) if address else None)
  if process_id == 0 and address:
    port = coord.split_address(address)[1]
    problem = coord.port_problem(bind or f"[::]:{port}")
    if problem == errno.EADDRNOTAVAIL and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
      logging.warning("coordinator %s is not an address of this host: listening on every interface", address)
      bind = None
    elif problem:
      sys.stderr.write(f"error: coordinator port {port} ({bind or 'every interface'}) is not free: "
                       f"{os.strerror(problem)}; pick another port in --coordinator_address\n")
      sys.stderr.flush()
      sys.exit(2)
  jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=ids,
                             coordinator_bind_address=bind)

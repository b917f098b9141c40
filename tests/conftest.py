"""Forces 8 CPU devices before jax is imported anywhere in the test session."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's intra-op pool with a thread per device beside the cores' (docs/design.md 5.2): with one per
# core, collectives of 8 devices on 2 cores can deadlock. Read when the backend starts, as XLA_FLAGS.
from ripples_jax.distributed import host  # noqa: E402  (jax reads neither variable at import)

host.size_cpu_pool(8)

import pytest  # noqa: E402  (after XLA_FLAGS on purpose)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compile_counter():
  """A list that grows by one entry per XLA backend compile while the test runs."""
  import jax

  compiles = []

  def listener(name, *args, **kwargs):
    if name == BACKEND_COMPILE_EVENT:
      compiles.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  yield compiles
  jax.monitoring.unregister_event_duration_listener(listener)

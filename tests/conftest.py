"""Forces 8 CPU devices before jax is imported anywhere in the test session."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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

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

# The processes the tests start (launches, subprocess runs of the entry points) share one persistent
# compilation cache for the session: a launch's reruns and the next test's launch compile the same
# programs (measured: the corrupt-marker test's three launches, 113 s without it, 88 s with it). This
# process keeps jax's own settings, read when jax was imported above (in process the cache gained
# nothing: WORKSPACE.md section 29). The cache returns the programs XLA compiled, so every bit-exact
# comparison between runs holds.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="ripples_jax_tests_jit_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(
    JAX_COMPILATION_CACHE_DIR=_cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )

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

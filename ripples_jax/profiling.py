"""config.profile_steps = "a:b": a jax.profiler trace of steps [a, b) in WORKDIR/profile.

The trace opens in TensorBoard's profile plugin or XProf (`tensorboard --logdir WORKDIR/profile`).
Steps are the executor's own (lockstep rounds; the simulator's logged steps). Profiling changes no
numerics, so the key may differ on resume.
"""

import os

import jax
from absl import logging


def parse(spec: str) -> tuple[int, int] | None:
  """ "a:b" -> (a, b) with 0 <= a < b; "" -> None; anything else raises ValueError."""
  if not spec:
    return None
  a, b = (int(x) for x in spec.split(":"))
  if not 0 <= a < b:
    raise ValueError(spec)
  return a, b


class StepProfiler:
  """Starts the trace when step a begins and stops it when step b begins (or at close)."""

  def __init__(self, spec: str, workdir: str, is_lead: bool = True):
    self.window = parse(spec) if is_lead else None
    self.dir = os.path.join(workdir, "profile")
    self.on = False

  def step(self, step: int) -> None:
    """Call with the index of the step about to run."""
    if self.window is None:
      return
    if step == self.window[0] and not self.on:
      jax.profiler.start_trace(self.dir)
      self.on = True
    elif step >= self.window[1] and self.on:
      self.close()

  def close(self) -> None:
    if self.on:
      jax.profiler.stop_trace()
      self.on = False
      logging.info("profile of steps %d:%d written to %s", *self.window, self.dir)


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Counts XLA backend compiles while open (a context manager): `count` after, or during."""

  def __init__(self):
    self.count = 0

  def _listener(self, name, *args, **kwargs):
    if name == BACKEND_COMPILE_EVENT:
      self.count += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)

"""Measured seconds of each splittable unit of a model: what a pipeline's split balances by default.

  times_U = unit_times(split.model_units("cnn2d", 10), (32, 32, 3), batch_size=64)

Each unit's forward and backward (one jitted vjp, as a stage's backward runs it) on one batch of the
run's shape, each unit on the previous unit's output, the units timed round-robin and the median kept,
so drift on a shared machine hits every unit alike. Multiply-accumulates mislead on a CPU: a first
convolution over a wide input with few channels is cheap in MACs and expensive in time (memory-bound).
pipeline/inputs.py caches the figures once per machine and pins the split a run used in its workdir.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from ripples_jax.models import apply_model, init_model


def _unit_call(unit, params, model_state):
  """The unit's forward and backward in one program; the cotangent is ones."""

  def fb(p, x):
    out, pullback = jax.vjp(lambda p, x: apply_model(unit, p, model_state, x, train=True)[0], p, x)
    return pullback(jnp.ones_like(out))

  return jax.jit(fb)


def _unit_forward(unit, params, model_state):
  """The unit's forward alone (what a stage that recomputes runs once more in its backward)."""
  return jax.jit(lambda p, x: apply_model(unit, p, model_state, x, train=True)[0])


def unit_times(
  units, sample_shape, batch_size: int, reps: int = 15, warmup: int = 2, forward: bool = False
) -> list[float]:
  """Median seconds of each unit's forward + backward (forward=True: its forward alone) on a batch of
  `batch_size` examples."""
  x = jax.random.normal(jax.random.key(0), (batch_size,) + tuple(sample_shape), jnp.float32)
  calls = []
  make = _unit_forward if forward else _unit_call
  for i, unit in enumerate(units):
    params, model_state = init_model(unit, jax.random.key(i), x)
    calls.append((make(unit, params, model_state), params, x))
    x, _ = apply_model(unit, params, model_state, x, train=False)
  for fn, p, xi in calls:
    for _ in range(warmup):
      jax.block_until_ready(fn(p, xi))
  times = [[] for _ in calls]
  for _ in range(reps):
    for i, (fn, p, xi) in enumerate(calls):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(p, xi))
      times[i].append(time.perf_counter() - t0)
  return [float(np.median(t)) for t in times]

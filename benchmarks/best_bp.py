"""The best single-process BP a pipeline is measured against: four variants of one BP step, timed
interleaved step by step (benchmarks.pipeline and benchmarks.pipeline_devices both use it).

  bp_pinned / bp_unpinned            the whole batch, this process on one core / on every core
  bp_micro_pinned / bp_micro_unpinned M accumulated micro-batches (GPipe's numerics without the
                                     pipeline), one update

The fastest variant (median over a benchmark's repetitions) is "best BP".
"""

import os
import time

import jax
import numpy as np

from ripples_jax.distributed.host import pin_threads
from ripples_jax.optim import make_optimizer
from ripples_jax.pipeline import train as pipeline_train

BP_VARIANTS = ("bp_pinned", "bp_unpinned", "bp_micro_pinned", "bp_micro_unpinned")


def _bp_steps(config):
  """Single-process BP's step on the whole batch and on M accumulated micro-batches (one update: GPipe's
  numerics without the pipeline), each a function of the state that blocks on its result."""
  import jax.numpy as jnp

  from ripples_jax import losses
  from ripples_jax.pipeline import baselines

  stages, state, run = pipeline_train._setup(config)
  M, opt = config.microbatches, make_optimizer(config.optimizer, run["num_batches"])
  x, y = run["feed"].x(0), run["feed"].labels(0)

  def whole(state):
    state, (loss, _) = run["step"](state, x, y, 0)
    float(loss)
    return state

  def loss_fn(params_K, ms_K, x, y):
    logits, _ = baselines.compose(stages, params_K, ms_K, x, train=True)
    return losses.cross_entropy(logits, y)

  grad = jax.jit(jax.grad(loss_fn))
  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
  update = jax.jit(
    lambda state, g: baselines.update_stages(
      opt, state, jax.tree.map(lambda a: a / M, g), [st["model_state"] for st in state]
    )
  )
  xs, ys = np.split(np.asarray(x), M), np.split(np.asarray(y), M)

  def micro(state):
    p, ms = [st["params"] for st in state], [st["model_state"] for st in state]
    g = None
    for xm, ym in zip(xs, ys):
      gm = grad(p, ms, xm, ym)
      g = gm if g is None else add(g, gm)
    return jax.block_until_ready(update(state, g))

  # The whole-batch step donates its state: each variant keeps its own.
  micro_state = jax.tree.map(lambda a: jnp.array(a, copy=True), state)
  return {"bp": (whole, state), "bp_micro": (micro, micro_state)}


def time_bp_variants(config, reps: int) -> dict:
  """Median seconds of one step of each BP variant (BP_VARIANTS), the four interleaved step by step."""
  steps = _bp_steps(config)
  every = sorted(os.sched_getaffinity(0))
  states = {name: st for name, (_, st) in steps.items()}
  for name, (fn, _) in steps.items():
    for _ in range(3):  # compile, warm
      states[name] = fn(states[name])
  times = {v: [] for v in BP_VARIANTS}
  for _ in range(reps):
    for variant in BP_VARIANTS:
      name, pinned = variant.rsplit("_", 1)
      pin_threads({every[0]} if pinned == "pinned" else set(every))
      t0 = time.perf_counter()
      states[name] = steps[name][0](states[name])
      times[variant].append(time.perf_counter() - t0)
  pin_threads(set(every))
  return {k: float(np.median(v)) for k, v in times.items()}

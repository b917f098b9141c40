"""GPipe's stage programs and its order, shared by the placements that dispatch them per stage.

GPipe (M micro-batches, stage boundaries rematerialised, one update per stage after the flush) is
numerically BP on the whole batch. `baselines.make_gpipe_step` is its one-program form (placement
one_device: a scan over the micro-batches in one jitted step), the reference the others are tested
against. The per-stage forms run the programs of `stage_programs` in one order:

  forwards up     micro-batch m = 0 .. M-1, each stage's forward as its input arrives; the last stage
                  takes the micro-batch's loss and backward as it arrives (its model state chained
                  through the micro-batches in order, as the scan chains it)
  backwards down  m = 0 .. M-1 again, each stage below the last recomputing its forward on the stored
                  input with the model state that forward saw, then its vjp
  accumulation    g <- g + g_m / M, in the micro-batches' order (the scan's sum)
  the flush       one update per stage

placement=devices (devices.make_device_gpipe) runs every stage in this process; placement=per_process
(per_process.Stage.gpipe) runs one stage per process, its links carrying the micro-batches up in
order, then their gradients down in order (both ends of a link issue its transfers in one order).
"""

import jax
import jax.numpy as jnp
import optax

from ripples_jax import losses
from ripples_jax.models import apply_model


def drop(fn, index: int):
  """fn with output `index` replaced by None: stage 0's dL/d(input) is not needed, and XLA then never
  computes it (single-process BP does not either)."""

  def wrapped(*args):
    out = list(fn(*args))
    out[index] = None
    return tuple(out)

  return wrapped


def stage_programs(stage, optimizer, first: bool, last: bool, microbatches: int) -> dict:
  """GPipe's jitted programs of one stage:
    forward(p, ms, x) -> (y, ms')                                       (stages below the last)
    backward(p, ms, x, cot) -> (g_p, g_x)                               (rematerialised: forward, vjp)
    backward(p, ms, x, y) -> (g_p, g_x, ms', loss, acc)                 (the last stage)
    accumulate(g_acc, g) -> g_acc + g / M                               (g_acc donated)
    update(st, g, ms) -> st                                             (st donated)
  Stage 0's g_x is None (never computed)."""

  def forward(p, ms, x):
    return apply_model(stage, p, ms, x, train=True)

  def backward(p, ms, x, cot):
    return jax.vjp(lambda p, x: apply_model(stage, p, ms, x, train=True)[0], p, x)[1](cot)

  def loss_grad(p, ms, x, y):
    def loss_fn(p, x):
      logits, new_ms = apply_model(stage, p, ms, x, train=True)
      return losses.cross_entropy(logits, y), (new_ms, losses.accuracy(logits, y))

    (loss, (new_ms, acc)), (g_p, g_x) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(p, x)
    return g_p, g_x, new_ms, loss, acc

  def accumulate(g_acc, g):  # baselines.make_gpipe_step's sum: a + b / M, micro-batches in order
    return jax.tree.map(lambda a, b: a + b / microbatches, g_acc, g)

  def update(st, g, ms):
    updates, opt_state = optimizer.update(g, st["opt_state"], st["params"])
    return dict(st, params=optax.apply_updates(st["params"], updates), opt_state=opt_state, model_state=ms)

  bwd = loss_grad if last else backward
  return {
    "forward": jax.jit(forward),
    "backward": jax.jit(drop(bwd, 1) if first else bwd),
    "accumulate": jax.jit(accumulate, donate_argnums=0),
    "update": jax.jit(update, donate_argnums=0),
  }


def zeros_like(g):
  """The accumulator's start: the first micro-batch's gradient shape, zero (0 + g / M is the scan's)."""
  return jax.tree.map(jnp.zeros_like, g)

"""optax optimizers from config.optimizer."""

import jax
import jax.numpy as jnp
import optax
from absl import logging

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
# Adam's moment decays and epsilon where config.optimizer has no b1, b2, eps (a DSP config, a config
# from before them): optax's defaults, which are torch's, so "adam" is what optax.adam(lr) always was.
ADAM_DEFAULTS = {"b1": 0.9, "b2": 0.999, "eps": 1e-8}
LR_SCHEDULES = ("constant", "cosine")


def make_optimizer(opt, num_steps: int) -> optax.GradientTransformation:
  """optax optimizer from config.optimizer; the step count in its state is each worker's own. Weight decay
  is L2 added to the gradient (coupled) for every optimizer but adamw, whose decay is decoupled."""
  warmup = min(opt.warmup_steps, num_steps - 1)
  if warmup < opt.warmup_steps:
    logging.warning(
      "optimizer.warmup_steps=%d shortened to %d for a %d-step run", opt.warmup_steps, warmup, num_steps
    )
  if opt.lr_schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, opt.lr, warmup, num_steps)
  elif warmup:
    lr = optax.linear_schedule(0.0, opt.lr, warmup)
  else:
    lr = opt.lr
  b1, b2, eps = (float(opt.get(k, v)) for k, v in ADAM_DEFAULTS.items())
  if opt.name == "adamw":  # decoupled decay (Loshchilov & Hutter): -lr x wd x param, outside Adam's scaling
    return optax.adamw(lr, b1, b2, eps, weight_decay=opt.weight_decay)
  if opt.name == "adam":
    tx = optax.adam(lr, b1, b2, eps)
  else:
    momentum = {"sgd": None, "momentum": opt.momentum, "nesterov": opt.momentum}[opt.name]
    tx = optax.sgd(lr, momentum=momentum, nesterov=opt.name == "nesterov")
  if opt.weight_decay:
    tx = optax.chain(optax.add_decayed_weights(opt.weight_decay), tx)
  return tx


def _is_schedule(node) -> bool:
  return isinstance(node, optax.ScaleByScheduleState)


def at_schedule_step(fresh, count):
  """`fresh` optimizer state (optimizer.init: zero momentum) whose learning-rate schedule stands at
  step `count` (an array, or a state whose schedule position to keep): a rejoined worker's (docs/design.md
  3.10) schedule goes on where its own steps left it, as a restored checkpoint's would, not from its
  warm-up again while the others have decayed."""
  if any(map(_is_schedule, jax.tree.leaves(count, is_leaf=_is_schedule))):  # a state: its positions
    return jax.tree.map(
      lambda f, o: f._replace(count=o.count) if _is_schedule(f) else f, fresh, count, is_leaf=_is_schedule
    )
  return jax.tree.map(
    lambda f: f._replace(count=jnp.asarray(count, f.count.dtype)) if _is_schedule(f) else f,
    fresh,
    is_leaf=_is_schedule,
  )

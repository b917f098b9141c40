"""DiLoCo in the asynchronous runtime (Douillard et al., 2023): H local steps with the run's optimizer,
then an All-Reduce of the workers' models and the outer step (Nesterov momentum), which every worker
applies to its own copy of the global model and the outer momentum.

Invariants: every worker holds the same global model and momentum (each applies the same step to the
same mean, in the same program); the pseudo-gradient mean over w of (global - params_w) is global -
mean(params_w), so the P-Reduce's plain mean is the only collective; model state (BatchNorm
statistics) takes the mean, as the engine's OUTER does (engine.diloco_outer_step, which the replay
runs). The run ends with an outer step after its last local step, as the simulator's DiLoCo does: its
model is the global one.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


def layouts(config) -> tuple:
  """The fixed schedule's layouts (schedule.online.fixed_entry): H - 1 empty ones, then the group of
  every worker, so the entry after every H-th local step is the All-Reduce and the others are NONE."""
  everyone = (tuple(range(config.num_workers)),)
  return ((),) * (config.diloco.inner_steps - 1) + (everyone,)


def init_outer(flat0_D) -> dict:
  """The outer state on the host: the global model (the initial one) and zero momentum."""
  return {"global": np.asarray(flat0_D).copy(), "momentum": np.zeros_like(flat0_D)}


def make_outer_step(config, params, model_state):
  """Jitted outer_step(mean_D, outer) -> (flat_D, outer) on the flat layout of {"params", "model_state"}
  (ravel_pytree's): the params' entries take the outer step, the model state's the mean."""
  lr, mu = float(config.diloco.outer_lr), float(config.diloco.outer_momentum)
  ones_D, _ = ravel_pytree(
    {"params": jax.tree.map(jnp.ones_like, params), "model_state": jax.tree.map(jnp.zeros_like, model_state)}
  )
  is_param_D = ones_D > 0

  @jax.jit
  def outer_step(mean_D, outer):
    g = jnp.where(is_param_D, outer["global"] - mean_D, 0)  # the pseudo-gradient
    m = mu * outer["momentum"] + g
    new = outer["global"] - lr * (g + mu * m)  # the model state's entries stay (g and m are 0 there)
    return jnp.where(is_param_D, new, mean_D), {"global": new, "momentum": m}

  return outer_step

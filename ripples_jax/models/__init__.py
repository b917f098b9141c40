"""Model zoo plus a functional interface over plain param pytrees.

Training code keeps `params` and `model_state` as plain dicts stacked on a leading
worker axis and vmaps `apply_model` over them; the flax Module is static config,
closed over by the caller's jitted function.

  model = build_model("cnn1d", num_classes=10)
  params, state = init_model(model, jax.random.key(0), x[:1])
  logits, state = apply_model(model, params, state, x, train=True)
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ripples_jax.models.resnet import CifarResNet, ResCNN, ResNet20, ResNet56
from ripples_jax.models.simple import CNN1D, CNN2D, MLP

MODEL_NAMES = ("mlp", "mlp_gelu", "cnn1d", "cnn2d", "resnet20", "resnet56", "rescnn")

_BUILDERS = {
  "mlp": MLP,
  # Smooth activations: rounding differences stay rounding-sized along a trajectory (no ReLU kink
  # to flip), so two orders of the same computation can be compared tightly (tests/test_runtime).
  "mlp_gelu": functools.partial(MLP, activation=nn.gelu),
  "cnn1d": CNN1D,
  "cnn2d": CNN2D,
  "resnet20": ResNet20,
  "resnet56": ResNet56,
  # ResNet-20's blocks without BatchNorm, equal MACs per block: the pipeline's balanced speed model.
  "rescnn": ResCNN,
}


def build_model(name: str, num_classes: int, **kw) -> nn.Module:
  """Returns the model `name` (one of MODEL_NAMES); `kw` go to its constructor."""
  if name not in _BUILDERS:
    raise ValueError(f"Unknown model {name!r}; expected one of {MODEL_NAMES}.")
  return _BUILDERS[name](num_classes=num_classes, **kw)


def init_model(model: nn.Module, rng, sample_x) -> tuple[dict, dict]:
  """Returns (params, model_state); model_state holds non-param collections, or {}.

  `sample_x` is a batch with the real input shape (only shape/dtype matter).
  Init runs in eval mode so batch_stats start at their defaults (mean 0, var 1).
  """
  variables = dict(model.init(rng, sample_x, train=False))
  params = variables.pop("params")
  return params, variables


def apply_model(model: nn.Module, params, model_state: dict, x, train: bool) -> tuple[Any, dict]:
  """Returns (logits, new_model_state). Pure, so it can be jitted and vmapped.

  In train mode with batch_stats, BatchNorm uses batch statistics and the running
  averages come back updated; otherwise model_state is returned unchanged.
  `train` and the keys of model_state are Python-level (static) choices.
  """
  variables = {"params": params, **model_state}
  if train and "batch_stats" in model_state:
    logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    return logits, {**model_state, **updates}
  return model.apply(variables, x, train=train), model_state


def num_params(params) -> int:
  """Total number of scalars in a pytree (works on arrays and ShapeDtypeStructs)."""
  return int(sum(np.prod(a.shape) for a in jax.tree.leaves(params)))


__all__ = [
  "MODEL_NAMES",
  "build_model",
  "init_model",
  "apply_model",
  "num_params",
  "MLP",
  "CNN1D",
  "CNN2D",
  "CifarResNet",
  "ResNet20",
  "ResNet56",
]

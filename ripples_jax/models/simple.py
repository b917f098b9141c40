"""Small models: MLP, 1D CNN (MNIST-1D), 2D CNN (digits, CIFAR).

All take `train` in `__call__` (ignored here) so callers treat every model alike.
"""
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
  """Flattens the input, then ReLU dense layers and a linear classifier."""
  num_classes: int
  hidden: Sequence[int] = (256, 256)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape((x.shape[0], -1))
    for h in self.hidden:
      x = nn.relu(nn.Dense(h)(x))
    return nn.Dense(self.num_classes)(x)


class CNN1D(nn.Module):
  """MNIST-1D CNN, input (B, 40, 1) channel-last.

  Follows the reference MNIST-1D conv net (~94% test accuracy): three strided
  convs, ReLU, then one dense layer on the flattened features. Stride 2 instead of
  pooling keeps it cheap: 40 -> 20 -> 10 -> 5 positions, ~12K params.
  """
  num_classes: int
  features: Sequence[int] = (32, 32, 32)
  kernel_size: int = 5

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if x.ndim == 2:  # Accept (B, 40) too: add the channel axis.
      x = x[..., None]
    for f in self.features:
      x = nn.relu(nn.Conv(f, (self.kernel_size,), strides=(2,), padding="SAME")(x))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(self.num_classes)(x)


class CNN2D(nn.Module):
  """Small 2D CNN: [conv3x3 -> ReLU -> maxpool2] per stage, then dense -> classifier.

  Works on 8x8x1 digits (~53K params) and 32x32x3 CIFAR (~0.55M params, nearly all
  in the first dense layer, which sees the flattened 8x8x64 map).
  """
  num_classes: int
  features: Sequence[int] = (32, 64)
  hidden: int = 128

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if x.ndim == 3:  # Accept (B, H, W) grayscale too.
      x = x[..., None]
    for f in self.features:
      x = nn.relu(nn.Conv(f, (3, 3), padding="SAME")(x))
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)

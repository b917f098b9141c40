"""Small models: MLP, 1D CNN (MNIST-1D), 2D CNN (digits, CIFAR).

All take `train` in `__call__` (ignored here) so callers treat every model alike.
"""

from typing import Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
  """Flattens the input, then dense layers with `activation` (ReLU) and a linear classifier."""

  num_classes: int
  hidden: Sequence[int] = (256, 256)
  activation: Callable = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape((x.shape[0], -1))
    for h in self.hidden:
      x = self.activation(nn.Dense(h)(x))
    return nn.Dense(self.num_classes)(x)


def conv1d_patches(x, kernel_size: int, stride: int):
  """(B, L, C) -> (B, ceil(L/stride), kernel_size*C): the windows of a SAME conv.

  A Dense on these patches is a 1D conv (kernel reshaped (k, C, F) -> (k*C, F)).
  """
  length = x.shape[1]
  out = -(-length // stride)
  pad = max((out - 1) * stride + kernel_size - length, 0)
  x = jnp.pad(x, ((0, 0), (pad // 2, pad - pad // 2), (0, 0)))  # As SAME pads.
  span = (out - 1) * stride + 1
  return jnp.concatenate([x[:, i : i + span : stride] for i in range(kernel_size)], axis=-1)


class CNN1D(nn.Module):
  """MNIST-1D CNN, input (B, 40, 1) channel-last (or (B, 40)).

  Follows the reference MNIST-1D conv net (~94% test accuracy): three stride-2
  convs with ReLU, then one dense layer on the flattened features;
  40 -> 20 -> 10 -> 5 positions, ~12K params.

  Convs are written as patches + Dense (im2col). Same math and init as nn.Conv
  (lecun_normal over fan_in k*C), but under vmap over stacked workers it becomes
  a batched matmul instead of a grouped conv, and on XLA:CPU it stays fast inside
  lax.scan, where an nn.Conv train step runs ~7x slower (measured, 8 workers).
  """

  num_classes: int
  features: Sequence[int] = (32, 32, 32)
  kernel_size: int = 5
  stride: int = 2

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if x.ndim == 2:  # Accept (B, 40) too: add the channel axis.
      x = x[..., None]
    for f in self.features:
      x = nn.relu(nn.Dense(f)(conv1d_patches(x, self.kernel_size, self.stride)))
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

"""CIFAR ResNets of He et al. 2016 (Sec. 4.2): ResNet-20/32/44/56/110.

3 stages of n basic blocks with 16/32/64 channels, depth = 6n + 2. Shortcuts are
option A (as in the paper's CIFAR runs): identity, and where the shape changes,
stride-2 subsampling plus zero-padded channels, so shortcuts add no parameters.
ResNet-20 has 269,722 params (10 classes), the paper's "0.27M".
"""

import functools

import flax.linen as nn
import jax.numpy as jnp

# He-normal init for convs, as in the paper; fan_in as in common PyTorch ports.
_conv = functools.partial(
  nn.Conv, kernel_size=(3, 3), padding="SAME", use_bias=False, kernel_init=nn.initializers.he_normal()
)
# PyTorch's defaults (momentum 0.1 there == 0.9 here), to match reference runs.
_bn = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5)


def _shortcut_a(x, features: int, stride: int):
  """Option-A shortcut: subsample spatially, zero-pad new channels (no params)."""
  if stride > 1:
    x = x[:, ::stride, ::stride, :]
  pad = features - x.shape[-1]
  if pad > 0:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (pad // 2, pad - pad // 2)))
  return x


class BasicBlock(nn.Module):
  """conv-BN-ReLU-conv-BN, add shortcut, ReLU. norm=False (ResCNN): conv-ReLU-conv with biases and
  no BatchNorm, the second conv's He init scaled by `branch_scale`."""

  features: int
  stride: int = 1
  norm: bool = True
  branch_scale: float = 1.0

  @nn.compact
  def __call__(self, x, train: bool):
    if not self.norm:
      y = _conv(self.features, strides=(self.stride, self.stride), use_bias=True)(x)
      init = nn.initializers.variance_scaling(2.0 * self.branch_scale**2, "fan_in", "truncated_normal")
      y = _conv(self.features, use_bias=True, kernel_init=init)(nn.relu(y))
      return nn.relu(y + _shortcut_a(x, self.features, self.stride))
    y = _conv(self.features, strides=(self.stride, self.stride))(x)
    y = nn.relu(_bn(use_running_average=not train)(y))
    y = _conv(self.features)(y)
    y = _bn(use_running_average=not train)(y)
    return nn.relu(y + _shortcut_a(x, self.features, self.stride))


class CifarResNet(nn.Module):
  """CIFAR ResNet of the given depth; depth must be 6n + 2 (20, 32, 44, 56, 110)."""

  num_classes: int
  depth: int = 20
  widths: tuple = (16, 32, 64)

  def __post_init__(self):
    # Validate at construction so a bad depth fails before any tracing.
    if self.depth < 8 or (self.depth - 2) % 6:
      raise ValueError(f"CifarResNet depth must be 6n+2 with n >= 1, got {self.depth}.")
    super().__post_init__()

  @nn.compact
  def __call__(self, x, train: bool = False):
    n = (self.depth - 2) // 6
    x = _conv(self.widths[0])(x)
    x = nn.relu(_bn(use_running_average=not train)(x))
    for stage, width in enumerate(self.widths):
      for block in range(n):
        stride = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(width, stride)(x, train)
    x = jnp.mean(x, axis=(1, 2))  # Global average pooling.
    return nn.Dense(self.num_classes)(x)


def ResNet20(num_classes: int, **kw) -> CifarResNet:
  return CifarResNet(num_classes=num_classes, depth=20, **kw)


def ResNet56(num_classes: int, **kw) -> CifarResNet:
  return CifarResNet(num_classes=num_classes, depth=56, **kw)


class ResCNN(nn.Module):
  """A residual CNN for the pipeline's speed runs: ResNet-20's basic blocks and option-A shortcuts
  without BatchNorm, so its stages hold no model state and may chunk their calls (batch statistics
  would be per chunk).

  A stride-2 stem conv, then `blocks` blocks at each of `widths`, the first block of every width
  after the first at stride 2, global average pooling and the classifier. Halving the positions
  while doubling the width keeps every block's MACs per example equal, so the 2 x `blocks` blocks
  split evenly into K = 2 and K = 4 stages (models/split.py). Without normalisation the residual
  branches are kept small at init as Fixup does (Zhang et al. 2019): each block's second conv has
  He init scaled by (number of blocks)^-1/2.
  """

  num_classes: int
  widths: tuple = (16, 32)
  blocks: int = 4

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.relu(_conv(self.widths[0], strides=(2, 2), use_bias=True)(x))
    scale = (len(self.widths) * self.blocks) ** -0.5
    for stage, width in enumerate(self.widths):
      for block in range(self.blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(width, stride, norm=False, branch_scale=scale)(x, train)
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))

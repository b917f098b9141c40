"""A model of `ripples_jax.models` as K depth-wise pipeline stages (DSP, GPipe).

  stages = split_model("resnet20", 10, num_stages=3)
  h = x
  for k, stage in enumerate(stages):
    params, state = init_model(stage, jax.random.key(k), h)     # plain pytrees
    h, state = apply_model(stage, params, state, h, train=True)  # h ends as logits

A model is first cut into its smallest splittable *units* (`model_units`), each a
Module with `__call__(x, train)` built from the model's own layer code (the
CNN1D patch conv, the ResNet BasicBlock with its option-A shortcut, the same
initialisers). A stage is a `Stage` of consecutive units, so the K stages
together are the unsplit network: same layers, same parameter count, same init.

Each unit names its layers as the unsplit model does (`Dense_1`, `BasicBlock_4`,
...), so a stage's params are `{"units_i": {<layer name>: <the model's subtree>}}`
and `params_from_model` / `params_to_model` convert by name, not by leaf order
(flattening sorts keys, and "Dense_10" < "Dense_2").

Balancing rule. Each unit has a cost: by default its measured seconds of
forward and backward on a batch (models/profile.py; pipeline/inputs.py caches
them per machine and pins a run's split in its workdir), plus its forward again
in every stage but the last where the method recomputes its forward in the
backward (`method_costs`: DSP's recompute and fused modes, stash, GPipe's remat;
the last stage takes its loss in one pass), else (`split="macs"`)
its multiply-accumulates per example (every Dense and Conv: output positions x
kernel size, traced with `jax.eval_shape` on `sample_shape`; elementwise ops,
BatchNorm and pooling left out). MACs mislead where a layer is memory-bound (on
a CPU, CNN2D's first convolution is 15% of the MACs and half the time).
`partition` picks the contiguous split with the smallest bottleneck (most
expensive stage); among splits within `slack` (10%) of that bottleneck it takes
the one with the most cuts at ResNet stage boundaries (before each stride-2
block), then the smallest bottleneck. ResNet-20/56 at K=3 thus split exactly
into the stem + stage 1, stage 2, stage 3 + head.
"""

import functools
import math
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from ripples_jax.models import apply_model, build_model, init_model
from ripples_jax.models.resnet import BasicBlock, _bn, _conv
from ripples_jax.models.simple import conv1d_patches

# Per-example input used for the cost estimate when none is given: each model's
# natural dataset (MNIST-1D, 8x8 digits, CIFAR-10). Pass `sample_shape` otherwise.
DEFAULT_SAMPLE_SHAPES = {
  "mlp": (40, 1),
  "mlp_gelu": (40, 1),
  "cnn1d": (40, 1),
  "cnn2d": (8, 8, 1),
  "resnet20": (32, 32, 3),
  "resnet56": (32, 32, 3),
  "rescnn": (32, 32, 3),
}
# What a unit's cost is (config.split): its measured seconds (models/profile.py) or its MACs.
SPLIT_COSTS = ("measured", "macs")
# A split may be this much more expensive than the best one to cut at ResNet stage boundaries.
PREFERRED_CUT_SLACK = 0.1

# ----------------------------------------------------------------------------
# Units. `layer` is the name of the unit's layer in the unsplit model.


class DenseUnit(nn.Module):
  """Flatten, Dense, the activation (ReLU; none on the head): an MLP layer, a CNN hidden layer or head."""

  features: int
  layer: str
  relu: bool = True  # False: no activation (the head)
  activation: Callable = nn.relu  # the MLP's own (mlp_gelu: GELU)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = nn.Dense(self.features, name=self.layer)(x.reshape((x.shape[0], -1)))
    return self.activation(x) if self.relu else x


class Conv1DUnit(nn.Module):
  """One CNN1D conv: SAME patches + Dense (the model's im2col conv), ReLU."""

  features: int
  kernel_size: int
  stride: int
  layer: str

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if x.ndim == 2:  # (B, L) input, as CNN1D accepts.
      x = x[..., None]
    patches = conv1d_patches(x, self.kernel_size, self.stride)
    return nn.relu(nn.Dense(self.features, name=self.layer)(patches))


class Conv2DUnit(nn.Module):
  """One CNN2D stage: conv3x3, ReLU, maxpool 2."""

  features: int
  layer: str

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if x.ndim == 3:  # (B, H, W) grayscale, as CNN2D accepts.
      x = x[..., None]
    x = nn.relu(nn.Conv(self.features, (3, 3), padding="SAME", name=self.layer)(x))
    return nn.max_pool(x, (2, 2), strides=(2, 2))


class ResNetStem(nn.Module):
  """The CIFAR ResNet's first conv, BN, ReLU."""

  features: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = _conv(self.features, name="Conv_0")(x)
    return nn.relu(_bn(use_running_average=not train, name="BatchNorm_0")(x))


class ResNetBlock(nn.Module):
  """One BasicBlock of the ResNet (or the ResCNN: norm=False), under its name in the unsplit model."""

  features: int
  stride: int
  layer: str
  norm: bool = True
  branch_scale: float = 1.0

  @nn.compact
  def __call__(self, x, train: bool = False):
    block = BasicBlock(self.features, self.stride, self.norm, self.branch_scale, name=self.layer)
    return block(x, train)


class ResCNNStem(nn.Module):
  """The ResCNN's stride-2 stem conv (with bias), ReLU."""

  features: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    return nn.relu(_conv(self.features, strides=(2, 2), use_bias=True, name="Conv_0")(x))


class ResNetHead(nn.Module):
  """Global average pooling, then the classifier."""

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    return nn.Dense(self.num_classes, name="Dense_0")(jnp.mean(x, axis=(1, 2)))


class Stage(nn.Module):
  """Consecutive units applied in order; `train` goes to each."""

  units: Sequence[nn.Module]

  @nn.compact
  def __call__(self, x, train: bool = False):
    for unit in self.units:
      x = unit(x, train)
    return x


# ----------------------------------------------------------------------------
# Splitting.


def model_units(name: str, num_classes: int, **kw) -> list[nn.Module]:
  """The model `name` as its smallest splittable units, in order.

  `kw` go to the model's constructor (e.g. hidden=(64, 64)), whose fields then
  give the units' sizes, so defaults and validation stay the model's own.
  """
  model = build_model(name, num_classes, **kw)
  if name in ("mlp", "mlp_gelu"):
    sizes = list(model.hidden) + [num_classes]
    return [
      DenseUnit(h, f"Dense_{i}", relu=i < len(model.hidden), activation=model.activation)
      for i, h in enumerate(sizes)
    ]
  if name == "cnn1d":
    convs = [
      Conv1DUnit(f, model.kernel_size, model.stride, f"Dense_{i}") for i, f in enumerate(model.features)
    ]
    return convs + [DenseUnit(num_classes, f"Dense_{len(convs)}", relu=False)]
  if name == "cnn2d":
    convs = [Conv2DUnit(f, f"Conv_{i}") for i, f in enumerate(model.features)]
    return convs + [DenseUnit(model.hidden, "Dense_0"), DenseUnit(num_classes, "Dense_1", relu=False)]
  if name in ("resnet20", "resnet56"):
    n = (model.depth - 2) // 6
    blocks = []
    for stage, width in enumerate(model.widths):
      for block in range(n):
        stride = 2 if stage > 0 and block == 0 else 1  # As CifarResNet.
        blocks.append(ResNetBlock(width, stride, f"BasicBlock_{len(blocks)}"))
    return [ResNetStem(model.widths[0])] + blocks + [ResNetHead(num_classes)]
  if name == "rescnn":
    scale = (len(model.widths) * model.blocks) ** -0.5
    blocks = []
    for stage, width in enumerate(model.widths):
      for block in range(model.blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        blocks.append(ResNetBlock(width, stride, f"BasicBlock_{len(blocks)}", False, scale))
    return [ResCNNStem(model.widths[0])] + blocks + [ResNetHead(num_classes)]
  raise ValueError(f"model_units: no units for model {name!r}")


def max_stages(name: str, num_classes: int = 10, **kw) -> int:
  """The most stages `name` splits into: one unit each."""
  return len(model_units(name, num_classes, **kw))


def unit_costs(units: Sequence[nn.Module], sample_shape: tuple) -> list[int]:
  """Multiply-accumulates per example of each unit (Dense and Conv layers only).

  Units are traced in order with `jax.eval_shape` (no compute), each on the
  previous one's output shape; a layer costs prod(output.shape[:-1]) * kernel.size.
  """
  x = jax.ShapeDtypeStruct((1,) + tuple(sample_shape), jnp.float32)
  costs = []
  for unit in units:
    macs = []

    def count(next_fun, args, kwargs, context, macs=macs):
      y = next_fun(*args, **kwargs)
      if context.method_name == "__call__" and isinstance(context.module, (nn.Dense, nn.Conv)):
        kernel = context.module.get_variable("params", "kernel")
        macs.append(math.prod(y.shape[:-1]) * kernel.size)
      return y

    with nn.intercept_methods(count):
      x = jax.eval_shape(lambda x, u=unit: u.init_with_output(jax.random.key(0), x, train=False)[0], x)
    costs.append(int(sum(macs)))
  return costs


def method_costs(total: Sequence[float], forward: Sequence[float] | None, recomputes: bool) -> tuple:
  """(each unit's cost in a stage below the last, in the last stage) for a method: a stage below the
  last that recomputes its forward in its backward (recompute, stash and fused modes, GPipe's remat)
  runs each unit's forward twice, the last stage (its backward takes the loss in one pass) once."""
  if not recomputes or forward is None:
    return list(total), list(total)
  return [t + f for t, f in zip(total, forward)], list(total)


def partition(
  costs: Sequence[float],
  num_stages: int,
  preferred: Sequence[int] = (),
  slack: float = PREFERRED_CUT_SLACK,
  last_costs: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
  """Contiguous [start, stop) unit ranges for K stages; see the module doc for the rule.

  `preferred` are unit indices worth starting a stage at. `last_costs`: each unit's cost when it is in
  the last stage (method_costs; default `costs`). Two dynamic programs over (stages, units): the
  smallest bottleneck, then the best split within `slack` of it. Both are exact (at most a few
  thousand steps for our models).
  """
  n, K = len(costs), num_stages
  assert 1 <= K <= n, (K, n)
  prefix, last_prefix = [0.0], [0.0]
  for c, cl in zip(costs, costs if last_costs is None else last_costs):
    prefix.append(prefix[-1] + c)
    last_prefix.append(last_prefix[-1] + cl)
  # Units j..i-1 as stage k (1-based): the last stage (k == K) at its own costs.
  cost = lambda j, i, k: (last_prefix if k == K else prefix)[i] - (last_prefix if k == K else prefix)[j]

  # best[k][i]: smallest bottleneck of units 0..i-1 in k stages.
  inf = float("inf")
  best = [[inf] * (n + 1) for _ in range(K + 1)]
  best[0][0] = 0.0
  for k in range(1, K + 1):
    for i in range(k, n + 1):
      best[k][i] = min(max(best[k - 1][j], cost(j, i, k)) for j in range(k - 1, i))
  limit = best[K][n] * (1 + slack)

  # score[k][i]: (preferred cuts, -bottleneck) of the best split under `limit`. Extending
  # two prefixes by the same stage keeps their order, so the program is exact.
  preferred = set(preferred)
  score = [[None] * (n + 1) for _ in range(K + 1)]
  arg = [[0] * (n + 1) for _ in range(K + 1)]
  score[0][0] = (0, 0.0)
  for k in range(1, K + 1):
    for i in range(k, n + 1):
      for j in range(k - 1, i):
        if score[k - 1][j] is None or cost(j, i, k) > limit:
          continue
        cuts, neg_bottleneck = score[k - 1][j]
        cand = (cuts + (j > 0 and j in preferred), min(neg_bottleneck, -cost(j, i, k)))
        if score[k][i] is None or cand > score[k][i]:
          score[k][i], arg[k][i] = cand, j
  bounds, i = [n], n
  for k in range(K, 0, -1):
    i = arg[k][i]
    bounds.append(i)
  bounds = bounds[::-1]
  return list(zip(bounds[:-1], bounds[1:]))


def _preferred_cuts(units) -> list[int]:
  """ResNet stage boundaries: the units that start a stage with a stride-2 block."""
  return [i for i, u in enumerate(units) if isinstance(u, ResNetBlock) and u.stride > 1]


def split_ranges(
  name: str, units, num_stages: int, costs: Sequence[float], last_costs: Sequence[float] | None = None
) -> list[tuple[int, int]]:
  """The [start, stop) unit range of each of `num_stages` stages balancing `costs` (`last_costs` in
  the last stage: method_costs) (module doc)."""
  n = len(units)
  if num_stages < 1:
    raise ValueError(f"num_stages: {num_stages} is not allowed: {name} splits into 1 to {n} stages")
  if num_stages > n:
    raise ValueError(f"num_stages: {num_stages} is not allowed: {name} splits into at most {n} stages")
  return partition(costs, num_stages, _preferred_cuts(units), last_costs=last_costs)


def stages_of(units, ranges) -> list[Stage]:
  return [Stage(tuple(units[a:b])) for a, b in ranges]


def split_model(
  name: str, num_classes: int, num_stages: int, *, sample_shape: tuple | None = None, costs=None, **kw
) -> list[Stage]:
  """The model `name` as `num_stages` Stages balancing `costs` per unit (default: MACs; see the
  module doc).

  `sample_shape` is one example's input shape for the MAC estimate (default:
  DEFAULT_SAMPLE_SHAPES[name]); `kw` go to the model's constructor.
  """
  units = model_units(name, num_classes, **kw)
  if costs is None:
    costs = unit_costs(units, sample_shape or DEFAULT_SAMPLE_SHAPES[name])
  return stages_of(units, split_ranges(name, units, num_stages, costs))


def stage_shapes(stages, sample_x, train: bool = False) -> list[tuple]:
  """Each stage's output shape for `sample_x` (an array or ShapeDtypeStruct), no compute."""
  x = jax.ShapeDtypeStruct(tuple(sample_x.shape), sample_x.dtype)
  shapes = []
  for stage in stages:
    params, state = jax.eval_shape(functools.partial(init_model, stage, jax.random.key(0)), x)
    x, _ = jax.eval_shape(functools.partial(apply_model, stage, train=train), params, state, x)
    shapes.append(tuple(x.shape))
  return shapes


# ----------------------------------------------------------------------------
# Params of the unsplit model <-> params of the stages.


def params_from_model(name: str, model_params, stages_params) -> list[dict]:
  """The unsplit model's params laid out as the stages' (`stages_params` gives the layout).

  Works on any collection keyed like params (e.g. model_state["batch_stats"]).
  Layers are matched by name; shapes must agree.
  """
  out = []
  for k, stage in enumerate(stages_params):
    new = {}
    for unit_key, unit in stage.items():
      new[unit_key] = {layer: model_params[layer] for layer in unit}
      for layer in unit:
        want = jax.tree.map(lambda a: tuple(a.shape), unit[layer])
        got = jax.tree.map(lambda a: tuple(a.shape), model_params[layer])
        if want != got:
          raise ValueError(f"{name}: stage {k} layer {layer} has shapes {want}, the model {got}")
    out.append(new)
  return out


def params_to_model(stages_params) -> dict:
  """The inverse of `params_from_model`: the stages' layers merged under their model names."""
  return {layer: tree for stage in stages_params for unit in stage.values() for layer, tree in unit.items()}

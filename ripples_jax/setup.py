"""One set-up for every executor: data, per-worker shards, model, optimizer, from the config
(build); the pipeline's stages, batch feed and optimizer (build_pipeline), for both its placements.

Meshes are not here on purpose: each executor places workers its own way (spmd: one row of a worker
mesh per device; sim: every slot on one device; runtime: this process's devices only).
"""

import dataclasses

import ml_collections
import numpy as np
import optax
from flax import linen as nn

from ripples_jax import data as data_lib
from ripples_jax.models import build_model, split
from ripples_jax.optim import make_optimizer


@dataclasses.dataclass(frozen=True)
class Setup:
  data: dict  # load_dataset's dict: x_train, y_train, x_test, y_test, num_classes, ...
  shards: list  # per-worker index arrays into the training set
  model: nn.Module
  optimizer: optax.GradientTransformation


def build(config) -> Setup:
  """Loads the dataset, shards it over config.num_workers, builds the model and the optimizer.

  ps_async (the simulator's asynchronous parameter server) applies every worker's gradient on its
  own: n updates where synchronous data parallel makes one with the mean gradient, so its step (and
  the schedule's horizon) is scaled by n to match.
  """
  n = config.num_workers
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed)
  shards = data_lib.shard_indices(data["y_train"], n, config.data_sharding, seed=config.seed)
  model = build_model(config.model, data["num_classes"])
  if config.algorithm == "ps_async":
    opt = config.optimizer.to_dict()
    opt["lr"] /= n
    opt["warmup_steps"] *= n
    optimizer = make_optimizer(ml_collections.ConfigDict(opt), config.num_steps * n)
  else:
    optimizer = make_optimizer(config.optimizer, config.num_steps)
  return Setup(data, shards, model, optimizer)


@dataclasses.dataclass(frozen=True)
class PipelineSetup:
  """What every placement of the pipeline shares: its stages, optimizer and one batch stream."""

  stages: list  # split.split_model's stage modules
  optimizer: optax.GradientTransformation
  feed: "Feed"
  data: dict
  num_batches: int
  batches_per_epoch: int


class Feed:
  """Batch t of the one training stream (the pipeline is a single model: one shard of every index)."""

  def __init__(self, data, config, num_batches):
    self.data, self.config, self.num_batches = data, config, num_batches
    self.everything = [np.arange(len(data["y_train"]))]
    self.sample = data["x_train"][: config.batch_size]

  def indices(self, i):  # negative: warm-up, any batch (its update is masked)
    return data_lib.batch_indices(self.everything, self.config.batch_size, self.config.seed, max(i, 0))[0]

  def x(self, t):
    """Stage 0's input at tick t: batch t, zeros once every batch is in (the drain)."""
    return self.data["x_train"][self.indices(t)] if t < self.num_batches else np.zeros_like(self.sample)

  def labels(self, i):
    return self.data["y_train"][self.indices(i)]


def build_pipeline(config) -> PipelineSetup:
  """The pipeline's data, stages, batch feed and optimizer, from a configs/dsp.py config."""
  kw = dict(config.synthetic) if config.dataset == "synthetic" and "synthetic" in config else {}
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed, **kw)
  stages = split.split_model(
    config.model, data["num_classes"], config.num_stages, sample_shape=data["input_shape"]
  )
  batches_per_epoch = len(data["y_train"]) // config.batch_size
  num_batches = config.num_epochs * batches_per_epoch
  feed = Feed(data, config, num_batches)
  optimizer = make_optimizer(config.optimizer, num_batches)
  return PipelineSetup(stages, optimizer, feed, data, num_batches, batches_per_epoch)

"""One set-up for every executor: data, per-worker shards, model, optimizer, from the config.

Meshes are not here on purpose: each executor places workers its own way (spmd: one row of a worker
mesh per device; sim: every slot on one device; runtime: this process's devices only).
"""
import dataclasses

import ml_collections
from flax import linen as nn
import optax

from ripples_jax import data as data_lib
from ripples_jax.models import build_model
from ripples_jax.optim import make_optimizer


@dataclasses.dataclass(frozen=True)
class Setup:
  data: dict                       # load_dataset's dict: x_train, y_train, x_test, y_test, num_classes, ...
  shards: list                     # per-worker index arrays into the training set
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

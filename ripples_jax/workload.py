"""One set-up for every data-parallel executor: data, per-worker shards, model, optimizer, from the
config (build). The pipeline's stages, batch feed and optimizer are the pipeline package's own
(pipeline/inputs.py).

Meshes are not here on purpose: each executor places workers its own way (spmd: one row of a worker
mesh per device; sim: every slot on one device; runtime: this process's devices only).
"""

import dataclasses

import ml_collections
import optax
from flax import linen as nn

from ripples_jax import data as data_lib
from ripples_jax.models import build_model
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
  the schedule's horizon) is scaled by n to match. With ps.staleness=divide each gradient's scale
  1 / staleness takes the step's 1 / n (a gradient's staleness is n in a steady homogeneous run: Zhang
  et al.'s rule for the fixed one); the horizon is scaled still. Its optimizer is the server's, whose
  momentum is ps.server_momentum (its workers take no optimizer step).
  """
  n = config.num_workers
  kw = (
    {"num_samples": config.mnist1d_samples}
    if config.dataset == "mnist1d" and "mnist1d_samples" in config
    else {}
  )
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed, **kw)
  if config.get("validation_examples", 0):  # before sharding: held-out examples are no worker's
    data = data_lib.hold_out(data, config.validation_examples)
  shards = data_lib.shard_indices(data["y_train"], n, config.data_sharding, seed=config.seed)
  model = build_model(config.model, data["num_classes"])
  # The schedule's horizon: the run's steps, or optimizer.schedule_steps (a run that is the first
  # num_steps of a longer one's schedule, as the ledger's runtime rows are of its simulated runs).
  horizon = config.optimizer.get("schedule_steps", 0) or config.num_steps
  if config.algorithm == "ps_async":
    opt = config.optimizer.to_dict()
    if ps_staleness(config) != "divide":  # divide: lr / staleness instead, which is n when all are equal
      opt["lr"] /= n
    opt["momentum"] = server_momentum(config)
    opt["warmup_steps"] *= n
    optimizer = make_optimizer(ml_collections.ConfigDict(opt), horizon * n)
  else:
    optimizer = make_optimizer(config.optimizer, horizon)
  return Setup(data, shards, model, optimizer)


def server_momentum(config) -> float:
  """ps_async's server momentum: ps.server_momentum, or optimizer.momentum in a config from before the
  field (what the server used then)."""
  return float(config.ps.server_momentum if "ps" in config else config.optimizer.momentum)


def ps_staleness(config) -> str:
  """ps_async's server step per gradient (timeline.ps_async.STALENESS): ps.staleness, "none" in a config
  from before the field."""
  return config.ps.staleness if "ps" in config else "none"

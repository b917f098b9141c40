"""The pipeline's inputs, for every placement: its stages (the config's model split into num_stages,
balanced by measured or counted unit costs and pinned in the run's split.json), one batch stream, and
the optimizer (build_pipeline). ripples_jax/workload.py builds a data-parallel run's; this is the
pipeline package's own, so the package builds on workload.py's floor and nothing below reads it."""

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
import optax

from ripples_jax import data as data_lib
from ripples_jax.data import mnist1d
from ripples_jax.errors import ConfigError
from ripples_jax.models import profile, split
from ripples_jax.optim import make_optimizer
from ripples_jax.pipeline import methods
from ripples_jax.runlog import records
from ripples_jax.runlog.workdir import newest_meta


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


def unit_costs(config, units, num_classes: int, sample_shape, how: str) -> dict:
  """Each unit's cost for the split: how="macs", or its measured seconds (models/profile.py),
  measured once per machine and model, input and batch shape, and cached in the data cache (the first
  process to write an entry wins, so processes starting together share one)."""
  if how == "macs":
    return {"split": "macs", "costs": split.unit_costs(units, sample_shape)}
  key = {
    "parts": ["forward_backward", "forward"],  # costs, then forward (older entries: costs only)
    "model": config.model,
    "num_classes": int(num_classes),
    "sample_shape": [int(d) for d in sample_shape],
    "batch_size": int(config.batch_size),
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "jax": jax.__version__,
  }
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  path = os.path.join(mnist1d.cache_dir(None), "unit_times", f"{config.model}-{digest}.json")

  def make():
    costs = profile.unit_times(units, sample_shape, config.batch_size)
    forward = profile.unit_times(units, sample_shape, config.batch_size, forward=True)
    return dict(key, split="measured", costs=costs, forward=forward)

  return records.write_json_once(path, make)


def recomputes(config) -> bool:
  """Whether the config's method runs each stage's forward again in its backward (below the last
  stage): DSP's recompute and fused modes, stash, GPipe's remat; not the residual modes (the vjp
  kept), PipeMare's kept activations, nor a whole-model step (bp in one process, dni)."""
  return methods.recomputes(config.method, config.placement, config.mode)


def split_stages(config, num_classes: int, sample_shape, workdir: str | None = None) -> list:
  """The config's model as num_stages stages. With a workdir, the split the run first used is
  pinned there (split.json) and reused on every resume, whatever this machine measures now: a
  checkpoint's stages keep their shapes."""
  units = split.model_units(config.model, num_classes)
  pinned = os.path.join(workdir, "split.json") if workdir else None
  how = config.split
  if pinned and not os.path.exists(pinned) and newest_meta(workdir):
    how = "macs"  # a run from before splits were pinned: split by MACs, its checkpoints of those shapes

  def make():
    costs = unit_costs(config, units, num_classes, sample_shape, how)
    # Balanced for this method's work: a stage that recomputes pays each unit's forward twice.
    mine, last = split.method_costs(costs["costs"], costs.get("forward"), recomputes(config))
    ranges = split.split_ranges(config.model, units, config.num_stages, mine, last)
    return dict(
      costs,
      model=config.model,
      num_stages=config.num_stages,
      ranges=ranges,
      stage_costs=mine,
      last_costs=last,
    )

  got = records.write_json_once(pinned, make) if pinned else make()
  held = (got.get("model", config.model), len(got["ranges"]), got["ranges"][-1][1])
  if held != (config.model, config.num_stages, len(units)):
    raise ConfigError(
      f"--workdir: {pinned} holds the split of {held[0]} into {held[1]} stages, not {config.model} into "
      f"{config.num_stages}: another run's (run in another workdir, or on_config_change=new)"
    )
  return split.stages_of(units, [tuple(r) for r in got["ranges"]])


def build_pipeline(config, workdir: str | None = None) -> PipelineSetup:
  """The pipeline's data, stages, batch feed and optimizer, from a configs/dsp.py config."""
  kw = dict(config.synthetic) if config.dataset == "synthetic" and "synthetic" in config else {}
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed, **kw)
  if config.get("validation_examples", 0):
    data = data_lib.hold_out(data, config.validation_examples)
  stages = split_stages(config, data["num_classes"], data["input_shape"], workdir)
  batches_per_epoch = len(data["y_train"]) // config.batch_size
  num_batches = config.num_epochs * batches_per_epoch
  feed = Feed(data, config, num_batches)
  optimizer = make_optimizer(config.optimizer, num_batches)
  return PipelineSetup(stages, optimizer, feed, data, num_batches, batches_per_epoch)

"""One place that checks a run's config before anything is loaded or compiled.

Every problem is reported as one line: `config.<key>: <value> is not allowed: <what is>`.
"""
import math

from ripples_jax.engine import PREDUCE_IMPLS
from ripples_jax.models import MODEL_NAMES
from ripples_jax.schedule import ALGORITHMS, STATIC_LAYOUTS

DATASETS = ("mnist1d", "digits", "cifar10", "synthetic")
EXECUTORS = ("spmd",)
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam")
LR_SCHEDULES = ("constant", "cosine")
DATA_SHARDINGS = ("iid", "noniid")


class ConfigError(ValueError):
  """A config value that is not allowed; str() is the one-line message."""


def _fail(key, value, allowed):
  raise ConfigError(f"config.{key}: {value!r} is not allowed: {allowed}")


def _one_of(config, key, allowed):
  value = _get(config, key)
  if value not in allowed:
    _fail(key, value, "one of " + ", ".join(map(str, allowed)))


def _get(config, key):
  for part in key.split("."):
    config = config[part]
  return config


def _positive_int(config, key):
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    _fail(key, value, "a positive integer")


def validate_train_config(config, num_devices: int) -> None:
  """Raises ConfigError naming the first bad key of an experiments.train config."""
  _one_of(config, "algorithm", ALGORITHMS)
  _one_of(config, "executor", EXECUTORS)
  _one_of(config, "dataset", DATASETS)
  _one_of(config, "model", MODEL_NAMES)
  _one_of(config, "data_sharding", DATA_SHARDINGS)
  _one_of(config, "preduce_impl", PREDUCE_IMPLS)
  for key in ("num_workers", "batch_size", "num_steps", "log_every", "eval_every"):
    _positive_int(config, key)
  n = config.num_workers
  if n > num_devices and n % num_devices:
    _fail("num_workers", n, f"at most the {num_devices} devices or a multiple of {num_devices}")
  if config.preduce_impl == "collective" and n > num_devices:
    _fail("preduce_impl", "collective", f"needs one device per worker ({n} workers, {num_devices} devices)")
  if config.dataset == "cifar10" and not config.data_dir:
    _fail("data_dir", config.data_dir, "cifar10 needs the directory holding data_batch_1..5 and test_batch")

  opt = config.optimizer
  _one_of(config, "optimizer.name", OPTIMIZERS)
  _one_of(config, "optimizer.lr_schedule", LR_SCHEDULES)
  if not isinstance(opt.lr, (int, float)) or not math.isfinite(opt.lr) or opt.lr <= 0:
    _fail("optimizer.lr", opt.lr, "a finite number > 0")
  if not 0 <= opt.momentum < 1:
    _fail("optimizer.momentum", opt.momentum, "a number in [0, 1)")
  if opt.weight_decay < 0:
    _fail("optimizer.weight_decay", opt.weight_decay, "a number >= 0")
  if isinstance(opt.warmup_steps, bool) or not isinstance(opt.warmup_steps, int) or opt.warmup_steps < 0:
    _fail("optimizer.warmup_steps", opt.warmup_steps, "an integer >= 0")

  if config.algorithm == "ripples_static":
    _one_of(config, "schedule.layout", STATIC_LAYOUTS)
    s = config.schedule
    if s.layout == "node":
      wpn = s.workers_per_node
      if isinstance(wpn, bool) or not isinstance(wpn, int) or not 1 <= wpn <= n:
        _fail("schedule.workers_per_node", wpn, f"an integer group size in [1, num_workers={n}]")
    else:
      g = s.group_size
      if isinstance(g, bool) or not isinstance(g, int) or not 2 <= g <= n:
        _fail("schedule.group_size", g, f"an integer group size in [2, num_workers={n}]")
      m = 1
      while m < n:
        m *= g
      if m != n:
        _fail("num_workers", n, f"a power of schedule.group_size={g} for the hypercube layout")

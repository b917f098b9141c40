"""Datasets, per-worker sharding and batching, all numpy on the host.

ds = load_dataset("mnist1d")            # x_train [N, 40, 1] float32, y_train [N] int32, ...
shards = shard_indices(ds["y_train"], num_workers=8, mode="noniid")
batches = worker_batches(ds["x_train"], ds["y_train"], shards, batch_size=32, seed=0)
xb, yb = next(batches)                  # [8, 32, 40, 1], [8, 32]
"""

from ripples_jax.data._common import DatasetError, hold_out
from ripples_jax.data.cifar10 import load_cifar10
from ripples_jax.data.digits import load_digits
from ripples_jax.data.mnist1d import load_mnist1d
from ripples_jax.data.sharding import SHARD_MODES, batch_at, batch_indices, shard_indices, worker_batches
from ripples_jax.data.synthetic import make_synthetic

DATASET_NAMES = ("mnist1d", "digits", "cifar10", "synthetic")


def load_dataset(name: str, data_dir: str | None = None, seed: int = 0, **kw) -> dict:
  """{"x_train", "y_train", "x_test", "y_test", "num_classes", "input_shape"}.

  x is float32 with a trailing channel axis where the data has one, y is int32,
  input_shape excludes the batch axis. `seed` picks the digits split and the
  synthetic data; mnist1d's split is fixed by its generator (kw `gen_seed`,
  default 42 = the standard dataset) and cifar10 has a fixed split. `data_dir`:
  mnist1d cache directory, or the directory holding the CIFAR-10 batches.
  Extra keywords go to the loader (e.g. num_train=, normalize=).
  """
  if name == "mnist1d":
    return load_mnist1d(data_dir, **kw)
  if name == "digits":
    return load_digits(seed=seed, **kw)
  if name == "cifar10":
    return load_cifar10(data_dir, **kw)
  if name == "synthetic":
    return make_synthetic(seed=seed, **kw)
  raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(DATASET_NAMES)}")


__all__ = [
  "DATASET_NAMES",
  "DatasetError",
  "SHARD_MODES",
  "batch_at",
  "batch_indices",
  "hold_out",
  "load_cifar10",
  "load_dataset",
  "load_digits",
  "load_mnist1d",
  "make_synthetic",
  "shard_indices",
  "worker_batches",
]

"""sklearn's 8x8 digits: 1797 images, shipped with sklearn (no download)."""

import numpy as np

from ripples_jax.data._common import pack


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> dict:
  """Digits as (N, 8, 8, 1) in [0, 1]; the train/test split is a permutation from `seed`."""
  from sklearn.datasets import load_digits as _sk_load  # Lazy: sklearn import is slow.

  d = _sk_load()
  x = (d.data.astype(np.float32) / 16.0).reshape(-1, 8, 8, 1)  # Pixels are 0..16.
  y = d.target
  perm = np.random.default_rng(seed).permutation(len(y))
  n_test = int(round(len(y) * test_fraction))
  test, train = perm[:n_test], perm[n_test:]
  return pack(x[train], y[train], x[test], y[test], num_classes=10)

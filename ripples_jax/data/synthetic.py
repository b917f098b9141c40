"""A tiny learnable classification task for tests: Gaussian clusters around class centres."""

import math

import numpy as np

from ripples_jax.data._common import pack


def make_synthetic(
  seed: int = 0,
  num_train: int = 512,
  num_test: int = 128,
  input_shape: tuple = (16,),
  num_classes: int = 4,
  noise: float = 1.0,
) -> dict:
  """Class c is centre_c + noise * N(0, I); centres are N(0, I) in the flattened input.

  With the defaults (16 dims, noise 1) centres sit ~5.7 noise-stds apart, so a linear
  model reaches near-perfect accuracy: enough signal for training tests to show progress.
  """
  input_shape = tuple(int(d) for d in input_shape)
  rng = np.random.default_rng(seed)
  dim = math.prod(input_shape)
  centres = rng.normal(size=(num_classes, dim))

  def draw(n):
    y = rng.permutation(np.arange(n) % num_classes)  # Balanced classes.
    x = centres[y] + noise * rng.normal(size=(n, dim))
    return x.reshape((n,) + input_shape), y

  x_train, y_train = draw(num_train)
  x_test, y_test = draw(num_test)
  return pack(x_train, y_train, x_test, y_test, num_classes)

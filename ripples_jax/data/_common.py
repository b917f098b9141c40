"""Shared helpers for the dataset loaders."""

import math

import numpy as np


class DatasetError(ValueError):
  """A dataset could not be loaded; the message says what was expected."""


def problem(name: str, x, y, num_classes: int) -> str | None:
  """What is wrong with one split (`name`: train or test), or None: labels must be integers in
  0..num_classes-1, one per example, and every input finite."""
  x, y = np.asarray(x), np.asarray(y)
  if y.ndim != 1 or len(y) != len(x):
    return f"has {name} labels of shape {list(y.shape)} for {len(x)} {name} examples"
  if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
    if not np.issubdtype(y.dtype, np.floating) or not np.all(np.mod(y, 1) == 0):
      return f"has non-integer {name} labels ({y.dtype})"
  if len(y) and (y.min() < 0 or y.max() >= num_classes):
    return f"has {name} labels outside 0..{num_classes - 1} ({y.min():g}..{y.max():g})"
  if not (np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.bool_)):
    return f"has {name} inputs of dtype {x.dtype}, not numbers"
  # A float64 sum of the values is finite exactly when every value is (no float32 sum can overflow
  # it), and needs no array-sized mask.
  if np.issubdtype(x.dtype, np.inexact) and not math.isfinite(x.sum(dtype=np.float64)):
    bad = int(x.size - np.count_nonzero(np.isfinite(x)))
    return f"has {bad} non-finite {name} input values (nan or inf)"
  return None


def pack(x_train, y_train, x_test, y_test, num_classes: int, source: str = "dataset", hint: str = "") -> dict:
  """Returns the dict every loader hands back, with the agreed dtypes.

  The values are checked first (labels in range, finite inputs): a bad split raises DatasetError
  `<source> <what is wrong>[; <hint>]`, with `source` naming the file or folder read.
  """
  for name, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
    bad = problem(name, x, y, num_classes)
    if bad:
      raise DatasetError(f"{source} {bad}" + (f"; {hint}" if hint else ""))
  x_train = np.ascontiguousarray(x_train, np.float32)
  x_test = np.ascontiguousarray(x_test, np.float32)
  if x_train.shape[1:] != x_test.shape[1:]:
    raise DatasetError(
      f"{source} has train inputs {list(x_train.shape)} and test inputs "
      f"{list(x_test.shape)} (their shapes must agree)" + (f"; {hint}" if hint else "")
    )
  return {
    "x_train": x_train,
    "y_train": np.asarray(y_train, np.int32),
    "x_test": x_test,
    "y_test": np.asarray(y_test, np.int32),
    "num_classes": int(num_classes),
    "input_shape": tuple(x_train.shape[1:]),
  }


VALIDATION_SEED = 0  # one held-out set for every run seed, so a step size is chosen on the same examples


def hold_out(data: dict, num_val: int, seed: int = VALIDATION_SEED) -> dict:
  """`data` with `num_val` training examples moved to x_val / y_val (a permutation from `seed`; the
  training examples keep their order). The test set is untouched: choose on validation, report on test."""
  n = len(data["y_train"])
  if not 0 < num_val < n:
    raise DatasetError(f"validation_examples={num_val}: allowed 1..{n - 1} (the training set has {n})")
  val = np.sort(np.random.default_rng(seed).permutation(n)[:num_val])
  keep = np.setdiff1d(np.arange(n), val)
  return dict(
    data,
    x_train=data["x_train"][keep],
    y_train=data["y_train"][keep],
    x_val=data["x_train"][val],
    y_val=data["y_train"][val],
  )

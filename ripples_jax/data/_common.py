"""Shared helpers for the dataset loaders."""
import numpy as np


class DatasetError(ValueError):
  """A dataset could not be loaded; the message says what was expected."""


def pack(x_train, y_train, x_test, y_test, num_classes: int) -> dict:
  """Returns the dict every loader hands back, with the agreed dtypes."""
  x_train = np.ascontiguousarray(x_train, np.float32)
  x_test = np.ascontiguousarray(x_test, np.float32)
  if x_train.shape[1:] != x_test.shape[1:]:
    raise DatasetError(f"train/test shapes differ: {x_train.shape} vs {x_test.shape}")
  return {
      "x_train": x_train,
      "y_train": np.asarray(y_train, np.int32),
      "x_test": x_test,
      "y_test": np.asarray(y_test, np.int32),
      "num_classes": int(num_classes),
      "input_shape": tuple(x_train.shape[1:]),
  }

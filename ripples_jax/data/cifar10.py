"""CIFAR-10 from a local copy of the python-pickle batches (no download).

The batches are python pickles, and loading a pickle runs whatever code the file holds (the format's
nature, not a bug here): point config.data_dir only at a copy you trust, e.g. the official
cifar-10-python.tar.gz checked against its published checksum.
"""

import os
import pickle

import numpy as np

from ripples_jax.data._common import DatasetError, pack

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
SUBDIR = "cifar-10-batches-py"  # What the official tarball unpacks to.
EXPECTED = (
  "expected the CIFAR-10 python batches data_batch_1..5 and test_batch "
  "(pickled dicts with b'data' uint8 [N,3072] and b'labels')"
)

# Per-channel mean/std of the CIFAR-10 training set, pixels in [0, 1]. Fixed constants
# rather than statistics of the files read, so every copy (and the test split) is
# normalised identically and no statistic is taken from test data.
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32)


def _error(path: str, problem: str) -> DatasetError:
  return DatasetError(f"cifar10: {path} {problem}; {EXPECTED}")


def resolve_dir(data_dir: str | None) -> str:
  """The directory that holds the batch files: `data_dir` or its cifar-10-batches-py."""
  if data_dir is None:
    raise DatasetError(f"cifar10: no data_dir given; {EXPECTED}")
  data_dir = os.path.abspath(os.path.expanduser(data_dir))
  if not os.path.isdir(data_dir):
    raise _error(data_dir, "is not a directory")
  sub = os.path.join(data_dir, SUBDIR)
  return sub if os.path.isdir(sub) else data_dir


def read_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
  """One batch file as x (N, 32, 32, 3) uint8 and y (N,) int32."""
  try:
    with open(path, "rb") as f:
      # Pickle runs code from the file: only point data_dir at trusted data.
      d = pickle.load(f, encoding="bytes")
  except Exception as e:  # Truncated, garbage, or unreadable: all the same to the user.
    raise _error(path, f"is not a readable pickle ({type(e).__name__})") from None
  if not isinstance(d, dict):
    raise _error(path, f"holds a {type(d).__name__}, not a dict")
  # Keys are bytes under encoding="bytes"; accept str keys from re-saved copies.
  data = d.get(b"data", d.get("data"))
  labels = d.get(b"labels", d.get("labels"))
  if data is None or labels is None:
    keys = sorted(repr(k) for k in d)
    raise _error(path, f"lacks b'data' or b'labels' (keys: {', '.join(keys)})")
  try:
    data = np.asarray(data)
  except (TypeError, ValueError):  # E.g. ragged nested lists.
    raise _error(path, "has b'data' that is not an array") from None
  if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
    raise _error(path, f"has b'data' {data.dtype} {list(data.shape)}")
  try:
    labels = np.asarray(labels, np.int64).reshape(-1)
  except (TypeError, ValueError):
    raise _error(path, "has non-integer b'labels'") from None
  if len(labels) != len(data):
    raise _error(path, f"has {len(labels)} labels for {len(data)} images")
  if len(labels) and (labels.min() < 0 or labels.max() > 9):
    raise _error(path, f"has labels outside 0..9 ({labels.min()}..{labels.max()})")
  # Each row is R then G then B planes of 32x32 in row-major order: NCHW -> NHWC.
  x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return x, labels.astype(np.int32)


def load_cifar10(data_dir: str | None, normalize: bool = True) -> dict:
  """CIFAR-10 as x (N, 32, 32, 3) float32, y int32.

  normalize=True: per-channel (x/255 - MEAN) / STD. normalize=False: raw 0..255
  values as float32 (for checking the pixel layout).
  """
  root = resolve_dir(data_dir)
  missing = [f for f in TRAIN_FILES + (TEST_FILE,) if not os.path.isfile(os.path.join(root, f))]
  if missing:
    raise _error(root, f"is missing {', '.join(missing)}")
  train = [read_batch(os.path.join(root, f)) for f in TRAIN_FILES]
  x_test, y_test = read_batch(os.path.join(root, TEST_FILE))
  x_train = np.concatenate([x for x, _ in train])
  y_train = np.concatenate([y for _, y in train])

  def prep(x):
    x = x.astype(np.float32)
    return (x / 255.0 - MEAN) / STD if normalize else x

  return pack(prep(x_train), y_train, prep(x_test), y_test, num_classes=10, source=f"cifar10: {root}")

"""MNIST-1D, generated offline by the `mnist1d` package and cached as .npz.

`mnist1d.data.get_dataset` downloads a pickle from GitHub; it is never called here.
`make_dataset` builds the same data locally in a few seconds, so the first load
generates and caches it and later loads read the cache.
"""

import hashlib
import json
import os
import random
import tempfile

import numpy as np

from ripples_jax.data._common import DatasetError, pack

CACHE_ENV = "RIPPLES_JAX_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "ripples_jax")
EXPECTED = (
  f"config.data_dir (else ${CACHE_ENV}, else {DEFAULT_CACHE}) is the folder holding the "
  "generated cache mnist1d_*.npz, created and written on first use"
)


def cache_dir(data_dir: str | None = None) -> str:
  """`data_dir` if given, else $RIPPLES_JAX_CACHE (if set and not empty), else ~/.cache/ripples_jax."""
  d = data_dir if data_dir is not None else (os.environ.get(CACHE_ENV) or DEFAULT_CACHE)  # empty: unset
  return os.path.abspath(os.path.expanduser(d))


def _generator_args(num_samples: int, gen_seed: int):
  import mnist1d.data  # Lazy: pulls in scipy and matplotlib.

  args = mnist1d.data.get_dataset_args()
  args.num_samples = int(num_samples)
  args.seed = int(gen_seed)
  return args


def cache_path(data_dir: str | None = None, num_samples: int = 5000, gen_seed: int = 42) -> str:
  """Cache file for one generator configuration.

  The name spells out the args one usually changes and hashes the full arg set,
  so a different configuration (or changed package defaults) never reuses a file.
  """
  folder = cache_dir(data_dir)
  # The digest needs the package's defaults, and importing mnist1d.data costs seconds (scipy,
  # matplotlib) at every start; it is kept beside the cache, keyed by the package's version, so a
  # cached set is found without the import.
  from importlib.metadata import version

  memo = os.path.join(folder, f".mnist1d_n{num_samples}_seed{gen_seed}_v{version('mnist1d')}.digest")
  try:
    with open(memo) as f:
      digest = f.read().strip()
  except OSError:
    digest = ""
  if len(digest) != 10:
    args = dict(vars(_generator_args(num_samples, gen_seed)))
    args.pop("url", None)  # Not an input to generation.
    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
    try:
      os.makedirs(folder, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_")
      with os.fdopen(fd, "w") as f:
        f.write(digest)
      os.replace(tmp, memo)  # atomic: processes starting together read a whole digest or none
    except OSError:
      pass  # an unwritable cache folder is reported by load_mnist1d, naming the path
  return os.path.join(folder, f"mnist1d_n{num_samples}_seed{gen_seed}_{digest}.npz")


def _generate(num_samples: int, gen_seed: int) -> dict:
  import mnist1d.data

  args = _generator_args(num_samples, gen_seed)
  # make_dataset reseeds the global `random` and `np.random` generators; restore
  # them so loading data does not silently change randomness elsewhere.
  py_state, np_state = random.getstate(), np.random.get_state()
  try:
    d = mnist1d.data.make_dataset(args)
  finally:
    random.setstate(py_state)
    np.random.set_state(np_state)
  return {"x_train": d["x"], "y_train": d["y"], "x_test": d["x_test"], "y_test": d["y_test"]}


def _write_atomic(path: str, arrays: dict) -> None:
  """Writes to a temp file in the same directory, then renames it into place.

  os.replace is atomic on POSIX, so a concurrent reader sees either no file or a
  complete one, never a partial write.
  """
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp_", suffix=".npz")
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **arrays)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _error(path: str, problem: str) -> DatasetError:
  return DatasetError(f"mnist1d: {path} {problem}; {EXPECTED}")


def load_mnist1d(data_dir: str | None = None, num_samples: int = 5000, gen_seed: int = 42) -> dict:
  """MNIST-1D as x (N, 40, 1) float32 (channel-last, for a 1D CNN), y int32.

  `gen_seed` defaults to the package's own seed (42), i.e. the standard dataset;
  with the defaults this is 4000 train / 1000 test examples of 10 classes.

  A cache that does not read back as .npz is regenerated; one that reads but holds bad values
  (labels outside 0..9, non-finite inputs, wrong shapes), a cache path that is a folder or cannot be
  opened, and a cache folder that cannot be written raise DatasetError naming the path.
  """
  path = cache_path(data_dir, num_samples, gen_seed)
  folder = os.path.dirname(path)
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise _error(folder, "is a file, not a folder")
  if os.path.isdir(path):
    raise _error(path, "is a folder where the cache file goes (move it away to regenerate the cache)")
  arrays = None
  if os.path.exists(path):
    try:
      f = open(path, "rb")
    except OSError as e:
      raise _error(path, f"cannot be read ({e.strerror})") from None
    with f:
      try:
        with np.load(f) as z:
          arrays = {k: z[k] for k in ("x_train", "y_train", "x_test", "y_test")}
      except Exception:  # A damaged cache is not fatal: regenerate and overwrite it.
        arrays = None
  if arrays is None:
    arrays = _generate(num_samples, gen_seed)
    arrays = {k: v.astype(np.float32 if k.startswith("x") else np.int32) for k, v in arrays.items()}
    try:
      _write_atomic(path, arrays)
    except OSError as e:
      raise _error(path, f"cannot be written ({e.strerror})") from None
  hint = "delete it to regenerate the cache"
  for k in ("x_train", "x_test"):
    if arrays[k].ndim != 2:
      raise DatasetError(f"mnist1d: {path} has {k} of shape {list(arrays[k].shape)}, not [N, 40]; {hint}")
  return pack(
    arrays["x_train"][..., None],
    arrays["y_train"],
    arrays["x_test"][..., None],
    arrays["y_test"],
    num_classes=10,
    source=f"mnist1d: {path}",
    hint=hint,
  )

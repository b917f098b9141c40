"""Tests for ripples_jax.data: loaders, sharding, per-worker batching."""

import os
import pickle
import random

import numpy as np
import pytest

from ripples_jax import data
from ripples_jax.data import cifar10
from ripples_jax.data import mnist1d as m1d

# --- CIFAR-10 reader -------------------------------------------------------------

N_PER_FILE = 10
FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _write_cifar(root, seed=0):
  """Tiny batches in the real python-pickle format; returns {file: (data, labels)}."""
  os.makedirs(root, exist_ok=True)
  rng = np.random.default_rng(seed)
  out = {}
  for name in FILES:
    raw = rng.integers(0, 256, size=(N_PER_FILE, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, size=N_PER_FILE).tolist()
    d = {
      b"batch_label": name.encode(),
      b"labels": labels,
      b"data": raw,
      b"filenames": [f"{i}.png".encode() for i in range(N_PER_FILE)],
    }
    with open(os.path.join(root, name), "wb") as f:
      pickle.dump(d, f)
    out[name] = (raw, labels)
  return out


def test_cifar10_reads_real_layout(tmp_path):
  written = _write_cifar(tmp_path)
  ds = data.load_dataset("cifar10", data_dir=str(tmp_path), normalize=False)
  assert ds["x_train"].shape == (5 * N_PER_FILE, 32, 32, 3)
  assert ds["x_test"].shape == (N_PER_FILE, 32, 32, 3)
  assert ds["x_train"].dtype == np.float32 and ds["y_train"].dtype == np.int32
  assert ds["num_classes"] == 10 and ds["input_shape"] == (32, 32, 3)
  raw_train = np.concatenate([written[f][0] for f in FILES[:5]])
  np.testing.assert_array_equal(ds["y_train"], sum((written[f][1] for f in FILES[:5]), []))
  np.testing.assert_array_equal(ds["y_test"], written["test_batch"][1])
  # Pixel (image i, row r, col c, channel ch) is byte ch*1024 + r*32 + c of row i.
  for i, r, c, ch in [(0, 0, 0, 0), (3, 5, 7, 1), (17, 31, 30, 2), (49, 12, 0, 2)]:
    assert ds["x_train"][i, r, c, ch] == raw_train[i, ch * 1024 + r * 32 + c]
  np.testing.assert_array_equal(ds["x_train"], raw_train.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))


def test_cifar10_normalises_and_accepts_parent_dir(tmp_path):
  written = _write_cifar(tmp_path / "cifar-10-batches-py")
  ds = data.load_dataset("cifar10", data_dir=str(tmp_path))  # Parent of the batches dir.
  raw = written["test_batch"][0].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  expected = (raw / 255.0 - cifar10.MEAN) / cifar10.STD
  np.testing.assert_allclose(ds["x_test"], expected, rtol=1e-5, atol=1e-5)
  assert ds["x_test"].dtype == np.float32


def _check_clear(err, path):
  msg = str(err.value)
  assert "\n" not in msg
  assert str(path) in msg and "data_batch_1" in msg and "test_batch" in msg
  assert isinstance(err.value, ValueError)


def test_cifar10_missing_dir(tmp_path):
  with pytest.raises(ValueError) as err:
    data.load_dataset("cifar10", data_dir=str(tmp_path / "nope"))
  _check_clear(err, tmp_path / "nope")


def test_cifar10_missing_files_are_named(tmp_path):
  _write_cifar(tmp_path)
  os.remove(tmp_path / "data_batch_3")
  os.remove(tmp_path / "test_batch")
  with pytest.raises(ValueError) as err:
    data.load_dataset("cifar10", data_dir=str(tmp_path))
  _check_clear(err, tmp_path)
  assert "missing data_batch_3, test_batch" in str(err.value)


def _garbage(path):
  path.write_bytes(b"\x00\x01 this is not a pickle at all \xff" * 10)


def _wrong_keys(path):
  with open(path, "wb") as f:
    pickle.dump({b"images": np.zeros((N_PER_FILE, 3072), np.uint8), b"y": [0] * N_PER_FILE}, f)


def _wrong_shape(path):
  with open(path, "wb") as f:
    pickle.dump({b"data": np.zeros((N_PER_FILE, 1024), np.uint8), b"labels": [0] * N_PER_FILE}, f)


def _label_mismatch(path):
  with open(path, "wb") as f:
    pickle.dump({b"data": np.zeros((N_PER_FILE, 3072), np.uint8), b"labels": [0] * 3}, f)


def _not_a_dict(path):
  with open(path, "wb") as f:
    pickle.dump([1, 2, 3], f)


def _truncated(path):
  path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize(
  "corrupt", [_garbage, _wrong_keys, _wrong_shape, _label_mismatch, _not_a_dict, _truncated]
)
def test_cifar10_malformed_file(tmp_path, corrupt):
  _write_cifar(tmp_path)
  bad = tmp_path / "data_batch_2"
  corrupt(bad)
  with pytest.raises(data.DatasetError) as err:
    data.load_dataset("cifar10", data_dir=str(tmp_path))
  _check_clear(err, bad)
  assert err.value.__cause__ is None  # No pickle/numpy traceback chained onto it.


# --- MNIST-1D ---------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
  import mnist1d.data
  import requests

  def boom(*a, **k):
    raise AssertionError("network access attempted")

  monkeypatch.setattr(mnist1d.data, "get_dataset", boom)
  monkeypatch.setattr(requests, "get", boom)
  monkeypatch.setattr(requests, "request", boom)


def test_mnist1d_generates_offline_then_reads_cache(tmp_path, no_network, monkeypatch):
  from importlib.metadata import version

  np.random.seed(123)
  random.seed(123)
  ds = data.load_dataset("mnist1d", data_dir=str(tmp_path))
  # Generation reseeds global RNGs internally; the loader must restore them.
  after = (np.random.rand(), random.random())
  np.random.seed(123)
  random.seed(123)
  assert after == (np.random.rand(), random.random())

  assert ds["x_train"].shape == (4000, 40, 1) and ds["x_test"].shape == (1000, 40, 1)
  assert ds["x_train"].dtype == np.float32 and ds["y_train"].dtype == np.int32
  assert ds["num_classes"] == 10 and ds["input_shape"] == (40, 1)
  assert set(np.unique(ds["y_train"])) == set(range(10))
  path = m1d.cache_path(str(tmp_path))
  assert os.path.exists(path) and "n5000" in path and "seed42" in path
  # No temp file left behind: the cache and the digest kept for the next start.
  assert sorted(os.listdir(tmp_path)) == sorted(
    [os.path.basename(path), f".mnist1d_n5000_seed42_v{version('mnist1d')}.digest"]
  )

  def no_regen(*a, **k):
    raise AssertionError("regenerated despite cache")

  monkeypatch.setattr(m1d, "_generate", no_regen)
  again = data.load_dataset("mnist1d", data_dir=str(tmp_path))
  for k in ("x_train", "y_train", "x_test", "y_test"):
    np.testing.assert_array_equal(again[k], ds[k])
    assert again[k].dtype == ds[k].dtype


def _fake_generate(num_samples, gen_seed):
  rng = np.random.default_rng(gen_seed)
  n_train = int(num_samples * 0.8)
  return {
    "x_train": rng.normal(size=(n_train, 40)),
    "y_train": rng.integers(0, 10, n_train),
    "x_test": rng.normal(size=(num_samples - n_train, 40)),
    "y_test": rng.integers(0, 10, num_samples - n_train),
  }


def test_mnist1d_cache_location_and_key(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(m1d, "_generate", lambda n, s: calls.append((n, s)) or _fake_generate(n, s))
  monkeypatch.setenv("RIPPLES_JAX_CACHE", str(tmp_path / "env_cache"))
  a = data.load_dataset("mnist1d", num_samples=100)
  assert os.path.exists(m1d.cache_path(None, num_samples=100))
  assert m1d.cache_path(None, num_samples=100).startswith(str(tmp_path / "env_cache"))
  data.load_dataset("mnist1d", num_samples=100)
  assert calls == [(100, 42)]
  b = data.load_dataset("mnist1d", num_samples=200)  # Other args: other file, regenerated.
  data.load_dataset("mnist1d", num_samples=100, gen_seed=7)
  assert calls == [(100, 42), (200, 42), (100, 7)]
  assert len([f for f in os.listdir(tmp_path / "env_cache") if f.endswith(".npz")]) == 3
  assert a["x_train"].shape == (80, 40, 1) and b["x_train"].shape == (160, 40, 1)


def test_mnist1d_damaged_cache_is_regenerated(tmp_path, monkeypatch):
  monkeypatch.setattr(m1d, "_generate", _fake_generate)
  path = m1d.cache_path(str(tmp_path), num_samples=100)
  os.makedirs(tmp_path, exist_ok=True)
  with open(path, "wb") as f:
    f.write(b"partial")
  ds = data.load_dataset("mnist1d", data_dir=str(tmp_path), num_samples=100)
  assert ds["x_train"].shape == (80, 40, 1)
  with np.load(path) as f:
    np.testing.assert_array_equal(f["x_train"], ds["x_train"][..., 0])


# --- digits, synthetic, registry ----------------------------------------------------


def test_digits():
  ds = data.load_dataset("digits", seed=0)
  assert ds["x_train"].shape == (1438, 8, 8, 1) and ds["x_test"].shape == (359, 8, 8, 1)
  assert ds["input_shape"] == (8, 8, 1) and ds["num_classes"] == 10
  assert ds["x_train"].min() >= 0.0 and ds["x_train"].max() <= 1.0 and ds["x_train"].max() > 0.9
  assert ds["y_train"].dtype == np.int32 and set(np.unique(ds["y_train"])) == set(range(10))
  same = data.load_dataset("digits", seed=0)
  other = data.load_dataset("digits", seed=1)
  np.testing.assert_array_equal(same["x_train"], ds["x_train"])
  assert not np.array_equal(other["y_train"], ds["y_train"])


def test_synthetic_deterministic_and_learnable():
  kw = dict(num_train=400, num_test=200, input_shape=(4, 4, 1), num_classes=5)
  a = data.load_dataset("synthetic", seed=3, **kw)
  b = data.load_dataset("synthetic", seed=3, **kw)
  c = data.load_dataset("synthetic", seed=4, **kw)
  for k in ("x_train", "y_train", "x_test", "y_test"):
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["x_train"], c["x_train"])
  assert a["x_train"].shape == (400, 4, 4, 1) and a["input_shape"] == (4, 4, 1)
  assert a["num_classes"] == 5 and set(np.unique(a["y_train"])) == set(range(5))
  # Nearest class mean (fit on train) must classify the test set well.
  xtr, xte = a["x_train"].reshape(400, -1), a["x_test"].reshape(200, -1)
  means = np.stack([xtr[a["y_train"] == k].mean(0) for k in range(5)])
  pred = np.argmin(((xte[:, None] - means[None]) ** 2).sum(-1), axis=1)
  assert (pred == a["y_test"]).mean() > 0.9


def test_unknown_dataset_names_allowed():
  with pytest.raises(ValueError, match="mnist1d, digits, cifar10, synthetic"):
    data.load_dataset("imagenet")


# --- sharding -----------------------------------------------------------------------


def _labels(n=1000, classes=10, seed=0):
  return np.random.default_rng(seed).integers(0, classes, size=n)


def _assert_partition(shards, n):
  allidx = np.concatenate(shards)
  assert len(allidx) == n
  np.testing.assert_array_equal(np.sort(allidx), np.arange(n))
  assert all(len(s) > 0 for s in shards)


def test_iid_shards():
  y = _labels(1003)
  shards = data.shard_indices(y, 8, "iid", seed=0)
  assert len(shards) == 8
  _assert_partition(shards, 1003)
  sizes = [len(s) for s in shards]
  assert max(sizes) - min(sizes) <= 1
  # A random split gives every worker most classes.
  assert all(len(np.unique(y[s])) == 10 for s in shards)


@pytest.mark.parametrize("num_workers,spw", [(5, 2), (8, 2), (10, 1), (3, 3)])
def test_noniid_shards_are_skewed(num_workers, spw):
  y = _labels(1000)
  shards = data.shard_indices(y, num_workers, "noniid", seed=0, shards_per_worker=spw)
  assert len(shards) == num_workers
  _assert_partition(shards, 1000)
  for s in shards:
    # Each of the worker's spw label-sorted pieces spans at most 2 labels.
    assert len(np.unique(y[s])) <= 2 * spw < 10


def test_noniid_too_few_examples():
  with pytest.raises(ValueError, match="shards_per_worker"):
    data.shard_indices(np.arange(5), 4, "noniid", shards_per_worker=2)


def test_sharding_deterministic_under_seed():
  y = _labels(500)
  for mode in data.SHARD_MODES:
    a = data.shard_indices(y, 4, mode, seed=1)
    b = data.shard_indices(y, 4, mode, seed=1)
    c = data.shard_indices(y, 4, mode, seed=2)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not all(np.array_equal(u, v) for u, v in zip(a, c))


def test_unknown_shard_mode():
  with pytest.raises(ValueError, match="iid, noniid"):
    data.shard_indices(np.zeros(10), 2, mode="dirichlet")


# --- batching -----------------------------------------------------------------------


def _toy():
  n = 103
  x = np.arange(n, dtype=np.float32)[:, None, None] * np.ones((1, 2, 3), np.float32)
  y = np.arange(n, dtype=np.int32)  # Label == index, so batches reveal their rows.
  # Unequal shards, one smaller than the batch size.
  shards = [np.arange(0, 50), np.arange(50, 95), np.arange(95, 103)]
  return x, y, shards


def test_batches_shape_and_origin():
  x, y, shards = _toy()
  it = data.worker_batches(x, y, shards, batch_size=16, seed=0)
  for _ in range(10):
    xb, yb = next(it)
    assert xb.shape == (3, 16, 2, 3) and yb.shape == (3, 16)
    assert xb.dtype == np.float32 and yb.dtype == np.int32
    np.testing.assert_array_equal(xb[:, :, 0, 0], yb)  # x and y rows stay paired.
    for w, s in enumerate(shards):
      assert np.isin(yb[w], s).all()


def test_each_epoch_visits_shard_once_and_reshuffles():
  x, y, shards = _toy()
  b = 5  # 50 = 10 batches: worker 0's epochs end on batch boundaries.
  seen = np.concatenate([data.batch_at(x, y, shards, b, 0, k)[1][0] for k in range(20)])
  np.testing.assert_array_equal(np.sort(seen[:50]), shards[0])
  np.testing.assert_array_equal(np.sort(seen[50:]), shards[0])
  assert not np.array_equal(seen[:50], seen[50:])
  # Worker 2 (8 examples) wraps mid-batch; every 8 consecutive positions are one epoch.
  seen2 = np.concatenate([data.batch_at(x, y, shards, b, 0, k)[1][2] for k in range(8)])
  for e in range(5):
    np.testing.assert_array_equal(np.sort(seen2[8 * e : 8 * e + 8]), shards[2])


def test_batches_deterministic_and_resumable():
  x, y, shards = _toy()
  run = data.worker_batches(x, y, shards, batch_size=16, seed=7)
  full = [next(run) for _ in range(30)]
  again = data.worker_batches(x, y, shards, batch_size=16, seed=7)
  for (xa, ya), (xb, yb) in zip(full, (next(again) for _ in range(30))):
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
  resumed = data.worker_batches(x, y, shards, batch_size=16, seed=7, start_step=17)
  for k in range(17, 30):
    xr, yr = next(resumed)
    np.testing.assert_array_equal(xr, full[k][0])
    np.testing.assert_array_equal(yr, full[k][1])
    np.testing.assert_array_equal(yr, data.batch_at(x, y, shards, 16, 7, k)[1])
  other = data.worker_batches(x, y, shards, batch_size=16, seed=8)
  assert not np.array_equal(next(other)[1], full[0][1])


def test_config_mnist1d_samples_sizes_the_generated_set(tmp_path, monkeypatch):
  """configs/default.py's mnist1d_samples reaches the generator: a large run gets a large set."""
  from configs import default as default_config
  from ripples_jax import workload

  monkeypatch.setattr(m1d, "_generate", _fake_generate)
  monkeypatch.setenv("RIPPLES_JAX_CACHE", str(tmp_path))
  config = default_config.get_config("num_workers=16,model=mlp")
  config.mnist1d_samples = 2000
  s = workload.build(config)
  assert s.data["x_train"].shape == (1600, 40, 1) and sum(len(i) for i in s.shards) == 1600
  assert {len(i) for i in s.shards} == {100}  # 100 examples a worker, indices into one array


def test_an_empty_cache_variable_means_the_default_cache(monkeypatch):
  monkeypatch.setenv("RIPPLES_JAX_CACHE", "")  # not the working directory
  assert m1d.cache_dir() == os.path.abspath(os.path.expanduser(m1d.DEFAULT_CACHE))


def test_hold_out_moves_a_fixed_set_of_training_examples_to_validation():
  from ripples_jax.data import DatasetError, hold_out, make_synthetic

  d = make_synthetic(seed=3, input_shape=(4,), num_classes=3, num_train=50, num_test=10)
  h = hold_out(d, 12)
  assert len(h["y_val"]) == 12 and len(h["y_train"]) == 38
  rows = lambda x: {tuple(r) for r in x.reshape(len(x), -1)}
  # Disjoint, together exactly the training set, the training order kept, the test set untouched.
  assert not rows(h["x_val"]) & rows(h["x_train"])
  assert rows(h["x_val"]) | rows(h["x_train"]) == rows(d["x_train"])
  idx = [int(np.flatnonzero((d["x_train"] == r).all(axis=1))[0]) for r in h["x_train"]]
  assert idx == sorted(idx)
  assert np.array_equal(h["x_test"], d["x_test"]) and np.array_equal(h["y_test"], d["y_test"])
  # The same examples whatever else varies (every run seed chooses its step size on one set).
  assert np.array_equal(hold_out(d, 12)["x_val"], h["x_val"])
  with pytest.raises(
    DatasetError, match=r"^validation_examples=50: allowed 1..49 \(the training set has 50\)$"
  ):
    hold_out(d, 50)


def test_mnist1d_cache_is_found_without_importing_the_generator(tmp_path, monkeypatch):
  """The digest of the generator's arguments is kept beside the cache (per package version): a later
  start finds the same file without importing mnist1d.data (seconds of scipy and matplotlib)."""
  import sys

  first = m1d.cache_path(str(tmp_path), num_samples=123)  # computes the digest (imports the generator)
  monkeypatch.setitem(sys.modules, "mnist1d.data", None)  # any import of it now raises ImportError
  assert m1d.cache_path(str(tmp_path), num_samples=123) == first
  with pytest.raises(ImportError):
    m1d.cache_path(str(tmp_path), num_samples=124)  # another set: its digest is not kept yet


def test_an_epochs_order_is_drawn_once_and_cannot_be_changed():
  """batch_indices draws an epoch's permutation once (cached), and the cached order is read-only, so
  no caller can change the batches every later call sees."""
  from ripples_jax.data import sharding

  sharding._epoch_perm.cache_clear()
  shards = [np.arange(1000)]
  first = [sharding.batch_indices(shards, 10, 3, i) for i in range(5)]
  assert sharding._epoch_perm.cache_info().misses == 1 and sharding._epoch_perm.cache_info().hits == 4
  perm = sharding._epoch_perm(3, 0, 0, 1000)
  with pytest.raises(ValueError):
    perm[0] = -1
  np.testing.assert_array_equal(first, [sharding.batch_indices(shards, 10, 3, i) for i in range(5)])
  np.testing.assert_array_equal(perm, np.random.default_rng([1, 3, 0, 0]).permutation(1000))

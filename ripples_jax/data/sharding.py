"""Splitting the training set across workers, and per-worker batches by step.

Everything is a pure function of (seed, step): the batch of step k is computed
directly, never by replaying steps 0..k-1, so a resumed run sees exactly the
batches an uninterrupted run would have.
"""

import functools
from typing import Iterator, Sequence

import numpy as np

SHARD_MODES = ("iid", "noniid")


def shard_indices(
  y: np.ndarray, num_workers: int, mode: str = "iid", seed: int = 0, shards_per_worker: int = 2
) -> list[np.ndarray]:
  """Each worker's training-example indices (sorted); every example goes to exactly one worker.

  iid: a random permutation cut into `num_workers` pieces whose sizes differ by at most 1.
  noniid: label skew as in McMahan et al. (2017): sort by label, cut into
    num_workers * shards_per_worker contiguous pieces, and hand each worker
    `shards_per_worker` random pieces. A worker then sees about `shards_per_worker`
    classes (a piece straddling a label boundary adds one); fewer pieces means
    stronger skew. Needs len(y) >= num_workers * shards_per_worker.
  """
  y = np.asarray(y).reshape(-1)
  n = len(y)
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1, got {num_workers}")
  rng = np.random.default_rng(seed)
  if mode == "iid":
    if n < num_workers:
      raise ValueError(f"iid sharding: {n} examples cannot give {num_workers} workers one each")
    pieces = np.array_split(rng.permutation(n), num_workers)
  elif mode == "noniid":
    num_pieces = num_workers * shards_per_worker
    if shards_per_worker < 1 or n < num_pieces:
      raise ValueError(
        f"noniid sharding: need shards_per_worker >= 1 and at least "
        f"num_workers * shards_per_worker = {num_pieces} examples, got "
        f"shards_per_worker={shards_per_worker}, {n} examples"
      )
    # Shuffle first so examples of one label land in pieces in random order.
    perm = rng.permutation(n)
    by_label = perm[np.argsort(y[perm], kind="stable")]
    chunks = np.array_split(by_label, num_pieces)
    owner = rng.permutation(num_pieces).reshape(num_workers, shards_per_worker)
    pieces = [np.concatenate([chunks[i] for i in row]) for row in owner]
  else:
    raise ValueError(f"unknown shard mode {mode!r}; allowed: {', '.join(SHARD_MODES)}")
  return [np.sort(p).astype(np.int64) for p in pieces]


@functools.lru_cache(maxsize=64)
def _epoch_perm(seed: int, worker: int, epoch: int, size: int) -> np.ndarray:
  # One independent stream per (seed, worker, epoch): any epoch's order is computable
  # on its own. The leading tag keeps it apart from streams shard_indices draws. Cached (read-only):
  # a feed asks for the same epoch's order every batch (the pipeline's twice a tick).
  perm = np.random.default_rng([1, seed, worker, epoch]).permutation(size)
  perm.setflags(write=False)
  return perm


def batch_indices(
  shards: Sequence[np.ndarray], batch_size: int, seed: int, step, workers: Sequence[int] | None = None
) -> np.ndarray:
  """Global example indices [W, batch_size] for `step` (an int, or one step per worker).

  `workers` names the worker id of each shard when only some workers' batches are wanted (their
  batches equal those of the full call).

  Worker w walks its own shard in epochs, each a fresh permutation of the shard;
  its step-k batch is positions k*B .. k*B+B-1 of that endless walk. A batch that
  crosses an epoch end takes the rest from the next epoch, so workers with small
  (or unequal) shards still give `batch_size` examples every step.
  """
  steps = np.broadcast_to(np.asarray(step, np.int64), (len(shards),))
  if batch_size < 1 or (steps < 0).any():
    raise ValueError(f"need batch_size >= 1 and step >= 0, got {batch_size}, {step}")
  out = np.empty((len(shards), batch_size), np.int64)
  ids = range(len(shards)) if workers is None else workers
  for k, (w, shard) in enumerate(zip(ids, shards)):
    size = len(shard)
    if size == 0:
      raise ValueError(f"worker {w} has an empty shard")
    # Asynchronous workers are at different steps: each walks its own shard at its own pace.
    pos = steps[k] * batch_size + np.arange(batch_size, dtype=np.int64)
    epoch, offset = pos // size, pos % size
    for e in np.unique(epoch):
      sel = epoch == e
      out[k, sel] = np.asarray(shard)[_epoch_perm(seed, w, int(e), size)[offset[sel]]]
  return out


def batch_at(
  x: np.ndarray,
  y: np.ndarray,
  shards: Sequence[np.ndarray],
  batch_size: int,
  seed: int,
  step: int,
  workers: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """(x [W, B, ...], y [W, B]) for `step`; worker w's rows come only from shards[w].

  With `workers`, only those workers' rows (a process feeding the workers it owns).
  """
  if workers is not None:
    idx = batch_indices([shards[w] for w in workers], batch_size, seed, step, workers=workers)
    return x[idx], y[idx]
  idx = batch_indices(shards, batch_size, seed, step)
  return x[idx], y[idx]


def worker_batches(
  x: np.ndarray,
  y: np.ndarray,
  shards: Sequence[np.ndarray],
  batch_size: int,
  seed: int = 0,
  start_step: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless batch_at(step) for step = start_step, start_step + 1, ...

  To resume after `k` completed steps pass start_step=k: the stream then equals the
  tail of an uninterrupted run.
  """
  step = start_step
  while True:
    yield batch_at(x, y, shards, batch_size, seed, step)
    step += 1

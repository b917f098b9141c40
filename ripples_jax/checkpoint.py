"""Orbax checkpoints: a state pytree of jax.Arrays plus a JSON dict of loop metadata, verified.

Every process of a job takes part in every save and restore (orbax's multi-process model: each
process writes the shards it owns, process 0 the metadata). Saves are asynchronous: `save` returns once
the arrays are copied to the host; the files are written in the background, and orbax lists a step
only once its write has committed.

Verification: `fingerprint(state)` is two wrapping uint32 sums per leaf (of its 32-bit words, and of
the words weighted by position), computed in one jitted program, so it works on arrays sharded over
several processes (a collective; every process calls it) and is exact (integer arithmetic, any
reduction order). It is stored in the metadata at save and recomputed at restore; a mismatch (a
flipped byte on disk) makes the checkpoint unusable like one that does not read back.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers


class CheckpointMismatch(ValueError):
  """The restored arrays are not the ones that were saved (their fingerprint differs)."""


def _words(a):
  """The leaf as flat uint32 words (32-bit dtypes bit for bit; narrower ones widened)."""
  a = a.reshape(-1)
  if a.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(a, jnp.uint32)
  if a.dtype == jnp.bool_:
    return a.astype(jnp.uint32)
  if a.dtype.itemsize == 2:
    return jax.lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32)
  if a.dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(a, jnp.uint8).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(a, jnp.uint32).reshape(-1)  # 64-bit: two words each


@jax.jit
def _fingerprint(leaves):
  sums, finite = [], jnp.bool_(True)
  for a in leaves:
    if jnp.issubdtype(a.dtype, jnp.inexact):
      finite &= jnp.all(jnp.isfinite(a))
    w = _words(a)
    weight = 2 * jnp.arange(w.shape[0], dtype=jnp.uint32) + 1
    sums.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)]))
  return sums, finite


def fingerprint(state) -> tuple[list[list[int]], bool]:
  """([[sum, weighted sum] per leaf], every float finite) of a pytree of jax.Arrays; collective."""
  leaves = [a for a in jax.tree.leaves(state) if isinstance(a, jax.Array) and a.size]
  groups = {}  # one program per set of devices: a pipeline's stages live on a device each (devices.py)
  for i, a in enumerate(leaves):
    groups.setdefault(frozenset(d.id for d in a.sharding.device_set), []).append(i)
  out, finite = [None] * len(leaves), True
  for idx in groups.values():
    sums, ok = _fingerprint([leaves[i] for i in idx])
    finite &= bool(ok)
    for i, s in zip(idx, sums):
      out[i] = [int(x) for x in np.asarray(s)]
  return out, finite


class _OneWriter(array_metadata_store.Validator):
  """A per-process checkpoint holds one process's array metadata, by design (see manager)."""

  def _validate_process_count(self, *, ref_process_index: int) -> None:
    pass


def manager(
  directory: str, keep: int | None = None, create: bool = True, process: int | None = None
) -> ocp.CheckpointManager:
  """A checkpoint manager over every process (the default) or, with `process`, of that process alone.

  A per-process manager saves without waiting for any other process (no barrier), which is what the
  runtime's marker checkpoints need. Orbax supports it through its documented options:
  MultiprocessingOptions(primary_host=p, active_processes={p}) on the manager and the handlers, an
  ArrayHandler whose primary host is p (it writes the array metadata), and an array-metadata validator
  that accepts one process's metadata. The arrays must be global jax.Arrays (orbax refuses host-local
  ones in a multi-process job): a worker saves its state as its row of a (workers, ...) array whose
  other rows live in other processes and are not written (distributed.arrays.to_global; no communication).
  """
  if process is None:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
  mp = ocp.options.MultiprocessingOptions(
    primary_host=process, active_processes={process}, barrier_sync_key_prefix=f"ripples-w{process}"
  )
  if create:
    os.makedirs(directory, exist_ok=True)  # orbax refuses create=True with active_processes
  registry = type_handler_registry.create_type_handler_registry(
    (jax.Array, type_handlers.ArrayHandler(primary_host=process, replica_id=0))
  )
  handlers = {
    "state": ocp.PyTreeCheckpointHandler(
      multiprocessing_options=mp, type_handler_registry=registry, array_metadata_validator=_OneWriter()
    ),
    "meta": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
  }
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep, create=False, multiprocessing_options=mp, enable_async_checkpointing=False
  )
  mgr = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
  mgr.ripples_per_process = True
  return mgr


def _sized(tree):
  """The tree with its empty arrays as None: orbax refuses to save an array of zero size (PipeMare's
  stages below the last hold an empty input ring); restore puts them back from `like`."""
  return jax.tree.map(lambda a: None if getattr(a, "size", 1) == 0 else a, tree)


def save(mgr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
  state = _sized(state)
  item = (
    ocp.args.PyTreeSave(state) if getattr(mgr, "ripples_per_process", False) else ocp.args.StandardSave(state)
  )
  mgr.save(step, args=ocp.args.Composite(state=item, meta=ocp.args.JsonSave(meta)))


def restore(mgr: ocp.CheckpointManager, step: int, like):
  """(state with the structure, shapes, dtypes and shardings of `like`, meta)."""
  target = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a,
    _sized(like),
  )
  if getattr(mgr, "ripples_per_process", False):
    item = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  else:
    item = ocp.args.StandardRestore(target)
  out = mgr.restore(step, args=ocp.args.Composite(state=item, meta=ocp.args.JsonRestore()))
  empty = lambda a: getattr(a, "size", 1) == 0
  leaves, treedef = jax.tree.flatten(like)
  got = iter(jax.tree.leaves(out["state"]))
  state = jax.tree.unflatten(treedef, [a if empty(a) else next(got) for a in leaves])
  return state, out["meta"]


def restorable_steps(mgr: ocp.CheckpointManager) -> list[int]:
  """Committed checkpoints, newest first."""
  mgr.reload()
  return sorted(mgr.all_steps(), reverse=True)


def finish(mgr: ocp.CheckpointManager) -> None:
  mgr.wait_until_finished()
  mgr.close()

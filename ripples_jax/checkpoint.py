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
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging


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
  if not leaves:
    return [], True
  sums, finite = _fingerprint(leaves)
  return [[int(x) for x in np.asarray(s)] for s in sums], bool(finite)


def manager(directory: str, keep: int | None = None, create: bool = True) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
  handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def save(mgr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
  mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         meta=ocp.args.JsonSave(meta)))


def restore(mgr: ocp.CheckpointManager, step: int, like):
  """(state with the structure, shapes, dtypes and shardings of `like`, meta)."""
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                        if isinstance(a, jax.Array) else a, like)
  out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                  meta=ocp.args.JsonRestore()))
  return out["state"], out["meta"]


def restorable_steps(mgr: ocp.CheckpointManager) -> list[int]:
  """Committed checkpoints, newest first."""
  mgr.reload()
  return sorted(mgr.all_steps(), reverse=True)


def restore_latest(mgr: ocp.CheckpointManager, like, check=None):
  """(step, state, meta) of the newest checkpoint that reads back (and passes `check(state, meta)`,
  which raises to refuse it), or None.

  A corrupt or partial checkpoint is skipped with a warning naming it, and the previous one is used.
  """
  for step in restorable_steps(mgr):
    try:
      state, meta = restore(mgr, step, like)
      if check is not None:
        check(state, meta)
      return step, state, meta
    except Exception as e:  # noqa: BLE001  any read failure means: not usable
      logging.warning("checkpoint %s/%d does not read back (%s: %s); falling back to the previous one",
                      mgr.directory, step, type(e).__name__, (str(e).splitlines() or [""])[0][:200])
  return None


def finish(mgr: ocp.CheckpointManager) -> None:
  mgr.wait_until_finished()
  mgr.close()

"""Orbax checkpoints: a state pytree of jax.Arrays plus a JSON dict of loop metadata.

Every process of a job takes part in every save and restore (orbax's multi-process model: each
process writes the shards it owns, process 0 the metadata). Saves are asynchronous: `save` returns once
the arrays are copied to the host; the files are written in the background, and orbax lists a step
only once its write has committed.
"""
import jax
import orbax.checkpoint as ocp
from absl import logging


def manager(directory: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))


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


def restore_latest(mgr: ocp.CheckpointManager, like):
  """(step, state, meta) of the newest checkpoint that reads back, or None.

  A corrupt or partial checkpoint is skipped with a warning naming it, and the previous one is used.
  """
  for step in restorable_steps(mgr):
    try:
      return (step,) + restore(mgr, step, like)
    except Exception as e:  # noqa: BLE001  any read failure means: not usable
      logging.warning("checkpoint %s/%d does not read back (%s: %s); falling back to the previous one",
                      mgr.directory, step, type(e).__name__, (str(e).splitlines() or [""])[0][:200])
  return None


def finish(mgr: ocp.CheckpointManager) -> None:
  mgr.wait_until_finished()
  mgr.close()

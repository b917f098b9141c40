"""Orbax checkpoints: a state pytree of jax.Arrays plus a JSON dict of loop metadata.

Every process of a job takes part in every save and restore (orbax's multi-process model: each
process writes the shards it owns, process 0 the metadata). Saves are asynchronous: `save` returns once
the arrays are copied to the host; the files are written in the background, and orbax lists a step
only once its write has committed.
"""
import os

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


def count_lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    return sum(1 for _ in f)


def truncate_lines(path: str, n: int) -> None:
  """Keeps the first n lines of a file (atomically), dropping what a lost run wrote after them."""
  if not os.path.exists(path):
    return
  with open(path, "rb") as f:
    lines = f.readlines()
  if len(lines) <= n:
    return
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.writelines(lines[:n])
  os.replace(tmp, path)


class Checkpointer:
  """A training loop's checkpoints in WORKDIR/ckpt: every `every` steps and at the end.

  `restore` resumes from the newest checkpoint that reads back and cuts metrics.jsonl back to the lines
  written when that checkpoint was taken, so a resumed run neither loses nor repeats a record.
  """

  def __init__(self, workdir: str, every: int, keep: int):
    self.workdir, self.every = workdir, every
    self.directory = os.path.abspath(os.path.join(workdir, "ckpt"))
    self.mgr = manager(self.directory, keep) if every else None
    self.last = None
    self.metrics_path = os.path.join(workdir, "metrics.jsonl")

  def restore(self, like):
    """(step, state, meta) of the newest good checkpoint, or None (a fresh start)."""
    got = restore_latest(self.mgr, like) if self.mgr else None
    if jax.process_index() == 0:
      if got is None and os.path.exists(self.metrics_path):
        # A fresh start in a used workdir: keep the old records aside rather than mixing them in.
        os.replace(self.metrics_path, self.metrics_path + ".old")
      elif got is not None:
        truncate_lines(self.metrics_path, got[2]["metrics_lines"])
    if got is not None:
      self.last = got[0]
      logging.info("resuming from %s/%d", self.directory, got[0])
    return got

  def save(self, step: int, state, meta: dict, force: bool = False) -> None:
    if self.mgr is None or step == self.last or not (force or step % self.every == 0):
      return
    save(self.mgr, step, state, {**meta, "metrics_lines": count_lines(self.metrics_path)})
    self.last = step

  def describe_last(self) -> str:
    return f"{self.directory}/{self.last}" if self.last is not None else "none (no checkpoint yet)"

  def close(self) -> None:
    if self.mgr is not None:
      finish(self.mgr)

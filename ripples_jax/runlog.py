"""RunLog: the one owner of everything a run writes in its workdir.

  WORKDIR/config.json      the config, written when the log opens
  WORKDIR/metrics.jsonl    one JSON object per record(): step, time, then the scalars
  WORKDIR/events.*         TensorBoard, the same scalars
  WORKDIR/summary.json     finish(): the keys every executor shares, plus the executor's own
  WORKDIR/ckpt/            orbax checkpoints (checkpoint.py): state + {"cursor", "metrics_lines"}

Invariants: metrics.jsonl is only ever appended to, except by restore(), which cuts it back to the
lines that existed when the restored checkpoint was taken (so a resumed run neither loses nor repeats a
record) or, on a fresh start in a used workdir, moves it aside to metrics.jsonl.old. Only the lead
process (process 0) writes files; every process takes part in checkpoints (orbax's multi-process
model). A non-finite loss stops the run after its record is on disk, naming the step and the last
good checkpoint.

  with RunLog(workdir, config, total_steps=config.num_steps) as log:
    got = log.restore(state)            # None, or (step, state, cursor)
    log.record(step, time, train_loss=0.3)
    log.checkpoint(step, state, cursor={"round": 7})
    summary = log.finish(time=t, worker_steps=[...], conflicts=[...])
"""
import json
import math
import os
import time

import jax
import numpy as np
from absl import logging

from ripples_jax import checkpoint
from ripples_jax.progress import Progress
from ripples_jax.config import ConfigError

SUMMARY_KEYS = ("algorithm", "executor", "num_workers", "num_steps", "final_test_accuracy",
                "final_worker_test_accuracy", "final_consensus_distance", "final_train_loss", "time",
                "worker_steps", "throughput", "workdir")


def make_workdir(workdir: str | None) -> str:
  """The given workdir, or a fresh timestamped folder under runs/ (one process only)."""
  if workdir is None and jax.process_count() > 1:
    raise ConfigError("--workdir: None is not allowed with several processes: a folder every process sees")
  if not workdir:
    workdir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    base, k = workdir, 1
    while os.path.exists(workdir):
      workdir, k = f"{base}-{k}", k + 1
  os.makedirs(workdir, exist_ok=True)
  return workdir


def to_python(v):
  """numpy/jax scalars and arrays -> JSON-friendly python values."""
  if hasattr(v, "tolist"):
    v = np.asarray(v).tolist()
  return v


def write_json(path: str, obj: dict) -> None:
  """Atomic write: a reader never sees a half-written file."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({k: to_python(v) for k, v in obj.items()}, f, indent=2)
  os.replace(tmp, path)


def check_finite(step: int, last_checkpoint: str | None = None, **values) -> None:
  """Raises FloatingPointError at the first non-finite value, naming the step and the last checkpoint."""
  for k, v in values.items():
    if v is not None and not math.isfinite(v):
      where = f"; the last good checkpoint is {last_checkpoint}" if last_checkpoint else ""
      raise FloatingPointError(f"{k} is {v} at step {step}; stopping the run{where}")


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


class RunLog:
  """A context manager over one run's files; see the module docstring."""

  def __init__(self, workdir: str, config, total_steps: int, is_lead: bool | None = None,
               checkpoint_every: int | None = None, checkpoint_keep: int | None = None,
               tensorboard: bool = True, progress: bool = True):
    self.workdir, self.config, self.total_steps = workdir, config, total_steps
    self.is_lead = jax.process_index() == 0 if is_lead is None else is_lead
    every = config.checkpoint_every if checkpoint_every is None else checkpoint_every
    keep = config.checkpoint_keep if checkpoint_keep is None else checkpoint_keep
    self.every = every
    self.ckpt_dir = os.path.abspath(os.path.join(workdir, "ckpt"))
    self.mgr = checkpoint.manager(self.ckpt_dir, keep) if every else None
    self.metrics_path = os.path.join(workdir, "metrics.jsonl")
    self.last_ckpt = None   # the newest checkpoint step this run restored or saved
    self.last = {}          # the newest value of every recorded key
    self._tensorboard = tensorboard
    self._file = self._tb = None
    self._progress = Progress(total_steps, config.log_every) if progress and self.is_lead else None
    if self.is_lead:
      os.makedirs(workdir, exist_ok=True)
      with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

  # -- checkpoints --------------------------------------------------------------------------------

  def restore(self, like):
    """(step, state, cursor) of the newest checkpoint that reads back, or None (a fresh start).

    Call it before the first record(): it cuts metrics.jsonl back to the checkpoint.
    """
    got = checkpoint.restore_latest(self.mgr, like) if self.mgr else None
    if self.is_lead:
      if got is None and os.path.exists(self.metrics_path):
        os.replace(self.metrics_path, self.metrics_path + ".old")  # a fresh start: keep the old aside
      elif got is not None:
        truncate_lines(self.metrics_path, got[2]["metrics_lines"])
    if self.mgr is not None:
      # Newer steps did not read back: delete them, or orbax would skip this run's saves up to them.
      for bad in checkpoint.restorable_steps(self.mgr):
        if got is None or bad > got[0]:
          self.mgr.delete(bad)
    if got is None:
      return None
    step, state, meta = got
    logging.info("resuming from %s/%d", self.ckpt_dir, step)
    self.last_ckpt = step
    self.last = dict(meta.get("last", {}))
    return step, state, meta["cursor"]

  def checkpoint(self, step: int, state, cursor: dict, force: bool = False) -> None:
    """Saves (state, cursor) at `step` every `checkpoint_every` steps (or when forced); collective."""
    if self.mgr is None or step == self.last_ckpt or not (force or step % self.every == 0):
      return
    if self._file:
      self._file.flush()
    # A deep copy now: orbax serialises the metadata in the background, after the loop moved on.
    meta = json.loads(json.dumps({"cursor": cursor, "last": self.last,
                                  "metrics_lines": count_lines(self.metrics_path)}))
    checkpoint.save(self.mgr, step, state, meta)
    self.last_ckpt = step

  def wait(self) -> None:
    """Blocks until every checkpoint write has committed."""
    if self.mgr is not None:
      self.mgr.wait_until_finished()

  def describe_last(self) -> str:
    if self.last_ckpt is None:
      return "none (no checkpoint yet)"
    return f"{self.ckpt_dir}/{self.last_ckpt}"

  # -- records ------------------------------------------------------------------------------------

  def _open(self):
    if self._file is None and self.is_lead:
      self._file = open(self.metrics_path, "a")
      if self._tensorboard:
        from tensorboardX import SummaryWriter  # lazy: keeps library imports light
        self._tb = SummaryWriter(self.workdir)

  def record(self, step: int, time: float, **scalars) -> dict:
    """One record: a JSON line, TensorBoard scalars, the progress line, then the NaN check."""
    record = {"step": int(step), "time": time}
    record.update({k: to_python(v) for k, v in scalars.items()})
    self.last.update(record)
    if self.is_lead:
      self._open()
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
      if self._tb is not None:
        for k, v in record.items():
          if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            self._tb.add_scalar(k, v, record["step"])
    self.progress(min(int(step), self.total_steps))
    # After writing, so the bad value is on disk.
    check_finite(step, self.describe_last(), **{k: v for k, v in record.items() if k.endswith("loss")})
    return record

  def progress(self, step: int, **info) -> None:
    """The progress line (lead only), showing the newest loss and accuracy unless given."""
    if self._progress is not None:
      shown = {k: self.last[k] for k in ("train_loss", "test_accuracy") if k in self.last}
      self._progress.update(step, **{**shown, **info})

  def finish(self, time: float, worker_steps, **extra) -> dict:
    """Writes summary.json: the shared keys (final_* from the newest records), then `extra`."""
    worker_steps = [int(s) for s in np.asarray(worker_steps).reshape(-1)]
    c = self.config
    summary = {
        "algorithm": getattr(c, "algorithm", getattr(c, "method", None)), "executor": c.get("executor"),
        "num_workers": c.get("num_workers"), "num_steps": c.get("num_steps"),
        "final_test_accuracy": self.last.get("test_accuracy"),
        "final_worker_test_accuracy": self.last.get("worker_test_accuracy"),
        "final_consensus_distance": self.last.get("consensus_distance"),
        "final_train_loss": self.last.get("train_loss"), "time": time, "worker_steps": worker_steps,
        "throughput": float(sum(worker_steps) / time) if time else None, "workdir": self.workdir,
    }
    summary.update(extra)
    if self.is_lead:
      write_json(os.path.join(self.workdir, "summary.json"), summary)
    return summary

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self.mgr is not None:
      checkpoint.finish(self.mgr)
      self.mgr = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False


def summary_table(rows: list[dict]) -> str:
  """A short plain-text table: algorithm, workers, steps, test accuracy, time."""
  head = ("algorithm", "workers", "steps", "test_acc", "time_s")
  lines = [head] + [(r["algorithm"], str(r["num_workers"]), str(r["num_steps"]),
                     f"{100 * r['final_test_accuracy']:.2f}%", f"{r['time']:.1f}") for r in rows]
  widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
  fmt = lambda l: "  ".join(s.ljust(w) for s, w in zip(l, widths))
  return "\n".join([fmt(lines[0]), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines[1:]])

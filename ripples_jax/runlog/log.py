"""RunLog: the one owner of everything a run writes in its workdir.

  WORKDIR/config.json      the config, written when the log opens
  WORKDIR/metrics.jsonl    one JSON object per record(): step, time, then the scalars
  WORKDIR/events.*         TensorBoard: the same scalars under train/ and eval/ tags (tb_tag), steps_per_s,
                           the config as text and hparams; written as they come (no queue) and flushed at
                           every record, so a checkpoint never holds a step TensorBoard lacks
  WORKDIR/summary.json     finish(): the keys every executor shares, plus the executor's own
  WORKDIR/ckpt/            orbax checkpoints (checkpoint.py): state + {"cursor", "metrics_lines"}

Invariants: metrics.jsonl is only ever appended to, except by a resume, which cuts it back to the
lines that existed when the restored checkpoint was taken (so a resumed run neither loses nor repeats a
record; a torn or short file keeps its whole records, with one warning naming what was dropped; the
TensorBoard events files are cut back to the same last record, events.trim_events, so no reader sees a
step twice, and the new events file starts with a purge at the step after it, for a TensorBoard that
read the lost stretch live) or, on a fresh start in a used workdir, moves the earlier
run's files aside under numbered names (metrics.1.jsonl, config.1.json, summary.1.json, tensorboard.1/
with its events; never overwritten). Which run a workdir holds and who holds it now: workdir.py (the
config identity of both checkpoint layouts; the flock-held WORKDIR/.lock).
No checkpoint is deleted unless it was tried, found unusable (it does not read back, or its
fingerprint differs) and an older one restored; when checkpoints exist and none restores, the resume is
refused (ResumeRefused, one line) and nothing is deleted. Multi-process resume (distributed/resume.py)
sets a good checkpoint newer than the agreed one aside in WORKDIR/ckpt.superseded/ instead. Checkpoints
are verified (checkpoint.fingerprint) and a state with a non-finite value is never saved, so the NaN
stop names a checkpoint that is good.
Only the lead process (process 0) writes files; every process takes part in checkpoints (orbax's
multi-process model). Non-finite values are written to metrics.jsonl as null, their keys listed under
"nonfinite" (strict JSON). The console gets one line per committed checkpoint (`checkpoint <step>
saved: <dir>`) and the progress line (progress.Progress).

  with RunLog(workdir, config, total_steps=config.num_steps) as log:
    got = log.restore(state)            # None, or (step, state, cursor)
    log.record(step, time, train_loss=0.3)
    log.checkpoint(step, state, cursor={"round": 7})
    summary = log.finish(time=t, worker_steps=[...], conflicts=[...])
"""

import contextlib
import glob
import json
import math
import os
import shutil

import jax
import numpy as np
from absl import logging

from ripples_jax import checkpoint
from ripples_jax.errors import ResumeRefused, StorageError
from ripples_jax.progress import Progress
from ripples_jax.runlog.events import TB_METRICS, EventWriter, hparams, tb_tag, trim_events
from ripples_jax.runlog.records import (
  archive,
  check_finite,
  count_lines,
  cut_records,
  last_step,
  numbered,
  to_python,
  write_json,
)
from ripples_jax.runlog.saver import Saver
from ripples_jax.runlog.storage import FULL, storage_failure
from ripples_jax.runlog.workdir import (
  WorkdirLock,
  differences,
  identity,
)


def _verify(state, meta) -> None:
  """try_restore's check: the restored arrays must be the saved ones (flipped bytes are refused)."""
  if "identity" not in meta:
    raise checkpoint.CheckpointMismatch("written by an older version (no run identity)")
  sums, _ = checkpoint.fingerprint(state)
  if sums != meta["sums"]:
    raise checkpoint.CheckpointMismatch("its arrays differ from what was saved (fingerprint mismatch)")


class RunLog:
  """A context manager over one run's files; see the module docstring."""

  def __init__(
    self,
    workdir: str,
    config,
    total_steps: int,
    is_lead: bool | None = None,
    checkpoint_every: int | None = None,
    checkpoint_keep: int | None = None,
    tensorboard: bool = True,
    progress: bool = True,
    per_process=None,
  ):
    """per_process: (name, to_global, to_local): this process checkpoints its own state alone, in
    ckpt/<name>/ (the runtime's marker checkpoints: no barrier; name is a worker's or a stage's
    index); to_global makes the arrays orbax writes from the local state, to_local takes them back."""
    self.workdir, self.config, self.total_steps = workdir, config, total_steps
    self.per_process = per_process
    self._saver = Saver(self._write_in_background)
    self.is_lead = jax.process_index() == 0 if is_lead is None else is_lead
    self.lock = WorkdirLock(workdir)
    if self.is_lead:
      os.makedirs(workdir, exist_ok=True)
      self.lock.acquire()  # before anything is read or cut: another live run's files stay untouched
    every = config.checkpoint_every if checkpoint_every is None else checkpoint_every
    keep = config.checkpoint_keep if checkpoint_keep is None else checkpoint_keep
    self.every = every
    self.ckpt_dir = os.path.abspath(os.path.join(workdir, "ckpt"))
    if per_process is not None:
      self.ckpt_dir = os.path.join(self.ckpt_dir, str(per_process[0]))
    # orbax's primary host is this process (its id), whatever the folder's name (a worker's index).
    process = jax.process_index() if per_process is not None else None
    self.mgr = checkpoint.manager(self.ckpt_dir, keep, process=process) if every else None
    self.metrics_path = os.path.join(workdir, "metrics.jsonl")
    self.identity = identity(config)
    self.last_ckpt = None  # the newest checkpoint step this run restored or saved
    self.resumed_meta = None  # the meta of the checkpoint it resumed from
    self.last = {}  # the newest value of every recorded key
    self._tensorboard = tensorboard
    self._file = self._tb = None
    self._tb_from = None  # restore(): the first step the resumed run's events file may hold
    self._tb_header = True  # whether the events file starts with the config (text, hparams)
    self._rate_from = None  # (step, time) of the previous record: steps_per_s
    self._saving = None  # a checkpoint step not yet announced as saved
    self._warned_nonfinite = False
    self._progress = Progress(total_steps, config.log_every) if progress and self.is_lead else None

  # -- checkpoints --------------------------------------------------------------------------------

  def committed(self) -> list[int]:
    """This run's committed checkpoint steps, newest first."""
    return checkpoint.restorable_steps(self.mgr) if self.mgr is not None else []

  def restore(self, like):
    """(step, state, cursor) of the newest good checkpoint, or None (a fresh start); writes config.json.

    Call it before the first record(). The newest checkpoint is tried first; one that does not read
    back (or fails its fingerprint) is deleted once an older one has restored (orbax would otherwise
    skip this run's saves up to it). When checkpoints exist and none restores, ResumeRefused is raised
    and nothing is deleted. Resuming cuts metrics.jsonl back to the checkpoint; a fresh start moves an
    earlier run's records aside under numbered names.
    """
    failed = []
    for step in self.committed():
      got = self.try_restore(step, like)
      if isinstance(got, str):
        failed.append((step, got))
        continue
      return self.resume_from(step, *got, unusable=[s for s, _ in failed])
    if failed:
      raise ResumeRefused(self.refusal(failed))
    self.start_fresh()
    return None

  def try_restore(self, step: int, like):
    """(state, meta) of checkpoint `step`, or the reason (a str) it is unusable: it does not read
    back, its arrays do not fit `like`, or they are not the ones saved (fingerprint)."""
    try:
      if self.per_process is not None:
        _, to_global, to_local = self.per_process
        state, meta = checkpoint.restore(self.mgr, step, to_global(like))
        state = to_local(state)
      else:
        state, meta = checkpoint.restore(self.mgr, step, like)
      _verify(state, meta)
      return state, meta
    except Exception as e:  # noqa: BLE001  any failure to read means: not usable
      reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
      logging.warning("checkpoint %s/%d does not read back (%s)", self.ckpt_dir, step, reason)
      return reason

  def refusal(self, failed) -> str:
    """The one line when checkpoints exist and none restores: which, why, and that nothing was deleted."""
    (step, reason), older = failed[0], len(failed) - 1
    saved = self.saved_identity(step)
    changed = differences(saved, self.identity) if saved else []
    why = (
      f"the config changed ({'; '.join(changed)}) and its arrays do not fit this config"
      if changed
      else "it does not read back"
    )
    rest = f" (nor do the {older} older ones)" if older else ""
    return (
      f"--workdir: {self.workdir!r} is not allowed: its checkpoint {self.ckpt_dir}/{step}{rest} cannot "
      f"be resumed: {why} ({reason}); nothing was deleted; rerun with the config that wrote it, or "
      f"move {self.ckpt_dir} aside to start afresh, or use another --workdir"
    )

  def saved_identity(self, step: int) -> dict:
    """The config identity checkpoint `step` was written under ({} when its metadata does not read)."""
    try:
      with open(os.path.join(self.ckpt_dir, str(step), "meta", "metadata")) as f:
        return json.load(f).get("identity", {})
    except (OSError, ValueError):
      return {}

  def set_aside(self, steps) -> None:
    """Moves checkpoints that are good but newer than the one every process resumed from out of the
    manager's folder, to WORKDIR/ckpt.superseded/ (never overwritten): nothing is deleted that another
    process may need, and this run's saves at those steps are not skipped."""
    for step in steps:
      src = os.path.join(self.ckpt_dir, str(step))
      rel = os.path.relpath(src, os.path.join(self.workdir, "ckpt"))
      dst, k = os.path.join(self.workdir, "ckpt.superseded", rel), 1
      while os.path.exists(dst):
        dst, k = os.path.join(self.workdir, "ckpt.superseded", f"{rel}.{k}"), k + 1
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      os.replace(src, dst)
      logging.warning("checkpoint %s is newer than the one every process resumes from: kept as %s", src, dst)

  def resume_from(self, step: int, state, meta: dict, unusable=()):
    """Resumes at checkpoint `step` (restored: state, meta): deletes the newer ones in `unusable`
    (tried and found unusable), sets the other newer ones aside, cuts the records back to it (lead).
    Returns (step, state, cursor)."""
    for bad in unusable:
      if bad > step:
        logging.warning(
          "deleting checkpoint %s/%d: it does not read back, and %d did", self.ckpt_dir, bad, step
        )
        self.mgr.delete(bad)
    self.set_aside([s for s in self.committed() if s > step])
    self.mgr.reload()
    if self.is_lead:
      self.resume_records(meta)
    logging.info("resuming from %s/%d", self.ckpt_dir, step)
    self.resumed_meta = meta
    self.last_ckpt = step
    self.last = dict(meta.get("last", {}))
    if "step" in self.last and "time" in self.last:
      self._rate_from = (self.last["step"], self.last["time"])
    if self._progress is not None:  # its last record's step (a checkpoint's own may count blocks)
      self._progress.resume_at(min(int(self.last.get("step", 0)), self.total_steps))
    return step, state, meta["cursor"]

  def resume_records(self, meta: dict) -> None:
    """The lead's part of a resume at a checkpoint whose `meta` it has (read here, or sent by the
    process that holds it: an async run's coordinator holds no checkpoint): metrics.jsonl cut back to
    it, the TensorBoard events files trimmed to the same point and the new one's purge step,
    config.json (an earlier one kept numbered when the config changed)."""
    warning = cut_records(self.metrics_path, meta["metrics_lines"])
    if warning:
      logging.warning("%s", warning)
    # TensorBoard keeps what metrics.jsonl keeps: events up to its last record, none after.
    kept = last_step(self.metrics_path)
    if self._tensorboard:
      trim_events(self.workdir, kept)
    self._tb_from = 0 if kept is None else kept + 1
    changed = bool(differences(meta["identity"], self.identity))
    self._tb_header = self._tb_from == 0 or changed
    if changed:  # on_config_change=force
      config_path = os.path.join(self.workdir, "config.json")
      if os.path.exists(config_path):
        k = 1
        while os.path.exists(os.path.join(self.workdir, numbered("config.json", k))):
          k += 1
        os.replace(config_path, os.path.join(self.workdir, numbered("config.json", k)))
    self._write_config()

  def start_fresh(self) -> None:
    """A fresh start: an earlier run's records are kept, numbered (lead); config.json written."""
    if self.is_lead:
      k = archive(self.workdir)
      if k is not None:
        logging.warning("%s: an earlier run's records were moved to *.%d.*", self.workdir, k)
      self._write_config()

  def _write_config(self) -> None:
    with open(os.path.join(self.workdir, "config.json"), "w") as f:
      f.write(self.config.to_json_best_effort(indent=2))

  @contextlib.contextmanager
  def _writing(self, what: str):
    """Turns a refused write into one StorageError line; drops a checkpoint the write left half-made."""
    try:
      yield
    except Exception as e:  # noqa: BLE001  re-raised unless the disk refused the write
      reason = storage_failure(e)
      if reason is None:
        raise
      if self.is_lead or self.per_process is not None:  # the folder's owner (per_process: its own)
        for tmp in glob.glob(os.path.join(self.ckpt_dir, "*.orbax-checkpoint-tmp*")):
          shutil.rmtree(tmp, ignore_errors=True)
      good = checkpoint.restorable_steps(self.mgr) if self.mgr is not None else []
      last = f"{self.ckpt_dir}/{good[0]}" if good else "none"
      fix = "free space" if reason in FULL else "make it writable"
      raise StorageError(
        f"{what}: {reason}; the last good checkpoint is {last}; {fix} and run the same "
        "command again to resume"
      ) from None

  def checkpoint(self, step: int, state, cursor: dict, force: bool = False) -> None:
    """Saves (state, cursor) at `step` every `checkpoint_every` steps (or when forced); collective
    (this process alone with per_process).

    A state holding a non-finite value is not saved (a warning says so), so the last checkpoint is
    always one a run can continue from.
    """
    if self.mgr is None or step == self.last_ckpt or not (force or step % self.every == 0):
      return
    if self.per_process is not None:
      return self._checkpoint_in_background(step, state, cursor)
    sums, finite = checkpoint.fingerprint(state)
    if not finite:
      logging.warning(
        "step %d: the state holds a non-finite value; not checkpointed (the last good checkpoint stays %s)",
        step,
        self.describe_last(),
      )
      return
    if self._file:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()
    # A deep copy now: orbax serialises the metadata in the background, after the loop moved on.
    meta = json.loads(
      json.dumps(
        {
          "cursor": cursor,
          "last": self.last,
          "identity": self.identity,
          "sums": sums,
          "metrics_lines": count_lines(self.metrics_path),
        }
      )
    )
    with self._writing(f"{self.ckpt_dir}/{step}"):
      checkpoint.save(self.mgr, step, state, meta)  # raises a failure of the previous background write
    self._announce(final=True)  # orbax's save waited for the previous write: committed by now
    self.last_ckpt = self._saving = step

  def _checkpoint_in_background(self, step: int, state, cursor: dict) -> None:
    """per_process: the state is copied to the host now (the loop goes on and donates its buffers)
    and written by this run's saver thread (runlog.saver), one checkpoint at a time, so a marker costs
    the loop a device-to-host copy only. A failed write is raised at the next checkpoint() or wait()."""
    self._saver.raise_error()
    if self._file:
      self._file.flush()
    meta = json.loads(
      json.dumps(
        {
          "cursor": cursor,
          "last": self.last,
          "identity": self.identity,
          "metrics_lines": count_lines(self.metrics_path),
        }
      )
    )
    self._saver.put(step, jax.device_get(state), meta)
    self.last_ckpt = step

  def _write_in_background(self, step: int, host, meta: dict) -> None:
    sums, finite = checkpoint.fingerprint(jax.device_put(host))
    if not finite:
      logging.warning("step %d: the state holds a non-finite value; not checkpointed", step)
      return
    with self._writing(f"{self.ckpt_dir}/{step}"):
      checkpoint.save(self.mgr, step, self.per_process[1](host), {**meta, "sums": sums})
    self._saving = step
    self._announce(final=True)

  def _announce(self, final: bool = False) -> None:
    """One console line for the pending checkpoint once it is committed (orbax renames its folder to
    the step then); `final`: the write is over, so a checkpoint that is not there is dropped unsaid."""
    if self._saving is None or not self.is_lead:
      return
    where = os.path.join(self.ckpt_dir, str(self._saving))
    if os.path.isdir(where):
      logging.info("checkpoint %d saved: %s", self._saving, where)
      self._saving = None
    elif final:
      self._saving = None

  def wait(self) -> None:
    """Blocks until every checkpoint write has committed."""
    self._saver.drain()
    if self.mgr is not None:
      with self._writing(self.ckpt_dir):
        self.mgr.wait_until_finished()
      self._announce(final=True)

  def describe_last(self) -> str:
    if self.last_ckpt is None:
      return "none (no checkpoint yet)"
    return f"{self.ckpt_dir}/{self.last_ckpt}"

  # -- records ------------------------------------------------------------------------------------

  def _open(self):
    if self._file is None and self.is_lead:
      self._file = open(self.metrics_path, "a")
      if self._tensorboard:
        self._tb = EventWriter(self.workdir, purge_step=self._tb_from)
        if self._tb_header:
          step = self._tb_from or 0
          self._tb.text("config", "```\n" + self.config.to_json_best_effort(indent=2) + "\n```", step)
          if not step:  # a session of the hparams dashboard: once, at the run's start
            self._tb.hparams(hparams(self.config), TB_METRICS)
        self._tb.flush()

  def _tensorboard_record(self, record: dict) -> None:
    """The record's numbers under their tags (tb_tag), and steps_per_s since the previous record."""
    step, simulated = record["step"], self.config.get("executor") == "sim"
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
        self._tb.scalar(tb_tag(k, simulated), v, step)
    now = record.get("time")
    if isinstance(now, (int, float)) and not isinstance(now, bool) and math.isfinite(now):
      if self._rate_from is not None and step > self._rate_from[0] and now > self._rate_from[1]:
        self._tb.scalar(
          tb_tag("steps_per_s", simulated), (step - self._rate_from[0]) / (now - self._rate_from[1]), step
        )
      self._rate_from = (step, now)
    self._tb.flush()

  def record(self, step: int, time: float, **scalars) -> dict:
    """One record: a JSON line, TensorBoard scalars, the progress line, then the NaN check."""
    record = {"step": int(step), "time": time}
    record.update({k: to_python(v) for k, v in scalars.items()})
    self.last.update(record)
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if self.is_lead:
      self._open()
      line = {k: (None if k in bad else v) for k, v in record.items()}
      if bad:  # strict JSON: null, and the keys (with their values) named
        line["nonfinite"] = {k: str(record[k]) for k in bad}
      with self._writing(self.metrics_path):
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()
      if self._tb is not None:
        self._tensorboard_record(record)
    self.progress(min(int(step), self.total_steps))
    # After writing, so the bad value is on disk.
    check_finite(step, self.describe_last(), **{k: v for k, v in record.items() if k.endswith("loss")})
    return record

  def progress(self, step: int, **info) -> None:
    """The progress line (lead only), showing the newest loss and accuracy unless given."""
    if self._progress is not None:
      self._announce()
      shown = {k: self.last[k] for k in ("train_loss", "test_accuracy") if k in self.last}
      self._progress.update(step, **{**shown, **info})

  def finish(self, time: float, worker_steps, **extra) -> dict:
    """Writes summary.json: the shared keys (final_* from the newest records), then `extra`."""
    worker_steps = [int(s) for s in np.asarray(worker_steps).reshape(-1)]
    c = self.config
    summary = {
      "algorithm": getattr(c, "algorithm", getattr(c, "method", None)),
      "executor": c.get("executor"),
      "num_workers": c.get("num_workers"),
      "num_steps": c.get("num_steps"),
      "final_test_accuracy": self.last.get("test_accuracy"),
      "final_worker_test_accuracy": self.last.get("worker_test_accuracy"),
      "final_consensus_distance": self.last.get("consensus_distance"),
      "final_train_loss": self.last.get("train_loss"),
      "time": time,
      "worker_steps": worker_steps,
      "throughput": float(sum(worker_steps) / time) if time else None,
      "workdir": self.workdir,
    }
    summary.update(extra)
    if self.is_lead:
      write_json(os.path.join(self.workdir, "summary.json"), summary)
      if self._tb is not None:
        self._tb.end_session()
        self._tb.flush()
    return summary

  def close(self) -> None:
    if self._progress is not None:
      self._progress.close()
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    try:
      if self.mgr is not None:
        try:
          self._saver.drain(stop=True)
          with self._writing(self.ckpt_dir):
            self.mgr.wait_until_finished()
          self._announce(final=True)
        finally:
          self.mgr.close()
          self.mgr = None
    finally:
      self.lock.release()  # last: pending checkpoint writes belong to this run

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False

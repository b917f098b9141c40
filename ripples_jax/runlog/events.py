"""TensorBoard: one events file per run segment, written as records come (no queue), and the tags.

A record's keys map to tags (tb_tag): train/... for the training curve, eval/... for what an evaluation
measures; the hparams dashboard gets the config (hparams) against TB_METRICS. A resume trims the
earlier segments' files back to the last record metrics.jsonl keeps (trim_events), so every reader of
the files sees each step once, and starts its own file with a purge for a TensorBoard that read the
lost stretch while it was written (docs/usage.md, Resume).
"""

import glob
import os
import struct
import time

from ripples_jax.runlog.workdir import flat_config

TB_TAGS = {
  "train_loss": "train/loss",
  "test_accuracy": "eval/accuracy",
  "test_loss": "eval/loss",
  "worker_test_accuracy": "eval/worker_accuracy",
  "val_accuracy": "eval/val_accuracy",
  "consensus_distance": "eval/consensus_distance",
  "modeled_time": "train/modeled_time_s",
  "worker_steps": "train/worker_steps",
}
TB_METRICS = ("eval/accuracy", "eval/loss", "train/loss")  # the hparams dashboard's columns


def tb_tag(key: str, simulated: bool = False) -> str:
  """The TensorBoard tag of a record's key: train/... for the training curve, eval/... for what an
  evaluation measures. `time` is train/time_s (seconds) or, in simulation, train/virtual_s."""
  if key == "time":
    return "train/virtual_s" if simulated else "train/time_s"
  if key == "steps_per_s":
    return "train/steps_per_virtual_s" if simulated else "train/steps_per_s"
  if key in TB_TAGS:
    return TB_TAGS[key]
  if key.startswith("test_"):
    return "eval/" + key[len("test_") :]
  if key.startswith("train_"):
    return "train/" + key[len("train_") :]
  return "train/" + key


def _records(data: bytes):
  """(start, end, body) of each whole TFRecord in `data`, in order; a record cut short by a kill (or
  failing its checksums) ends the file, as TensorBoard reads it."""
  from tensorboardX.record_writer import masked_crc32c

  i = 0
  while i + 12 <= len(data):
    header = data[i : i + 8]
    (n,) = struct.unpack("<Q", header)
    if struct.unpack("<I", data[i + 8 : i + 12])[0] != masked_crc32c(header) or i + 16 + n > len(data):
      return
    body = data[i + 12 : i + 12 + n]
    if struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] != masked_crc32c(body):
      return
    yield i, i + 16 + n, body
    i += 16 + n


def trim_events(workdir: str, last_step: int | None) -> list[str]:
  """Cuts every events file directly in `workdir` back to the events at steps <= last_step (None: no
  record kept, so only each file's version event stays); returns the files it changed.

  Why trim: TensorBoard's Python reader drops an earlier file's later steps when a newer file starts
  with SessionLog.START (EventWriter's purge_step), but readers of the files that do not know the rule
  (tbparse, a script over the protobufs) would show the stretch a killed run wrote after its checkpoint
  twice. Records are kept byte for byte and a torn last record is dropped. What is dropped is the
  file's tail in a killed run (records are written in step order): the file is truncated in place, one
  atomic call; otherwise it is rewritten and replaced atomically (the temporary is no events file)."""
  from tensorboardX.proto.event_pb2 import Event

  limit = -1 if last_step is None else int(last_step)
  changed = []
  for path in sorted(glob.glob(os.path.join(glob.escape(workdir), "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    records = list(_records(data))
    events = [Event.FromString(body) for _, _, body in records]
    keep = [e.HasField("file_version") or e.step <= limit for e in events]
    whole = records[-1][1] if records else 0  # where the whole records end: a torn one follows
    if all(keep) and whole == len(data):
      continue
    prefix = keep.index(False) if not all(keep) else len(keep)
    if not any(keep[prefix:]):
      os.truncate(path, records[prefix - 1][1] if prefix else 0)
    else:
      tmp = os.path.join(workdir, ".trim." + os.path.basename(path).replace("tfevents", "tmp"))
      with open(tmp, "wb") as f:
        f.write(b"".join(data[a:b] for (a, b, _), k in zip(records, keep) if k))
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    changed.append(path)
  return changed


class EventWriter:
  """One TensorBoard events file, every event written into it at once; flush() puts it on disk.

  Not tensorboardX's SummaryWriter: that hands events to a background thread through a queue which its
  flush() does not drain (up to max_queue events added before a flush are still in memory after it), so
  a checkpoint could hold steps TensorBoard loses to a kill. Built from tensorboardX's own parts (its
  EventsWriter, summary protos). `purge_step` starts the file with SessionLog.START at that step, which
  TensorBoard's reader takes as "drop every earlier event at this step or later" (what SummaryWriter's
  purge_step writes): a TensorBoard left running through a kill has read the stretch after the
  checkpoint before trim_events cut it from the files, and this tells it to forget it.
  """

  def __init__(self, logdir: str, purge_step: int | None = None):
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    self._event = Event
    # A fixed-width nanosecond suffix: two files opened within one second get distinct names, in order.
    self._writer = EventsWriter(os.path.join(logdir, "events"), f".{time.time_ns()}")
    if purge_step is not None:
      self._writer.write_event(
        Event(wall_time=time.time(), step=int(purge_step), session_log=SessionLog(status=SessionLog.START))
      )
    self.flush()

  def add(self, summary, step: int = 0) -> None:
    self._writer.write_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

  def scalar(self, tag: str, value: float, step: int) -> None:
    from tensorboardX import summary

    self.add(summary.scalar(tag, float(value)), step)

  def text(self, tag: str, text: str, step: int = 0) -> None:
    from tensorboardX import summary

    self.add(summary.text(tag, text), step)

  def hparams(self, hparams: dict, metrics) -> None:
    """The hparams dashboard's session: `hparams` (str, bool, int, float values) against `metrics` tags."""
    from tensorboardX import summary

    experiment, start, _ = summary.hparams(hparams, dict.fromkeys(metrics, 0.0))
    self.add(experiment)
    self.add(start)

  def end_session(self) -> None:
    """The hparams session's end (status: success); a resumed run's file closes the session too."""
    from tensorboardX import summary

    self.add(summary.hparams({}, {})[2])

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


def hparams(config) -> dict:
  """The config as flat {dotted key: str, bool, int or float} for TensorBoard's hparams dashboard
  (other values as their text, None left out)."""
  return {
    k: v if isinstance(v, (str, bool, int, float)) else str(v)
    for k, v in flat_config(config).items()
    if v is not None
  }

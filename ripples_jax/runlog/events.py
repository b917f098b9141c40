"""TensorBoard: one events file per run segment, written as records come (no queue), and the tags.

A record's keys map to tags (tb_tag): train/... for the training curve, eval/... for what an evaluation
measures; the hparams dashboard gets the config (hparams) against TB_METRICS.
"""

import os
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


class EventWriter:
  """One TensorBoard events file, every event written into it at once; flush() puts it on disk.

  Not tensorboardX's SummaryWriter: that hands events to a background thread through a queue which its
  flush() does not drain (up to max_queue events added before a flush are still in memory after it), so
  a checkpoint could hold steps TensorBoard loses to a kill. Built from tensorboardX's own parts (its
  EventsWriter, summary protos); `purge_step` starts the file with SessionLog.START at that step, which
  TensorBoard's reader takes as "drop every earlier event at this step or later" (what SummaryWriter's
  purge_step writes).
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

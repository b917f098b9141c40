"""Run outputs: metrics.jsonl (one JSON object per logged step), TensorBoard events, summary.json."""
import json
import math
import os

import numpy as np


class MetricWriter:
  """Appends one JSON line per record and mirrors every scalar to TensorBoard."""

  def __init__(self, workdir: str, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # lazy: keeps library imports light
      self._tb = SummaryWriter(workdir)

  def write(self, record: dict) -> None:
    record = {k: to_python(v) for k, v in record.items()}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, record["step"])

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


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
  """Stops a run at the first non-finite logged value, naming the step and the last good checkpoint
  (NaN check after logging, so the bad value is on disk)."""
  for k, v in values.items():
    if v is not None and not math.isfinite(v):
      where = f"; the last good checkpoint is {last_checkpoint}" if last_checkpoint else ""
      raise FloatingPointError(f"{k} is {v} at step {step}; stopping the run{where}")


def summary_table(rows: list[dict]) -> str:
  """A short plain-text table: algorithm, workers, steps, test accuracy, time."""
  head = ("algorithm", "workers", "steps", "test_acc", "time_s")
  lines = [head] + [(r["algorithm"], str(r["num_workers"]), str(r["num_steps"]),
                     f"{100 * r['final_test_accuracy']:.2f}%", f"{r['time']:.1f}") for r in rows]
  widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
  fmt = lambda l: "  ".join(s.ljust(w) for s, w in zip(l, widths))
  return "\n".join([fmt(lines[0]), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines[1:]])

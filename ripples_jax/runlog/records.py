"""metrics.jsonl and the other record files: strict JSON lines, cut back on resume, archived on a
fresh start, and the summary's shared keys.

A record is one line holding a JSON object with a "step". A resume keeps the lines a checkpoint counted
(cut_records), and of them only the whole records: a torn or short file is repaired to its last whole
record with one warning naming what was dropped. A fresh start in a used workdir moves the earlier
run's files aside under the first free number (archive); nothing is overwritten.
"""

import glob
import json
import math
import os
import threading

import numpy as np

from ripples_jax.runlog.storage import durable_write

SUMMARY_KEYS = (
  "algorithm",
  "executor",
  "num_workers",
  "num_steps",
  "final_test_accuracy",
  "final_worker_test_accuracy",
  "final_consensus_distance",
  "final_train_loss",
  "time",
  "worker_steps",
  "throughput",
  "workdir",
)


def to_python(v):
  """numpy/jax scalars and arrays -> JSON-friendly python values."""
  if hasattr(v, "tolist"):
    v = np.asarray(v).tolist()
  return v


def write_json(path: str, obj: dict, indent: int | None = 2) -> None:
  """Atomic write: a reader never sees a half-written file. indent=None: compact (large stores)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(
      {k: to_python(v) for k, v in obj.items()}, f, indent=indent, separators=None if indent else (",", ":")
    )
  os.replace(tmp, path)


def write_json_once(path: str, make) -> dict:
  """The JSON object at `path`; if there is none, `make()` is written there first. The first writer
  wins (a hard link never replaces a file), so processes racing here all return one object, and a
  file once written is never rewritten."""
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
      json.dump({k: to_python(v) for k, v in make().items()}, f, indent=2)
    try:
      os.link(tmp, path)
    except FileExistsError:
      pass
    finally:
      os.unlink(tmp)
  with open(path) as f:
    return json.load(f)


def check_finite(step: int, last_checkpoint: str | None = None, **values) -> None:
  """Raises FloatingPointError at the first non-finite value, naming the step and the last checkpoint."""
  for k, v in values.items():
    if v is not None and not math.isfinite(v):
      where = f"; the last good checkpoint is {last_checkpoint}" if last_checkpoint else ""
      raise FloatingPointError(f"{k} is {v} at step {step}; stopping the run{where}")


def archive(workdir: str) -> int | None:
  """Moves an earlier run's records aside under the first free number; returns it (None: nothing).

  Its TensorBoard events go to the folder tensorboard.<k>/ (TensorBoard shows it as a run of its own).
  """
  # clock.jsonl: the runtime's starts; growth.jsonl: its coordinator's store keys, memory and fds
  names = ("metrics.jsonl", "config.json", "summary.json", "clock.jsonl", "growth.jsonl")
  present = [n for n in names if os.path.exists(os.path.join(workdir, n))]
  events = event_files(workdir)
  if not present and not events:
    return None
  k = 1
  while any(os.path.exists(os.path.join(workdir, numbered(n, k))) for n in names) or os.path.exists(
    os.path.join(workdir, f"tensorboard.{k}")
  ):
    k += 1
  for n in present:
    os.replace(os.path.join(workdir, n), os.path.join(workdir, numbered(n, k)))
  if events:
    os.makedirs(os.path.join(workdir, f"tensorboard.{k}"))
    for path in events:
      os.replace(path, os.path.join(workdir, f"tensorboard.{k}", os.path.basename(path)))
  return k


def event_files(workdir: str) -> list[str]:
  """The TensorBoard events files directly in `workdir`, oldest first (TensorBoard's reading order)."""
  return sorted(glob.glob(os.path.join(glob.escape(workdir), "events.out.tfevents.*")))


def numbered(name: str, k: int) -> str:
  stem, ext = os.path.splitext(name)
  return f"{stem}.{k}{ext}"


def count_lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    return sum(1 for _ in f)


def last_step(path: str) -> int | None:
  """The step of the last whole record in a metrics.jsonl, or None (no file, no record)."""
  records = whole_records(path)
  return int(json.loads(records[-1])["step"]) if records else None


def whole_records(path: str, limit: int | None = None) -> list[bytes]:
  """The file's lines (of the first `limit`) up to the first that is not a whole record: a line cut
  short (no newline; a kill mid-write) or one that is not a JSON object with a step (a torn write)."""
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    lines = f.readlines()
  kept = []
  for line in lines[:limit]:
    try:
      ok = line.endswith(b"\n") and "step" in json.loads(line)
    except (ValueError, TypeError):
      ok = False
    if not ok:
      break
    kept.append(line)
  return kept


def cut_records(path: str, n: int) -> str | None:
  """Cuts a metrics.jsonl back to its first n lines, the records a checkpoint counted (atomically):
  what a lost run wrote after them goes. A torn or short file keeps its whole records before the first
  bad line; the returned warning names what was dropped or is missing (None: nothing was)."""
  name = os.path.basename(path)
  if not os.path.exists(path):
    return (
      f"{path} is missing: the checkpoint counted {n} records before it; the run goes on without them"
      if n
      else None
    )
  with open(path, "rb") as f:
    lines = f.readlines()
  kept = whole_records(path, n)
  if len(lines) > len(kept):
    durable_write(path, lambda f: f.writelines(kept))
  if len(kept) == n:
    return None
  if len(lines) < n and len(kept) == len(lines):
    lost = f"record {n} is" if len(lines) + 1 == n else f"records {len(lines) + 1}-{n} are"
    return f"{name} holds {len(lines)} of the {n} records the checkpoint counted: {lost} lost"
  bad = lines[len(kept)]
  return (
    f"{name}: line {len(kept) + 1} is not a whole record ({bad[:60]!r}); kept the {len(kept)} records "
    f"before it, dropped {min(n, len(lines)) - len(kept)} of the {n} the checkpoint counted"
  )


def summary_table(rows: list[dict]) -> str:
  """A short plain-text table: algorithm, workers, steps, test accuracy, and the run's time: time_s in
  seconds, or virtual_s, the simulator's virtual seconds (executor=sim; a mix of both gets both)."""
  simulated = [r.get("executor") == "sim" for r in rows]
  units = [u for u, on in (("time_s", not all(simulated)), ("virtual_s", any(simulated))) if on]
  head = ("algorithm", "workers", "steps", "test_acc", *units)
  times = lambda r, sim: [f"{r['time']:.1f}" if (u == "virtual_s") == sim else "-" for u in units]
  lines = [head] + [
    (
      r["algorithm"],
      str(r["num_workers"]),
      str(r["num_steps"]),
      f"{100 * r['final_test_accuracy']:.2f}%",
      *times(r, sim),
    )
    for r, sim in zip(rows, simulated)
  ]
  return text_table(lines)


def pipeline_table(rows: list[dict]) -> str:
  """summary_table's layout for pipeline runs: method, stages, batches, test accuracy, time_s, and the
  measured time per iteration (one process per stage) or the timing model's speedup over BP ('-' when
  a run has neither)."""

  def fmt(value, spec):
    return "-" if value is None or value != value else format(value, spec)  # None or NaN

  head = ("method", "stages", "batches", "test_acc", "time_s", "iteration_ms", "modeled_vs_bp")
  lines = [head]
  for r in rows:
    iteration = r.get("iteration_s")
    lines.append(
      (
        r["method"],
        str(r["num_stages"]),
        str(r.get("num_batches", "-")),
        f"{100 * r['final_test_accuracy']:.2f}%",
        f"{r['time']:.1f}",
        fmt(None if iteration is None else 1e3 * iteration, ".1f"),
        fmt(r.get("modeled_speedup_vs_bp"), ".2f"),
      )
    )
  return text_table(lines)


def text_table(lines: list) -> str:
  """Rows of strings (the first is the header) as left-aligned columns under a dashed rule."""
  widths = [max(len(l[i]) for l in lines) for i in range(len(lines[0]))]
  fmt = lambda l: "  ".join(s.ljust(w) for s, w in zip(l, widths)).rstrip()
  return "\n".join([fmt(lines[0]), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines[1:]])

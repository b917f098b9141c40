"""Per-worker event traces (DIR/trace-<worker>.jsonl) and their merge into the simulator's Gantt chart.

One JSON object per line, times in seconds since the run's common start (the start barrier); "c" is
the number of checkpoint markers the worker had passed (a resume keeps the events before its marker):
  {"k": "step",  "c", "s": local step, "t0", "t1", "c_end": end of real compute, "loss"}
  {"k": "group", "c", "g": global sequence number (AD-PSGD: "<active>.<request>"), "m": members,
                 "t0": call, "t1": return, "during": the local step it landed in (AD-PSGD's passive side)}
  {"k": "mark",  "c", "kind": "eval" | "ckpt", "id", "t", "s": local steps completed}
  {"k": "end",   "c", "t", "s", "compiles", "rtt": request round trips (s), "blocked": waits for an
                 answer (s): each a list, or past authority.Durations.EXACT of them its histogram}
Elastic runs (runtime/membership.py) add: on a group, "join" (rejoined members, weight 0), "failed"
(the members whose exchange with this one failed: it kept its model) and "cause" (each failure's,
preduce.failure_cause: summary.json's failed_groups counts them); {"k": "member", "kind": leave |
join, "w", "inc", "t"} (its queue's membership entries); {"k": "rejoin", "inc", "g0": groups made
before it, "t", "s"} (a restarted process's first line: what follows is its new life).
A step is compute up to "c_end", then the padding and any injected slowdown (shown as compute). A
group's wait is from this member's call to the last member's call; the rest is communication.
"""

import glob
import json
import os
import threading

import numpy as np

from ripples_jax.runlog.storage import durable_write


def trace_path(workdir: str, worker: int) -> str:
  return os.path.join(workdir, f"trace-{worker}.jsonl")


class TraceWriter:
  """Buffers events and appends them at block boundaries (and at exit). write_through (elastic): every
  event is appended as it is added, so a worker killed anywhere has recorded every state it shared
  (the replay needs them); a write is one line to the page cache, which outlives the process.

  Thread-safe: AD-PSGD's passive side adds its averages from its serving thread while the main
  thread adds steps and marks; without the lock, an event added between one flush's write and its
  reset of the buffer was dropped (a replay then finds a group one member never recorded)."""

  def __init__(
    self,
    workdir: str,
    worker: int,
    keep_before_epoch: int | None = None,
    write_through=False,
    append=False,
    path: str | None = None,
  ):
    """append: a rejoined worker's new life continues its file as it is (elastic). path: a file other
    than the worker's trace (a parameter server's records: runtime/ps.py)."""
    self.path, self.write_through = path or trace_path(workdir, worker), write_through
    if not append and keep_before_epoch is not None and os.path.exists(self.path):
      # A resumed run continues from checkpoint marker `keep_before_epoch`: drop what the lost run did
      # after it (its events carry a later epoch).
      kept = [e for e in read_trace(self.path) if e["c"] < keep_before_epoch]
      durable_write(self.path, lambda f: f.writelines(json.dumps(e) + "\n" for e in kept), "w")
    elif not append and keep_before_epoch is None and os.path.exists(self.path):
      os.remove(self.path)
    self.events = []
    self.lock = threading.Lock()

  def add(self, **event) -> None:
    with self.lock:
      self.events.append(event)
    if self.write_through:
      self.flush()

  def flush(self) -> None:
    with self.lock:
      events, self.events = self.events, []
      if events:
        with open(self.path, "a") as f:
          f.writelines(json.dumps(e) + "\n" for e in events)


def read_trace(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def load_traces(workdir: str) -> dict:
  """{worker: [events]} for every trace file in workdir."""
  out = {}
  for path in glob.glob(os.path.join(workdir, "trace-*.jsonl")):
    out[int(os.path.basename(path)[len("trace-") : -len(".jsonl")])] = read_trace(path)
  return dict(sorted(out.items()))


def load_starts(workdir: str, earlier: bool = False) -> list[dict]:
  """clock.jsonl's starts of the run (coordinator.record_start): [{"wall", "run"}], first start first.
  earlier: the archived clock.<k>.jsonl first, in k's order (a job restarted from scratch, with no
  checkpoint to resume, moved its first life's records aside: runlog.records.archive)."""
  k, paths = 1, []
  while earlier and os.path.exists(path := os.path.join(workdir, f"clock.{k}.jsonl")):
    paths, k = paths + [path], k + 1
  out = []
  for path in paths + [os.path.join(workdir, "clock.jsonl")]:
    with open(path) as f:
      out += [json.loads(line) for line in f if line.strip()]
  return out


def wall_clock(starts: list[dict], t: float) -> float:
  """Wall-clock seconds since the run's first start of run time t: the start t belongs to is the last
  whose run clock is at or before t (a resumed run's clock continues from its marker, so the work redone
  and the restart, in no trace, are in the gap between two starts' wall times)."""
  k = max(i for i, s in enumerate(starts) if s["run"] <= t + 1e-9) if t >= starts[0]["run"] else 0
  return starts[k]["wall"] + (t - starts[k]["run"]) - starts[0]["wall"]


def death_time(traces: dict, worker: int) -> float:
  """The end of a killed worker's last recorded event of its first life (it died right after: an
  elastic worker's trace is written through, so its last state shared is there)."""
  first = []
  for e in traces[worker]:
    if e["k"] == "rejoin":
      break
    first.append(e.get("t1", e.get("t", 0.0)))
  return max(first)


def ring_latency(*runs: dict) -> float:
  """The ring all-reduce latency per message that explains the group times of one or more runs
  (each a {worker: events} dict): each group's communication (its last member's arrival to its end)
  over 2 (k - 1) messages, the median over the groups of all of them (0.0 without groups). The
  simulator's timeline.alpha, fed from runs."""
  per_message = []
  for traces in runs:
    arrivals, groups = {}, {}
    for events in traces.values():
      for e in events:
        if e["k"] == "group":
          arrivals[e["g"]] = max(arrivals.get(e["g"], e["t0"]), e["t0"])
          groups.setdefault(e["g"], []).append(e)
    for g, evs in groups.items():
      k = len(evs[0]["m"])
      per_message.append(max(max(e["t1"] for e in evs) - arrivals[g], 0.0) / (2 * (k - 1)))
  return float(np.median(per_message)) if per_message else 0.0


def intervals(traces: dict) -> list:
  """(worker, kind, t0, t1) with kind compute / wait / comm, as timeline.Trace.intervals."""
  arrivals = {}
  for events in traces.values():
    for e in events:
      if e["k"] == "group":
        arrivals[e["g"]] = max(arrivals.get(e["g"], e["t0"]), e["t0"])
  out = []
  for w, events in traces.items():
    own = {e["during"]: e for e in events if e["k"] == "group" and e.get("own")}
    for e in events:
      if e["k"] == "step" and e["s"] in own:
        out += _overlapped(w, e, own[e["s"]], arrivals)
      elif e["k"] == "step":
        out.append((w, "compute", e["t0"], e["t1"]))
      elif e["k"] == "group" and "during" not in e:
        last = min(max(arrivals[e["g"]], e["t0"]), e["t1"])
        if last > e["t0"]:
          out.append((w, "wait", e["t0"], last))
        out.append((w, "comm", last, e["t1"]))
      # A group "during" a step overlaps its compute: a passive worker's served average (its
      # communication thread), or an active worker's own (counted with its step: _overlapped).
  return out


def _overlapped(w: int, step: dict, group: dict, arrivals: dict) -> list:
  """AD-PSGD's active step, whose average overlaps its gradient: compute until the padded compute
  ends, then what of the average is left (waiting for the passive worker, then the exchange), then
  the apply."""
  t0, ce, t1, g1 = step["t0"], step.get("c_end", step["t1"]), step["t1"], group["t1"]
  out = [(w, "compute", t0, ce)]
  if g1 > ce:
    last = min(max(arrivals[group["g"]], ce), g1)
    if last > ce:
      out.append((w, "wait", ce, last))
    out.append((w, "comm", last, g1))
  if t1 > max(ce, g1):
    out.append((w, "compute", max(ce, g1), t1))
  return out


def time_split(traces: dict) -> dict:
  """Seconds per worker computing, waiting and communicating."""
  split = {k: [0.0] * (max(traces) + 1 if traces else 0) for k in ("compute", "wait", "comm")}
  for w, kind, t0, t1 in intervals(traces):
    split[kind][w] += t1 - t0
  return split


def write_gantt(
  workdir: str, path: str | None = None, title: str | None = None, t_max: float | None = None
) -> str:
  """Merges the traces of a run into DIR/gantt.png (the simulator's chart, in wall-clock time)."""
  traces = load_traces(workdir)
  if not traces:
    raise FileNotFoundError(f"{workdir}: no trace-<worker>.jsonl files")
  path = path or os.path.join(workdir, "gantt.png")
  from ripples_jax import analysis  # here, not at the top: it loads matplotlib, which no worker needs

  analysis.gantt(
    intervals(traces),
    max(traces) + 1,
    path,
    title or f"runtime trace: {workdir}",
    t_max,
    xlabel="wall-clock time (s)",
  )
  return path

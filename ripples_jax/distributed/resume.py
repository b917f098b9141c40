"""Multi-process resume: the newest checkpoint every process can restore, agreed through the
coordination service's key-value store (no collective: it runs before any program is compiled).

Each process checkpoints alone (RunLog per_process: ckpt/<process>/<step>), so after a kill the
processes may hold different steps, and one process's newest may be corrupt. The protocol:
  1. every process publishes its committed steps; the candidates are the steps all of them hold;
  2. round r: every process tries candidate r (reads it back, checks its fingerprint) and publishes
     ok or bad; if all say ok, every process resumes from it, else all go on to the next candidate.
Every process sees the same verdicts in the same order, so all resume from the same step or all
refuse. `excused(step)` (an elastic run: the workers out at that marker, dead or still joining, read
from its authority snapshot by every process alike) names processes that need not hold a candidate:
they vote ok without reading, and get (step, None, None) back (they rejoin the resumed run).
What a process may delete or move (RunLog.resume_from): its own candidates that it tried
and found unusable, once an older one restored everywhere; its other newer steps are set aside, never
deleted (another process's are its own business). When steps exist somewhere and no candidate
restores everywhere, every process refuses (ResumeRefused) and nothing is deleted.
"""

from absl import logging

from ripples_jax.runlog import ResumeRefused, RunLog
from ripples_jax.runlog.workdir import differences

KEY = "ripples/resume"


def exchange(kv, name: str, me: int, n: int, value: str, timeout_s: float) -> list[str]:
  """Publishes this process's `value` under `name` and returns every process's, in process order."""
  kv.key_value_set(f"{KEY}/{name}/{me}", value, allow_overwrite=True)
  return [kv.blocking_key_value_get(f"{KEY}/{name}/{w}", int(timeout_s * 1000)) for w in range(n)]


def restore_common(
  log: RunLog,
  kv,
  me: int,
  n: int,
  like,
  timeout_s: float,
  resumable: bool = True,
  what: str = "process",
  excused=None,
):
  """(step, state, cursor) from the newest step every process restores, or None (a fresh start:
  no process holds a checkpoint). `resumable=False`: an executor without mid-run checkpoints, which
  refuses a workdir holding any rather than start over them. excused: step -> the processes that
  need not hold it (see above); such a process gets (step, None, None)."""
  excused = excused or (lambda step: set())
  mine = log.committed()
  held = [
    {int(v) for v in s.split() if v != "-"}
    for s in exchange(kv, "held", me, n, " ".join(map(str, mine)) or "-", timeout_s)
  ]
  anyone = any(held)
  if anyone and not resumable:
    raise ResumeRefused(
      f"--workdir: {log.workdir!r} is not allowed: it holds checkpoints of an earlier run "
      f"({log.ckpt_dir}: {sorted(held[me]) or 'none'}) and this algorithm does not resume "
      "from them; nothing was deleted; use another --workdir or move its ckpt/ aside"
    )
  unusable, reasons = [], {}
  out = {s: set(excused(s)) for s in sorted(set().union(*held), reverse=True)}
  candidates = [s for s, o in out.items() if len(o) < n and all(s in held[w] or w in o for w in range(n))]
  for r, step in enumerate(candidates):
    if me in out[step]:  # out at this marker: nothing of its own to read
      verdicts = exchange(kv, f"try/{r}", me, n, "ok", timeout_s)
      if all(v == "ok" for v in verdicts):
        return step, None, None
      continue
    got = log.try_restore(step, like)
    if isinstance(got, str):
      unusable.append(step)
      reasons[step] = got
    verdicts = exchange(kv, f"try/{r}", me, n, "bad" if isinstance(got, str) else "ok", timeout_s)
    if all(v == "ok" for v in verdicts):
      return log.resume_from(step, *got, unusable=unusable)
    bad = [w for w, v in enumerate(verdicts) if v != "ok"]
    logging.warning(
      "checkpoint %d: %s %s cannot restore it; trying the previous one every %s holds", step, what, bad, what
    )
  if anyone:
    listing = "; ".join(f"{what} {w}: {sorted(h) or 'none'}" for w, h in enumerate(held))
    changed = differences(log.saved_identity(mine[0]), log.identity) if mine else []
    why = (
      f"the config changed ({'; '.join(changed)}) and its arrays do not fit this config"
      if changed
      else f"no checkpoint every {what} can restore"
    )
    here = f"; here {max(reasons)}: {reasons[max(reasons)]}" if reasons else ""
    raise ResumeRefused(
      f"--workdir: {log.workdir!r} is not allowed: {why} ({listing}{here}); nothing was "
      f"deleted; rerun with the config that wrote them, move {log.workdir}/ckpt aside to "
      "start afresh, or use another --workdir"
    )
  log.start_fresh()
  return None


def publish_point(kv, log: RunLog | None, step: int | None) -> None:
  """Worker 0 of an executor=async run, once every worker agreed: the resume point for the
  coordinator, which holds no checkpoint but owns the records: {"mark", "meta"} (the checkpoint's
  metrics line count, identity and newest values), or null for a fresh start."""
  import json

  point = None
  if step is not None:
    meta = log.resumed_meta
    point = {
      "mark": int(step),
      "meta": {k: meta[k] for k in ("metrics_lines", "identity", "last") if k in meta},
    }
  kv.key_value_set(f"{KEY}/point", json.dumps(point), allow_overwrite=True)


def await_point(kv, timeout_s: float) -> dict | None:
  """The coordinator: the point publish_point sent (None: a fresh start); a malformed one ends the
  run before any record is cut back, with one line (wire.Malformed)."""
  from ripples_jax.distributed import wire

  key = f"{KEY}/point"
  value = kv.blocking_key_value_get(key, int(timeout_s * 1000))
  point = wire.require(wire.point(key, value), key, value)
  return None if point["mark"] is None else point

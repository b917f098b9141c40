"""The runtime's values in jax's coordination store, decoded and checked in one place.

Every value the runtime reads back from the store (a heartbeat, a start report, a Group Generator
request or queue entry, a join slot, a removal, the AD-PSGD roster, the resume point) goes through one
decoder here. A decoder returns the value, checked (field count, integers and finite floats, worker ids
in [0, n), lives and steps >= 0, known kinds), or None after one warning line naming the key and what
was wrong; the caller skips the value and goes on. A stray or malformed entry, whoever wrote it, never
stops, hangs or silently steers a run (the store is reachable by any process that can reach the
coordinator's port: docs/usage.md, Security). Where a value is needed to go on at all (a restarted
worker's answer, the resume point), `require` turns None into one clear error.

The writers' formats are the ones documented at each decoder; the writers keep their own encoders.
"""

import json
import logging
import math

_warned: set = set()  # (key family, why): one warning each, not one per heartbeat tick


class Malformed(ValueError):
  """A store value that cannot be used (require)."""


def _family(key: str) -> str:
  """A key without its worker, life and sequence numbers: 'ripples/hb/3.1' -> 'ripples/hb/*'."""
  return "/".join("*" if p.replace(".", "").replace("-", "").isdigit() else p for p in key.split("/"))


def bad(key: str, value, why: str) -> None:
  """One warning for a value dropped (once per key family and reason); returns None."""
  if (_family(key), why) not in _warned:
    _warned.add((_family(key), why))
    logging.warning("%s: %s (%r); ignored", key, why, str(value)[:80])
  return None


def require(decoded, key: str, value=None):
  """A decoded value a caller cannot go on without: Malformed (one line) where it is None."""
  if decoded is None:
    raise Malformed(f"{key}: a malformed value in the coordination store ({str(value)[:80]!r})")
  return decoded


def _int(text: str, lo: int = 0, hi: float = math.inf):
  try:
    v = int(text)
  except (TypeError, ValueError):
    return None
  return v if lo <= v <= hi else None


def _float(text: str, lo: float = -math.inf):
  try:
    v = float(text)
  except (TypeError, ValueError):
    return None
  return v if math.isfinite(v) and v >= lo else None


def life_key(key: str, n: int):
  """(worker, life) of a per-life key ('.../hb/3', '.../started/3.2'): worker in [0, n), life >= 0."""
  w, _, inc = key.rsplit("/", 1)[1].partition(".")
  w, inc = _int(w, 0, n - 1), _int(inc or "0")
  if w is None or inc is None:
    return bad(key, key, f"not a worker of 0..{n - 1} and a life >= 0")
  return w, inc


def beat(key: str, value: str):
  """A heartbeat, '<beat> <steps> <events> <done 0|1>[ <life>]' (watchdog.Watchdog): (steps, events,
  done, life)."""
  parts = str(value).split()
  if len(parts) not in (4, 5):
    return bad(key, value, "a heartbeat has 4 or 5 fields")
  got = [_int(p) for p in parts[:3]] + [parts[3] in ("0", "1")] + [_int(parts[4]) if len(parts) > 4 else 0]
  if None in got or got[3] is False:
    return bad(key, value, "a heartbeat's fields are integers >= 0 and done 0 or 1")
  return got[1], parts[2], parts[3] == "1", got[4]


def life(key: str, value: str):
  """A life (removed/<w>: the life removed): an integer >= 0."""
  v = _int(value)
  return bad(key, value, "a life is an integer >= 0") if v is None else v


def worker_id(key: str, value: str, n: int):
  """A worker id (join/<slot>: who asks to rejoin): an integer in [0, n)."""
  v = _int(value, 0, n - 1)
  return bad(key, value, f"a worker is an integer in [0, {n})") if v is None else v


def report(key: str, fields, max_steps: int):
  """A start report, '<steps> <started_at> <step_time> <last_gid> <epoch>' (authority.Feed): steps in
  [0, max_steps] (a report past the run's budget would end it), finite times, step time >= 0,
  last_gid >= -1, epoch >= 0."""
  parts = fields if isinstance(fields, (list, tuple)) else str(fields).split()
  if len(parts) != 5:
    return bad(key, fields, "a start report has 5 fields")
  got = (
    _int(parts[0], 0, max_steps),
    _float(parts[1]),
    _float(parts[2], 0.0),
    _int(parts[3], -1),
    _int(parts[4]),
  )
  if None in got:
    return bad(
      key, fields, f"a start report is steps in [0, {max_steps}], finite times, gid >= -1, epoch >= 0"
    )
  return got


def request(key: str, value: str, max_steps: int):
  """A Group Generator request, '<taken> <ready_at> <step_time>[ <start report>]' (authority.Feed):
  (taken >= 0, ready_at finite, step_time finite >= 0, the decoded start report or None)."""
  parts = str(value).split()
  if len(parts) not in (3, 8):
    return bad(key, value, "a request has 3 fields, or 8 with its start report")
  got = (_int(parts[0], 0, max_steps), _float(parts[1]), _float(parts[2], 0.0))
  if None in got:
    return bad(key, value, "a request is steps taken >= 0, a finite time and a step time >= 0")
  rep = report(key, parts[3:], max_steps) if len(parts) == 8 else None
  if len(parts) == 8 and rep is None:
    return None
  return (*got, rep)


_KINDS = {"G", "N", "M", "S", "E"}


def entries(key: str, value: str, n: int):
  """A queue page, entries joined by '|' (online.encode): the decoded entries, each checked (group
  ids >= 0, members distinct workers of [0, n), joiners among them, markers eval or ckpt with an id
  >= 0, membership entries join or leave of a worker in [0, n) with a life >= 0)."""
  from ripples_jax.schedule import online

  out = []
  for text in str(value).split("|"):
    parts = text.split()
    if not parts or parts[0] not in _KINDS:
      return bad(key, value, f"an entry is one of {sorted(_KINDS)}")
    try:
      entry = online.decode(text)
    except (ValueError, IndexError):
      return bad(key, value, "an entry's fields do not parse")
    if not _entry_ok(entry, n, len(parts)):
      return bad(key, value, f"an entry names workers of [0, {n}), ids >= 0 and known kinds")
    out.append(entry)
  return out


def _entry_ok(entry: tuple, n: int, fields: int) -> bool:
  kind = entry[0]
  if kind == "G":
    members = entry[2]
    joiners = entry[3] if len(entry) > 3 else ()
    return (
      fields in (3, 4)
      and entry[1] >= 0
      and len(set(members)) == len(members) >= 1
      and all(0 <= m < n for m in members)
      and set(joiners) <= set(members)
    )
  if kind == "M":
    return fields == 3 and entry[1] in ("eval", "ckpt") and entry[2] >= 0
  if kind == "E":
    return fields == 4 and entry[1] in ("join", "leave") and 0 <= entry[2] < n and entry[3] >= 0
  return fields == 1


def roster(key: str, value: str, n: int | None):
  """AD-PSGD's roster, '<version> <lives csv> <alive 0/1 string>' (membership.encode_roster): version
  >= 0, n lives >= 0, n alive flags (n None: as many flags as lives)."""
  parts = str(value).split()
  if len(parts) != 3:
    return bad(key, value, "a roster has 3 fields")
  version, incs = _int(parts[0]), [_int(i) for i in parts[1].split(",")]
  n = len(incs) if n is None else n
  if version is None or None in incs or len(incs) != n or len(parts[2]) != n or set(parts[2]) - {"0", "1"}:
    return bad(key, value, f"a roster is a version >= 0, {n} lives >= 0 and {n} alive flags")
  return version, incs, [a == "1" for a in parts[2]]


def seconds(key: str, value: str):
  """A time or a duration in seconds: a finite float."""
  v = _float(value)
  return bad(key, value, "a finite number of seconds") if v is None else v


def point(key: str, value: str):
  """The resume point (runtime/resume.py): JSON null, or {"mark": int >= 0, "meta": {...}}."""
  try:
    got = json.loads(value)
  except (TypeError, ValueError):
    return bad(key, value, "the resume point is JSON")
  if got is None:
    return {"mark": None}
  ok = isinstance(got, dict) and isinstance(got.get("meta"), dict) and _int(got.get("mark")) is not None
  lines = got.get("meta", {}).get("metrics_lines", 0) if ok else None
  if not ok or isinstance(got.get("mark"), bool) or _int(lines) is None or isinstance(lines, bool):
    return bad(key, value, "the resume point is null or a mark >= 0 with its meta")
  return got


def token(key: str, value: str, allowed):
  """One of a channel's words (an exchange's decision, a verdict, a message kind)."""
  return value if value in allowed else bad(key, value, f"one of {sorted(allowed)}")

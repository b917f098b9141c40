"""Packing the clock's ordered events into engine rounds."""

import numpy as np

from ripples_jax.timeline.trace import APPLY, AVG, JOIN, OUTER, PULL, RING, START

# Phase of each event kind inside one engine round (engine.make_sim_round_fn): apply, average (DiLoCo's
# outer step is one: it replaces every worker's model), pull, start.
_PHASE = {APPLY: 0, AVG: 1, RING: 1, OUTER: 1, PULL: 2, JOIN: 2, START: 3}


def pack_rounds(events: list, num_workers: int, num_slots: int):
  """Greedily packs the ordered events into engine rounds without changing what any slot sees.

  A round runs phases apply < average < pull < start. An event joins the current round only if every
  slot it touches has had nothing at this phase or later in the round; otherwise a new round begins.
  Then each slot's events keep their clock order, and an average reads every member exactly at its
  place in that order, so the rounds compute what the ordered events describe.

  Yields dicts of numpy arrays: apply_src, gid, ring, outer (DiLoCo's outer step), pull_src, start,
  plus `time` (of the round's last
  event), `applied` (workers whose gradient landed) and `started`; a round with a JOIN also has `reset`
  (the slots whose optimizer state restarts; a JOIN is a pull that resets, 3.10).
  """
  ar = np.arange(num_slots, dtype=np.int32)

  def fresh():
    return {
      "apply_src": np.full(num_slots, -1, np.int32),
      "gid": ar.copy(),
      "ring": False,
      "outer": False,
      "pull_src": ar.copy(),
      "start": np.zeros(num_slots, bool),
      "time": 0.0,
      "applied": [],
    }

  last = np.full(num_slots, -1)
  cur, empty = fresh(), True
  for t, kind, a, b in events:
    phase = _PHASE[kind]
    if kind == APPLY:
      touched = (a, b)
    elif kind == AVG:
      touched = a
    elif kind == RING or kind == OUTER:
      touched = range(num_workers)
    elif kind == PULL or kind == JOIN:
      touched = (a, b)
    else:
      touched = (a,)
    if any(last[s] >= phase for s in touched):
      yield cur
      cur, empty = fresh(), True
      last[:] = -1
    if kind == APPLY:
      cur["apply_src"][a] = b
      cur["applied"].append(b)
    elif kind == AVG:
      cur["gid"][list(a)] = min(a)
    elif kind == RING:
      cur["ring"] = True
    elif kind == OUTER:
      cur["outer"] = True
    elif kind == PULL:
      cur["pull_src"][a] = b
    elif kind == JOIN:
      cur["pull_src"][a] = b
      cur.setdefault("reset", np.zeros(num_slots, bool))[a] = True
    else:
      cur["start"][a] = True
    for s in touched:
      last[s] = phase
    cur["time"] = t
    empty = False
  if not empty:
    yield cur

"""Replays a runtime's recorded event order through the single-process engine.

The runtime and the simulator must agree on what Ripples computes: given the order in which each
worker took its steps and joined its groups (the traces), the simulator's engine, starting from the same
x_0 with the same batches, must end at the same parameters. The traces are merged into one order that
respects every worker's own order and the global group order, then executed as timeline events.
"""

import jax
import numpy as np

from ripples_jax import data as data_lib
from ripples_jax import engine, timeline, workload
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.runtime import trace as trace_lib


def worker_sequence(events: list) -> list:
  """One worker's order as ("start", s) / ("apply", s) / ("group", key) / ("rejoin", life) tokens, in
  record order. AD-PSGD's passive side serves from another thread and says where each average landed:
  "during" step s (between its start and apply) or "after" k applied steps (before step k starts). An
  elastic worker's restarted process begins with a rejoin line, which starts its next life (life k:
  incarnation k); each life's during/after indices are its own (its steps continue the last life's
  count), and a life that ended inside a step (killed) still took the averages that landed during
  that step: at its end."""
  lives = [[]]
  for e in events:
    if e["k"] == "rejoin":
      lives.append([])
    lives[-1].append(e)
  seq = []
  for k, life in enumerate(lives):
    seq += [("rejoin", k)] if k else []
    seq += _life_sequence(life)
  return seq


def _life_sequence(events: list) -> list:
  during, after = {}, {}
  for e in events:
    if e["k"] == "group" and "during" in e:
      during.setdefault(e["during"], []).append(e["g"])
    elif e["k"] == "group" and "after" in e:
      after.setdefault(e["after"], []).append(e["g"])
  first = events[0]["s"] if events and events[0]["k"] == "rejoin" else 0  # steps before this life
  seq, stepped = [], set()
  for e in events:
    if e["k"] == "step":
      s = e["s"]
      if not stepped:
        seq += [("group", g) for g in after.get(first, [])]
      stepped.add(s)
      seq += [("start", s)] + [("group", g) for g in during.get(s, [])] + [("apply", s)]
      seq += [("group", g) for g in after.get(s + 1, [])]
    elif e["k"] == "group" and "during" not in e and "after" not in e:
      seq.append(("group", e["g"]))
  if not stepped:
    seq += [("group", g) for g in after.get(first, [])]
  for s in sorted(set(during) - stepped):  # the step in flight when this life ended
    seq += [("group", g) for g in during[s]]
  return seq


def _lives(traces: dict, info: dict) -> None:
  """info[g]["life"][m]: the life of member m that group g belongs to (its incarnation). AD-PSGD's
  events name their members' incarnations ("i"); the authority's groups are numbered in one order,
  so a member's life is the number of its rejoins made before the group (their g0 <= g)."""
  g0s = {w: [e["g0"] for e in events if e["k"] == "rejoin"] for w, events in traces.items()}
  for g, i in info.items():
    if i["incs"] is not None:
      i["life"] = dict(zip(i["m"], i["incs"]))
    else:
      i["life"] = {m: sum(g0 <= g for g0 in g0s.get(m, [])) for m in i["m"]}


def _groups(traces: dict, num_workers: int) -> tuple[dict, dict]:
  """(each worker's token sequence, each group's members and outcome: who applied its average, who
  recorded it as failed (runtime.elastic: an exchange with a dead member failed), its joiners, and
  each member's life)."""
  seqs, info = {}, {}
  for w in range(num_workers):
    events = traces.get(w, [])
    steps = [e["s"] for e in events if e["k"] == "step"]
    if steps != list(range(len(steps))):
      raise ValueError(f"worker {w}: steps recorded out of order: {steps[:10]}...")
    for e in events:
      if e["k"] == "group":
        g = info.setdefault(e["g"], {"m": tuple(e["m"]), "applied": set(), "failed": set(), "incs": None})
        g["join"] = set(e.get("join", ()))
        g["outer"] = bool(e.get("outer"))  # DiLoCo: the group's mean takes the outer step
        g["incs"] = e.get("i", g["incs"])
        (g["failed"] if e.get("failed") else g["applied"]).add(w)
    seqs[w] = worker_sequence(events)
  _lives(traces, info)
  return seqs, info


def merged_events(traces: dict, num_workers: int) -> list:
  """Timeline events (START/APPLY per step, AVG per group) in one order consistent with every trace.

  A topological merge: a group is emitted once it is next for all its members. The run executed some
  such order, so one exists; if none does, the traces contradict each other (an error).

  Elastic runs (runtime/membership.py): a group nobody applied is a no-op for whoever recorded it. A
  member that did not record a group someone applied died in it (its exchanges reached some members
  before the death): it takes part with its state at the end of that life (its next rejoin line, or
  its trace's end). Members that recorded the group as failed keep their model: their state is set
  aside in a scratch slot (num_workers + w) around the average (PULL, AVG, PULL back). A joiner has
  weight 0: AVG of the others, then JOIN (their mean and fresh optimizer state, docs/design.md 3.10)."""
  seqs, info = _groups(traces, num_workers)
  return _Merge(seqs, info, num_workers).run()


class _Merge:
  """The state of merged_events' merge: each worker's token sequence and its position in it, the
  events out so far and the groups emitted."""

  def __init__(self, seqs: dict, info: dict, num_workers: int):
    self.seqs, self.info, self.n = seqs, info, num_workers
    self.pos = {w: 0 for w in seqs}
    self.out, self.emitted = [], set()
    self.starts = {w: {t[1]: i for i, t in enumerate(seq) if t[0] == "rejoin"} for w, seq in seqs.items()}

  def run(self) -> list:
    """The merged events; raises ValueError when some worker cannot reach the end of its sequence."""
    # A list, not a generator: every worker advances once per round (any() alone would stop at the
    # first that moved, and the events would come out in another order).
    while any([self.advance(w) for w in self.seqs]):
      pass
    stuck = [self.seqs[w][self.pos[w]] for w in self.seqs if self.pos[w] < len(self.seqs[w])]
    if stuck:
      raise ValueError(
        f"the traces contradict one global order: groups {sorted({k for _, k in stuck}, key=str)[:5]} "
        "never had all their members"
      )
    return self.out

  def life_end(self, m, g) -> int:
    """Where member m's life that holds group g ends in its sequence (its next life's rejoin)."""
    return self.starts[m].get(self.info[g]["life"][m] + 1, len(self.seqs[m]))

  def ready(self, g) -> bool:
    """Whether group g is next in the sequence of every member that recorded it, and every other
    member that is not joining by it (it died in the group) is at the end of that life."""
    i, pos, seqs = self.info[g], self.pos, self.seqs
    for m in i["m"]:
      if m in i["applied"] or m in i["failed"]:
        if pos[m] >= len(seqs[m]) or seqs[m][pos[m]] != ("group", g):
          return False
      elif m not in i["join"] and pos[m] != self.life_end(m, g):  # it died in the group
        return False
    return True

  def emit(self, g) -> None:
    """Appends group g's events: the failed members' models set aside and back around the average of
    the weighted members, then each applied joiner's JOIN."""
    i, n, out = self.info[g], self.n, self.out
    for f in sorted(i["failed"]):
      out.append((0.0, timeline.PULL, n + f, f))
    weighted = tuple(m for m in i["m"] if m not in i["join"]) or i["m"]
    if i["outer"]:  # every worker's (DiLoCo has no elastic form): the engine's outer step
      out.append((0.0, timeline.OUTER, weighted, None))
    elif len(weighted) > 1:
      out.append((0.0, timeline.AVG, weighted, None))
    for j in sorted(i["join"] & i["applied"]):
      out.append((0.0, timeline.JOIN, j, weighted[0]))
    for f in sorted(i["failed"]):
      out.append((0.0, timeline.PULL, f, n + f))
    self.emitted.add(g)

  def owed(self, w, life) -> bool:
    """Whether some group someone applied that w died in, in its lives before `life`, is not yet
    emitted."""
    return any(
      w in i["m"]
      and w not in i["applied"] | i["failed"]
      and i["life"][w] < life
      and g not in self.emitted
      and i["applied"]
      for g, i in self.info.items()
    )

  def advance(self, w) -> bool:
    """Emits worker w's tokens until one must wait (a rejoin owed a group, a group not ready) or its
    sequence ends, moving the other recorders of each group emitted past it; whether w moved."""
    seq, pos, info, moved = self.seqs[w], self.pos, self.info, False
    while pos[w] < len(seq):
      kind, key = seq[pos[w]]
      if kind in ("start", "apply"):
        self.out.append((0.0, timeline.START, w, None) if kind == "start" else (0.0, timeline.APPLY, w, w))
      elif kind == "rejoin":
        if self.owed(w, key):
          return moved
      elif info[key]["applied"]:
        if not self.ready(key):
          return moved
        self.emit(key)
        for m in info[key]["applied"] | info[key]["failed"]:
          if m != w:
            pos[m] += 1
      pos[w] += 1
      moved = True
    return moved


def scratch_slots(traces: dict) -> bool:
  """Whether the replay needs a scratch slot per worker (a member kept its model in a group another
  member applied: merged_events)."""
  return any(e["k"] == "group" and e.get("failed") for events in traces.values() for e in events)


def replay(config, workdir: str, on_round=None) -> dict:
  """The engine's final state {"params", "model_state"} (leading worker axis) for the recorded order.
  on_round(started, steps, loss_S): after each round, the workers that started a step in it, their
  step numbers and the losses at those starts (benchmarks/replay_drift.py compares them with the
  traces')."""
  n = config.num_workers
  s = workload.build(config)
  data, shards, model, optimizer = s.data, s.shards, s.model, s.optimizer
  traces = trace_lib.load_traces(workdir)
  slots = 2 * n if scratch_slots(traces) else n
  elastic = bool(config.runtime.get("elastic", False))  # pulls and joins: runtime/membership.py
  mesh = make_worker_mesh(slots, jax.devices()[:1])
  state = engine.init_sim_state(
    model, optimizer, jax.random.key(config.seed), data["x_train"][:1], slots, mesh
  )
  outer = None  # DiLoCo: the engine's outer step (lr, Nesterov momentum), its global model in the state
  if config.algorithm == "diloco":
    outer = (float(config.diloco.outer_lr), float(config.diloco.outer_momentum))
  round_fn = engine.make_sim_round_fn(model, optimizer, mesh, n, slots, pull=elastic, outer=outer)
  if outer is not None:
    state["outer"] = engine.init_outer_state(state["params"])
  sharding = engine.worker_sharding(mesh)
  put = lambda a: jax.device_put(a, sharding)
  starts = np.zeros(slots, np.int64)
  shape = (slots, config.batch_size) + data["x_train"].shape[1:]
  for r in timeline.pack_rounds(merged_events(traces, n), n, slots):
    x, y = np.zeros(shape, data["x_train"].dtype), np.zeros(shape[:2], data["y_train"].dtype)
    started = np.flatnonzero(r["start"])
    if len(started):
      idx = data_lib.batch_indices(
        [shards[w] for w in started], config.batch_size, config.seed, starts[started], workers=started
      )
      x[started], y[started] = data["x_train"][idx], data["y_train"][idx]
    state, loss_S = round_fn(
      state,
      put(x),
      put(y),
      put(r["apply_src"]),
      put(r["gid"]),
      False,
      put(r["pull_src"]),
      put(r["start"]),
      *([put(r["reset"])] if "reset" in r else []),
      **({"outer_now": r["outer"]} if outer is not None else {}),
    )
    if on_round is not None:
      mine = started[started < n]
      on_round(mine, starts[mine].copy(), np.asarray(loss_S)[mine])
    starts += r["start"]
  keep = lambda a: a[:n]  # the workers' slots, not the scratch ones
  return {
    "params": jax.tree.map(keep, state["params"]),
    "model_state": jax.tree.map(keep, state["model_state"]),
  }

"""Replays a runtime's recorded event order through the single-process engine.

The runtime and the simulator must agree on what Ripples computes: given the order in which each
worker took its steps and joined its groups (the traces), the simulator's engine, starting from the same
x_0 with the same batches, must end at the same parameters. The traces are merged into one order that
respects every worker's own order and the global group order, then executed as timeline events.
"""

import jax
import numpy as np

from ripples_jax import data as data_lib
from ripples_jax import engine, timeline
from ripples_jax import setup as setup_lib
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.runtime import trace as trace_lib


def worker_sequence(events: list) -> list:
  """One worker's order as ("start", s) / ("apply", s) / ("group", key) tokens, in record order.
  AD-PSGD's passive side serves from another thread and says where each average landed: "during"
  step s (between its start and apply) or "after" k applied steps (before step k starts)."""
  during, after = {}, {}
  for e in events:
    if e["k"] == "group" and "during" in e:
      during.setdefault(e["during"], []).append(e["g"])
    elif e["k"] == "group" and "after" in e:
      after.setdefault(e["after"], []).append(e["g"])
  seq = [("group", g) for g in after.get(0, [])]
  for e in events:
    if e["k"] == "step":
      s = e["s"]
      seq += [("start", s)] + [("group", g) for g in during.get(s, [])] + [("apply", s)]
      seq += [("group", g) for g in after.get(s + 1, [])]
    elif e["k"] == "group" and "during" not in e and "after" not in e:
      seq.append(("group", e["g"]))
  return seq


def merged_events(traces: dict, num_workers: int) -> list:
  """Timeline events (START/APPLY per step, AVG per group) in one order consistent with every trace.

  A topological merge: a group is emitted once it is next for all its members. The run executed some
  such order, so one exists; if none does, the traces contradict each other (an error)."""
  seqs, members = {}, {}
  for w in range(num_workers):
    events = traces.get(w, [])
    steps = [e["s"] for e in events if e["k"] == "step"]
    if steps != list(range(len(steps))):
      raise ValueError(f"worker {w}: steps recorded out of order: {steps[:10]}...")
    for e in events:
      if e["k"] == "group":
        members[e["g"]] = tuple(e["m"])
    seqs[w] = worker_sequence(events)
  pos = {w: 0 for w in seqs}
  out = []
  waiting = {}  # group key -> members at it

  def advance(w):
    seq = seqs[w]
    while pos[w] < len(seq) and seq[pos[w]][0] != "group":
      kind, _ = seq[pos[w]]
      out.append((0.0, timeline.START, w, None) if kind == "start" else (0.0, timeline.APPLY, w, w))
      pos[w] += 1
    if pos[w] < len(seq):
      key = seq[pos[w]][1]
      waiting.setdefault(key, set()).add(w)
      if waiting[key] == set(members[key]):
        del waiting[key]
        out.append((0.0, timeline.AVG, members[key], None))
        for m in members[key]:
          pos[m] += 1
        return list(members[key])
    return []

  ready = list(seqs)
  while ready:
    ready = [m for w in ready for m in advance(w)]
  if waiting:
    raise ValueError(
      f"the traces contradict one global order: groups {sorted(waiting, key=str)[:5]} "
      "never had all their members"
    )
  return out


def replay(config, workdir: str) -> dict:
  """The engine's final state {"params", "model_state"} (leading worker axis) for the recorded order."""
  n = config.num_workers
  s = setup_lib.build(config)
  data, shards, model, optimizer = s.data, s.shards, s.model, s.optimizer
  mesh = make_worker_mesh(n, jax.devices()[:1])
  state = engine.init_sim_state(model, optimizer, jax.random.key(config.seed), data["x_train"][:1], n, mesh)
  round_fn = engine.make_sim_round_fn(model, optimizer, mesh, n, n)
  sharding = engine.worker_sharding(mesh)
  put = lambda a: jax.device_put(a, sharding)
  starts = np.zeros(n, np.int64)
  shape = (n, config.batch_size) + data["x_train"].shape[1:]
  for r in timeline.pack_rounds(merged_events(trace_lib.load_traces(workdir), n), n, n):
    x, y = np.zeros(shape, data["x_train"].dtype), np.zeros(shape[:2], data["y_train"].dtype)
    started = np.flatnonzero(r["start"])
    if len(started):
      idx = data_lib.batch_indices(
        [shards[w] for w in started], config.batch_size, config.seed, starts[started], workers=started
      )
      x[started], y[started] = data["x_train"][idx], data["y_train"][idx]
    state, _ = round_fn(
      state,
      put(x),
      put(y),
      put(r["apply_src"]),
      put(r["gid"]),
      False,
      put(np.arange(n, dtype=np.int32)),
      put(r["start"]),
    )
    starts += r["start"]
  return {"params": state["params"], "model_state": state["model_state"]}

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


def merged_events(traces: dict, num_workers: int) -> list:
  """Timeline events (START/APPLY per step, AVG per group) in one order consistent with every trace."""
  tokens = {w: [e for e in traces.get(w, []) if e["k"] in ("step", "group")] for w in range(num_workers)}
  for w, toks in tokens.items():
    steps = [e["s"] for e in toks if e["k"] == "step"]
    if steps != list(range(len(steps))):
      raise ValueError(f"worker {w}: steps recorded out of order: {steps[:10]}...")
  groups = {}
  for toks in tokens.values():
    for e in toks:
      if e["k"] == "group":
        groups[(e["b"], e["g"])] = tuple(e["m"])
  pos = {w: 0 for w in tokens}
  events = []

  def steps_until(w, key):
    toks = tokens[w]
    while pos[w] < len(toks) and toks[pos[w]]["k"] == "step":
      events.extend([(0.0, timeline.START, w, None), (0.0, timeline.APPLY, w, w)])
      pos[w] += 1
    if key is not None:
      e = toks[pos[w]] if pos[w] < len(toks) else None
      if e is None or (e["b"], e["g"]) != key:
        raise ValueError(f"worker {w} did not run group {key} next: the global order was broken")
      pos[w] += 1

  for key in sorted(groups):  # (block, index) is the global order
    for m in groups[key]:
      steps_until(m, key)
    events.append((0.0, timeline.AVG, groups[key], None))
  for w in tokens:
    steps_until(w, None)
  return events


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
      idx = data_lib.batch_indices([shards[w] for w in started], config.batch_size, config.seed,
                                   starts[started], workers=started)
      x[started], y[started] = data["x_train"][idx], data["y_train"][idx]
    state, _ = round_fn(state, put(x), put(y), put(r["apply_src"]), put(r["gid"]), False,
                        put(np.arange(n, dtype=np.int32)), put(r["start"]))
    starts += r["start"]
  return {"params": state["params"], "model_state": state["model_state"]}

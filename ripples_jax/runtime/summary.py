"""After an asynchronous run: wall-clock throughput, time split and accuracy over time, from the files.

Evaluation happens here, after the run, so it never perturbs the timing: at every evaluated block
boundary each worker saved its flat state (snapshots/<block>-<worker>.npy); the model evaluated is the
workers' average at that boundary, timed at the last worker's arrival there.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from ripples_jax import engine
from ripples_jax.runtime import trace as trace_lib


def _stacked(unravel, flats):
  trees = [unravel(jnp.asarray(f)) for f in flats]
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def summarize(config, workdir: str, setup, unravel, log) -> dict:
  """Evaluates the block snapshots, records them through the RunLog, writes summary.json and the Gantt."""
  model, data = setup.model, setup.data
  n = config.num_workers
  traces = trace_lib.load_traces(workdir)
  steps = np.array([sum(e["k"] == "step" for e in traces.get(w, [])) for w in range(n)])
  block_times = {}  # block -> (latest arrival, local steps completed by then, all workers)
  for w, events in traces.items():
    for e in events:
      if e["k"] == "block":
        t, s = block_times.get(e["b"], (0.0, 0))
        block_times[e["b"]] = (max(t, e["t"]), s + e["s"])
  end = max(e["t"] for events in traces.values() for e in events if e["k"] == "end")
  losses = {}
  for events in traces.values():
    for e in events:
      if e["k"] == "step":
        losses.setdefault(e["b"], []).append(e["loss"])

  eval_fn = engine.make_eval_fn(model)
  x_test, y_test = jax.device_put((data["x_test"], data["y_test"]))
  records, time_to_target = [], None
  snap = os.path.join(workdir, "snapshots")
  points = sorted(b for b in block_times if all(
      os.path.exists(os.path.join(snap, f"{b:06d}-{w}.npy")) for w in range(n)))
  points = [(b, f"{b:06d}", *block_times[b]) for b in points]
  points.append((max(block_times) if block_times else 0, "final", end, int(steps.sum())))
  for b, name, t, total in points:
    flats = [np.load(os.path.join(snap, f"{name}-{w}.npy")) for w in range(n)]
    stacked = _stacked(unravel, flats)
    ev = {k: float(v) for k, v in eval_fn(stacked, x_test, y_test).items()}
    recent = losses.get(max(losses) if name == "final" and losses else b - 1)  # the block before it
    record = {"step": total // n, "time": t, "worker_steps": total, "block": b,
              "train_loss": float(np.mean(recent)) if recent else None, **ev}
    records.append(record)
    if (time_to_target is None and config.target_accuracy
        and ev["test_accuracy"] >= config.target_accuracy):
      time_to_target = t

  for r in records:  # the run's only records: metrics.jsonl was cut back to none on resume
    log.record(**{k: v for k, v in r.items() if v is not None})

  split = trace_lib.time_split(traces)
  compiles = [next((e["compiles"] for e in traces.get(w, []) if e["k"] == "end"), None) for w in range(n)]
  summary = log.finish(
      time=end, worker_steps=steps, compute_time=split["compute"], wait_time=split["wait"],
      comm_time=split["comm"], preduce_programs=compiles, time_to_target=time_to_target,
      target_accuracy=config.target_accuracy, step_time=config.runtime.step_time,
      slow_workers=list(config.hetero.slow_workers), slowdown=config.hetero.slowdown)
  trace_lib.write_gantt(workdir, title=f"{config.algorithm}, {n} processes (wall clock)")
  return summary

"""After an asynchronous run: wall-clock throughput, time split and accuracy over time, from the files.

Evaluation happens here, after the run, so it never perturbs the timing: at every evaluation marker
each worker saved its flat state (snapshots/eval<id>-<worker>.npy; a marker is a consistent cut of
the global order); the model evaluated is the workers' average there, timed at the last worker's
arrival.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.flatten_util import ravel_pytree

from ripples_jax import algorithms, engine
from ripples_jax.runtime import authority as authority_lib
from ripples_jax.runtime import preduce as preduce_lib
from ripples_jax.runtime import ps
from ripples_jax.runtime import trace as trace_lib


def _stacked(unravel, flats):
  trees = [unravel(jnp.asarray(f)) for f in flats]
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def eval_points(traces: dict, n: int) -> list:
  """[(id, time, worker steps by then, mean train loss since the previous point)] of the evaluation
  markers `n` workers reached (n=1, elastic: any): the time is the last worker's arrival there."""
  marks = {}
  for events in traces.values():
    since = []
    for e in events:
      if e["k"] == "step":
        since.append(e["loss"])
      elif e["k"] == "mark" and e["kind"] == "eval":
        t, s, seen, l = marks.get(e["id"], (0.0, 0, 0, []))
        marks[e["id"]] = (max(t, e["t"]), s + e["s"], seen + 1, l + since)
        since = []
  return [
    (i, t, s, float(np.mean(l)) if l else None) for i, (t, s, seen, l) in sorted(marks.items()) if seen >= n
  ]


def window_throughput(traces: dict) -> tuple[float, float]:
  """(worker steps per second, window end): steps finished by the time the first worker finished its
  last step, over that time; the tail where some workers have stopped is left out (and, elastic, the
  workers that died for good: their traces have no end)."""
  finished = [ev for ev in traces.values() if any(e["k"] == "end" for e in ev)] or list(traces.values())
  ends = [max((e["t1"] for e in events if e["k"] == "step"), default=0.0) for events in finished]
  t_end = min(ends) if ends else 0.0
  done = sum(1 for events in traces.values() for e in events if e["k"] == "step" and e["t1"] <= t_end)
  return (done / t_end if t_end > 0 else 0.0), t_end


def summarize(config, workdir: str, setup, unravel, log, authority=None, roster=None) -> dict:
  """Evaluates the marker snapshots, records them through the RunLog, writes summary.json and the Gantt
  (the coordinator, after the run; `authority`: its Group Generator service, if it ran one; `roster`:
  AD-PSGD's membership, if elastic)."""
  n = config.num_workers
  traces = trace_lib.load_traces(workdir)
  steps = np.array([sum(e["k"] == "step" for e in traces.get(w, [])) for w in range(n)])
  server = ps.server_records(workdir) if algorithms.get(config.algorithm).server else None
  end = max(e["t"] for events in [*traces.values(), server or []] for e in events if e["k"] == "end")
  elastic = bool(config.runtime.get("elastic", False))
  charge = consensus_charge(config, traces)
  if server is not None:  # PS: the run's model is the server's (its marks and snapshots)
    records = _evaluate_server(config, workdir, setup, unravel, server, steps, end)
  else:
    records = _evaluate_markers(config, workdir, setup, unravel, traces, steps, end, elastic, charge)
  reached = lambda key, clock="time": next(  # noqa: E731
    (r[clock] for r in records if config.target_accuracy and r.get(key, -1) >= config.target_accuracy), None
  )
  time_to_target = reached("test_accuracy")
  for r in records:  # the run's only records: metrics.jsonl was cut back to none on resume
    log.record(**{k: v for k, v in r.items() if v is not None})

  split = trace_lib.time_split(traces)
  ends = {w: next((e for e in traces.get(w, []) if e["k"] == "end"), {}) for w in range(n)}
  handled = authority.handled if authority is not None else []
  throughput, window = window_throughput(traces)
  summary = log.finish(
    time=end,
    worker_steps=steps,
    compute_time=split["compute"],
    wait_time=split["wait"],
    comm_time=split["comm"],
    **_group_setup_fields(ends, n, end),
    preduce=preduce_lib.choose(config),
    authority=_authority_load(authority, handled),
    time_to_target=time_to_target,
    consensus_time_to_target=reached("consensus_accuracy", "consensus_time") if charge is not None else None,
    worker_time_to_target=reached("worker_median_test_accuracy"),
    consensus_charge=charge,
    target_accuracy=config.target_accuracy,
    step_time=config.runtime.step_time,
    slow_workers=list(config.hetero.slow_workers),
    slowdown=config.hetero.slowdown,
    window_throughput=throughput,
    window_end=window,
    **_request_fields(ends, n, handled),
    **(_membership_fields(traces, authority or roster) if elastic else {}),
  )
  trace_lib.write_gantt(workdir, title=f"{config.algorithm}, {n} processes (wall clock)")
  return summary


def consensus_charge(config, traces: dict) -> float | None:
  """Seconds the deployable model's clock is charged: 0 where a worker holds it (All-Reduce, the
  servers, DiLoCo's global model: algorithms.HELD, GLOBAL); a gossip or group method's, the measured
  All-Reduce that builds it (runtime.consensus_allreduce: the slowest worker's timing), None
  unmeasured."""
  if algorithms.get(config.algorithm).consensus != algorithms.BUILT:
    return 0.0
  got = [
    e["consensus_s"] for events in traces.values() for e in events if e["k"] == "end" and "consensus_s" in e
  ]
  return max(got) if got else None


def _evaluate_markers(
  config, workdir: str, setup, unravel, traces: dict, steps, end: float, elastic: bool, charge=None
):
  """One record per evaluation marker the run's model reached, then the final state's, in order: each
  evaluates the average of the workers' snapshots there (and DiLoCo's global model there)."""
  n = config.num_workers
  snap = os.path.join(workdir, "snapshots")
  # Elastic: the run's model at a marker is the live workers' average there (a dead worker's stale
  # model, or a rejoined one's before its first group, saved nothing: docs/design.md 3.10).
  held = lambda name: [w for w in range(n) if os.path.exists(os.path.join(snap, f"{name}-{w}.npy"))]
  points = [
    (f"eval{i}", t, total, loss, held(f"eval{i}"))
    for i, t, total, loss in eval_points(traces, 1 if elastic else n)
    if len(held(f"eval{i}")) == n or (elastic and held(f"eval{i}"))
  ]
  points.append(("final", end, int(steps.sum()), None, held("final")))
  return _evaluate(config, snap, setup, unravel, points, charge)


def _evaluate_server(config, workdir: str, setup, unravel, server: list, steps, end: float):
  """_evaluate_markers for a parameter server's run: its model (id n) at each of its evaluation marks
  (k x eval_every x n worker steps applied), then its final model."""
  n = config.num_workers
  points = [(f"eval{e['id']}", e["t"], e["s"], None, [n]) for e in server if e["k"] == "mark"]
  points.append(("final", end, int(steps.sum()), None, [n]))
  return _evaluate(config, os.path.join(workdir, "snapshots"), setup, unravel, points, 0.0)


def _load(path: str):
  """A snapshot, or None with one warning where it cannot be read (torn by a crash or a full disk in
  an earlier version, or damaged since): the evaluation goes on without it."""
  try:
    return np.load(path)
  except (OSError, ValueError, EOFError) as e:
    logging.warning("%s: an unreadable snapshot (%s); left out of the summary's evaluation", path, e)
    return None


def _evaluate(config, snap: str, setup, unravel, points: list, charge=None):
  """The records of points (name, time, worker steps, train loss or None, the snapshot owners whose
  mean is the model there), in order, each with the deployable model's accuracy (consensus_accuracy:
  the mean, or DiLoCo's global model where its snapshot is there) and, where its charge is known, its
  clock (consensus_time = time + charge)."""
  n = config.num_workers
  eval_fn = engine.make_eval_fn(setup.model)
  x_test, y_test = jax.device_put((setup.data["x_test"], setup.data["y_test"]))
  held = algorithms.get(config.algorithm).consensus == algorithms.HELD
  records = []
  for name, t, total, loss, owners in points:
    flats = [f for f in (_load(os.path.join(snap, f"{name}-{w}.npy")) for w in owners) if f is not None]
    if not flats:  # every snapshot of the point unreadable (warned): no record for it
      continue
    ev = {k: float(v) for k, v in eval_fn(_stacked(unravel, flats), x_test, y_test).items()}
    ev["consensus_accuracy"] = ev["test_accuracy"]
    if held and "worker_test_accuracy" in ev:
      # Every worker holds the run's model (All-Reduce: the marker falls between a worker's step and
      # its All-Reduce, whose result is the mean evaluated here; the servers' model is one already).
      for k in ("worker_test_accuracy", "worker_median_test_accuracy", "worker_min_test_accuracy"):
        ev[k] = ev["test_accuracy"]
    path = os.path.join(snap, f"{name}-global.npy")
    glob_D = _load(path) if os.path.exists(path) else None
    if glob_D is not None:  # DiLoCo: its params the global ones, its model state the workers' mean
      one = _global_model(unravel, glob_D, np.mean(flats, axis=0))
      ev["consensus_accuracy"] = float(
        eval_fn(_stacked(unravel, [one]), x_test, y_test, False)["test_accuracy"]
      )
    if charge is not None:
      ev["consensus_time"] = t + charge
    records.append({"step": total // n, "time": t, "worker_steps": total, "train_loss": loss, **ev})
  return records


def _global_model(unravel, global_D, mean_D):
  """DiLoCo's deployable flat state: the global model's params (runtime/diloco.py keeps them) and the
  workers' mean model state (what its outer step takes for it)."""
  tree = unravel(jnp.zeros_like(jnp.asarray(mean_D)))
  mask_D, _ = ravel_pytree(
    {
      "params": jax.tree.map(jnp.ones_like, tree["params"]),
      "model_state": jax.tree.map(jnp.zeros_like, tree["model_state"]),
    }
  )
  return np.where(np.asarray(mask_D) > 0, global_D, mean_D)


def _group_setup_fields(ends: dict, n: int, end: float) -> dict:
  """The summary's P-Reduce set-up keys, per worker from its end line, in summary.json's order."""
  return dict(
    preduce_programs=[ends[w].get("compiles") for w in range(n)],
    # P-Reduce programs compiled per worker, and the seconds of their first runs (compile, unless
    # compiled ahead, and connection set-up) over the run's time.
    group_compiles=[ends[w].get("compiles") for w in range(n)],
    group_setup_s=[ends[w].get("setup_s") for w in range(n)],
    group_ahead_s=[ends[w].get("ahead_s") for w in range(n)],  # compiled and connected before the run
    group_setup_share=max((ends[w].get("setup_s") or 0.0) for w in range(n)) / end if end else None,
  )


def _authority_load(authority, handled) -> dict | None:
  """The Group Generator's requests, busy seconds and handling-time percentiles; None if it handled
  none (or did not run)."""
  if not handled:
    return None
  return {"requests": len(handled), "busy_s": authority.busy_s, **authority_lib.percentiles(handled)}


def _request_fields(ends: dict, n: int, handled) -> dict:
  """The summary's group-request keys (counts, round trips, the authority's handling, the time the
  workers were blocked on it), in summary.json's order."""
  # Each end line holds a Durations record: its values (a list), or past Durations.EXACT its histogram.
  rtts = authority_lib.Durations.merged(e.get("rtt") for e in ends.values())
  blocked = authority_lib.Durations.merged(e.get("blocked") for e in ends.values())
  return dict(
    requests=[ends[w].get("requests") for w in range(n)],
    request_rtt=authority_lib.percentiles(rtts),
    authority_handling=authority_lib.percentiles(handled),
    request_blocked=authority_lib.percentiles(blocked),
    request_blocked_s=[_total(ends[w].get("blocked")) for w in range(n)],
  )


def _total(record) -> float:
  """The seconds of one end line's Durations record."""
  return float(record["sum"]) if isinstance(record, dict) else float(np.sum(record or []))


def _membership_fields(traces: dict, decider) -> dict:
  """An elastic run's membership keys: its decisions and first groups, and the steps left unmade."""
  return {
    "membership": membership_events(traces, decider),
    # Steps dead workers started and never completed that the live did not make up: their leave
    # came after the run's budget was handed out (runtime/membership.py). worker_steps + this
    # reaches the budget.
    "unmade_steps": decider.unmade,
    "failed_groups": failed_groups(traces),
  }


def failed_groups(traces: dict) -> dict:
  """Exchanges that failed, counted by cause (preduce.failure_cause): one per (worker, group, failed
  partner), from every worker's trace; {} when none failed. Never silent: a group a worker kept its own
  model in is here."""
  counts = {}
  for trace in traces.values():
    for e in trace:
      if e["k"] == "group" and e.get("failed"):
        for cause in e.get("cause", ["unknown"] * len(e["failed"])):
          counts[cause] = counts.get(cause, 0) + 1
  return dict(sorted(counts.items()))


def membership_events(traces: dict, decider) -> list:
  """[(run time, worker, leave | rejoin | refused | first_group)] in time order: the decisions of the
  authority (or AD-PSGD's roster), and each rejoined life's first group (its trace's first group as a
  joiner that landed; a later one, made before the authority saw it step, is not its first)."""
  events = [list(e) for e in (decider.events if decider is not None else [])]
  for w, trace in traces.items():
    joined = True
    for e in trace:
      if e["k"] == "rejoin":
        joined = False
      elif e["k"] == "group" and not joined and w in e.get("join", ()) and not e.get("failed"):
        events.append([e["t1"], w, "first_group"])
        joined = True
  return sorted(events)

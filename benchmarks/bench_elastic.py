r"""Elastic Ripples in wall-clock time: a worker dies, comes back, and the others go on.

  python -m benchmarks.bench_elastic --out=/tmp/bench_elastic --json_out=results/elastic/bench.json
  python -m benchmarks.bench_elastic --algorithm=adpsgd --out=/tmp/bench_elastic_ad \
      --json_out=results/elastic/bench_adpsgd.json

4 workers and the coordinator (experiments.train, executor=async, runtime.elastic), MLP on MNIST-1D
padded to `step_time` per step, Random GG, heartbeats every 0.5 s, a worker lost after 3 s without one.
Worker 2 is SIGKILLed before its local step `kill_step` (runtime.fail_worker) in every interrupted run.
  kill      no restart: the survivors' throughput (worker steps per second, windows of 20 steps) against
            (n-1)/n of the level before the kill; target: >= 0.9 x it within heartbeat_s + 2 steps
  restart   --max_restarts=1: the restarted worker's first group after its restart (target: within 10 s
            here) and the run's throughput against its level before the kill (target: >= 0.9 x)
  seeds     per seed: elastic Ripples uninterrupted, and killed and restarted; All-Reduce uninterrupted,
            and killed with the restart users know (torchrun's: every process restarts and resumes
            from the newest checkpoint); final accuracy (target: the interrupted run within the seed
            spread of the uninterrupted ones), the records kept from before the kill, and the wall-clock
            time to a target accuracy from the run's first start (clock.jsonl maps a resumed run's clock,
            which continues from its checkpoint, to wall time: the redone work and the restart count)
  predict   the simulator fed with the kill and restart runs' measured costs and their membership events
            (hetero.leave's clock events), its throughput in each phase against the measured one
"""

import json
import os
import shutil
import time

import numpy as np
from absl import app, flags

from benchmarks.bench_scale import fed_simulation
from ripples_jax import timeline
from ripples_jax.distributed.launcher import launch
from ripples_jax.runtime import trace as trace_lib

FLAGS = flags.FLAGS
N, KILLED = 4, 2
HEARTBEAT_S, HEARTBEAT_TIMEOUT = 0.5, 3.0
WINDOW = 20  # steps of step_time in a throughput window (1 s at 0.05 s: shorter ones are mostly noise)


def define_flags() -> None:
  flags.DEFINE_string("out", "/tmp/bench_elastic", "Every run's folder.")
  flags.DEFINE_string("json_out", "results/elastic/bench.json", "The figures (JSON).")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the accuracy and time-to-target runs.")
  flags.DEFINE_integer("steps", 400, "Steps per worker (config.num_steps).")
  flags.DEFINE_integer("kill_step", 200, "Worker 2 dies before this local step.")
  flags.DEFINE_float("step_time", 0.05, "Seconds every step is padded to.")
  flags.DEFINE_list(
    "targets", ["0.6", "0.62", "0.64"], "Test accuracies for the times to target (after the kill)."
  )
  flags.DEFINE_string("algorithm", "ripples_random", "The elastic algorithm: a Ripples generator, or adpsgd.")
  flags.DEFINE_list("parts", ["kill", "restart", "seeds", "predict"], "Parts to run.")
  flags.DEFINE_bool("reuse", False, "Analyse the runs already in --out instead of launching them.")


def run_one(workdir, algorithm, seed, steps, step_time, extra=(), max_restarts=0, elastic=True) -> dict:
  """One launch (or, with restarts, the job's launches); its summary, traces and clock (--reuse: the
  finished run already in workdir)."""
  if FLAGS.reuse and os.path.exists(os.path.join(workdir, "summary.json")):
    return load(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  args = [
    f"--config=configs/default.py:executor=async,num_workers={N},algorithm={algorithm},model=mlp",
    f"--workdir={workdir}",
    f"--config.seed={seed}",
    f"--config.num_steps={steps}",
    f"--config.runtime.step_time={step_time}",
    "--config.eval_every=20",
    "--config.runtime.checkpoint_every=20",
    f"--config.runtime.heartbeat_s={HEARTBEAT_S}",
    f"--config.runtime.heartbeat_timeout={HEARTBEAT_TIMEOUT}",
    f"--config.runtime.elastic={elastic}",
    "--config.schedule.group_size=3",
    *extra,
  ]
  t0 = time.monotonic()
  with open(os.path.join(workdir, "launch.log"), "w") as log:
    code = launch(N, args, out=log, grace_s=10, coordinator=True, max_restarts=max_restarts, elastic=elastic)
  if code:
    raise RuntimeError(f"{workdir} failed with exit code {code}: see its launch.log")
  r = load(workdir)
  r["launch_wall_s"] = time.monotonic() - t0
  print(f"{workdir}: {r['final_test_accuracy']:.4f}, {r['launch_wall_s']:.0f} s", flush=True)
  return r


def load(workdir: str) -> dict:
  with open(os.path.join(workdir, "summary.json")) as f:
    r = json.load(f)
  r["traces"] = trace_lib.load_traces(workdir)
  r["starts"] = trace_lib.load_starts(workdir)
  r["records"] = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return r


def fail_args(kill_step: int) -> list:
  return [f"--config.runtime.fail_worker={KILLED}", f"--config.runtime.fail_step={kill_step}"]


# -- measurements from the traces ------------------------------------------------------------------------


def step_ends(traces, workers=None) -> np.ndarray:
  return np.sort(
    [e["t1"] for w, ev in traces.items() if workers is None or w in workers for e in ev if e["k"] == "step"]
  )


def rate(ends: np.ndarray, t0: float, t1: float) -> float:
  """Worker steps finished per second in [t0, t1)."""
  return float(((ends >= t0) & (ends < t1)).sum() / (t1 - t0)) if t1 > t0 else 0.0


def death_time(traces, worker: int) -> float:
  return trace_lib.death_time(traces, worker)


def recovered_after(
  ends, t_from: float, t_to: float, level: float, window: float, step: float
) -> float | None:
  """Seconds after t_from at which the throughput is back: the start of the first window of `window`
  seconds from which every window (sliding by `step`) up to t_to holds >= level; None if never."""
  starts = np.arange(t_from, t_to - window, step)
  ok = np.array([rate(ends, s, s + window) >= level for s in starts])
  if not len(ok):
    return None
  bad = np.flatnonzero(~ok)
  if not len(bad):
    return 0.0
  return None if bad[-1] == len(ok) - 1 else float(starts[bad[-1] + 1] - t_from)


def membership_time(r, worker: int, kind: str) -> float | None:
  return next((t for t, w, k in r.get("membership", []) if w == worker and k == kind), None)


def kill_part(r, step_time: float) -> dict:
  """The survivors' throughput after the kill against (n-1)/n of the level before it."""
  traces, window = r["traces"], WINDOW * step_time
  t_kill = death_time(traces, KILLED)
  before = rate(step_ends(traces), t_kill - 40 * step_time, t_kill)
  survivors = step_ends(traces, [w for w in range(N) if w != KILLED])
  t_end = min(max(e["t1"] for e in traces[w] if e["k"] == "step") for w in range(N) if w != KILLED)
  level = 0.9 * (N - 1) / N * before
  back = recovered_after(survivors, t_kill, t_end, level, window, step_time)
  return {
    "t_kill": t_kill,
    "t_leave": membership_time(r, KILLED, "leave"),
    "before": before,
    "survivors_after": rate(survivors, t_kill, t_end),
    "survivors_first_window": rate(survivors, t_kill, t_kill + window),
    "target_level": level,
    "recovered_after_s": back,
    "bound_s": HEARTBEAT_S + 2 * step_time,
    "met": back is not None and back <= HEARTBEAT_S + 2 * step_time,
    "window_s": window,
  }


def restart_part(r, step_time: float) -> dict:
  """The restarted worker's first group after its restart, and the run's throughput after it."""
  traces, window = r["traces"], WINDOW * step_time
  t_kill = death_time(traces, KILLED)
  first = membership_time(r, KILLED, "first_group")
  ends = step_ends(traces)
  before = rate(ends, t_kill - 40 * step_time, t_kill)
  t_end = min(max(e["t1"] for e in ev if e["k"] == "step") for ev in traces.values())
  back = recovered_after(ends, first, t_end, 0.9 * before, window, step_time) if first else None
  return {
    "t_kill": t_kill,
    "t_leave": membership_time(r, KILLED, "leave"),
    "t_rejoin": membership_time(r, KILLED, "rejoin"),
    "t_first_group": first,
    "first_group_after_restart_s": None if first is None else first - t_kill,
    "first_group_met": first is not None and first - t_kill <= 10.0,
    "before": before,
    "after_first_group": rate(ends, first, t_end) if first else None,
    "recovered_after_first_group_s": back,
    "throughput_met": back is not None,
  }


def wall_of(r, t: float) -> float:
  """Wall-clock seconds since the run's first start of run time t (clock.jsonl)."""
  return trace_lib.wall_clock(r["starts"], t)


def time_to(r, target: float) -> float | None:
  """Wall-clock seconds from the run's first start to its first evaluation at >= target."""
  hit = next((x for x in r["records"] if x.get("test_accuracy", 0.0) >= target), None)
  return None if hit is None else wall_of(r, hit["time"])


def kept_before_kill(r) -> dict:
  """Whether every evaluation before the kill kept its record with every worker's snapshot. A
  restart-all run's traces are cut back to its checkpoint and go on from there, so the kill's time is
  not in them: every evaluation is counted."""
  t_kill = death_time(r["traces"], KILLED) if "membership" in r else float("inf")
  marks = sorted(
    {e["id"] for e in r["traces"][KILLED] if e["k"] == "mark" and e["kind"] == "eval" and e["t"] < t_kill}
  )
  snap = os.path.join(r["workdir"], "snapshots")
  whole = [i for i in marks if all(os.path.exists(os.path.join(snap, f"eval{i}-{w}.npy")) for w in range(N))]
  key = "evals_before_kill" if "membership" in r else "evals"
  return {key: len(marks), "kept_whole": len(whole), "records": len(r["records"])}


# -- the simulator, fed with a run's measured costs and events --------------------------------------------


def predict_part(r, algorithm: str, step_time: float, rejoin: bool) -> dict:
  """Measured against simulated throughput before the kill, between the kill and its detection
  (undetected), while the worker is out, and after its first group (rejoin). The simulator's clock
  events are the measured times: it dies at the kill, is removed when the coordinator noticed
  (timeline.simulate's detect; `at_once`: detect=0, removed at its death) and rejoins when the
  authority took it back. Its run is not cut at the step budget (the phases end first)."""
  traces = r["traces"]
  t_kill, t_leave = death_time(traces, KILLED), membership_time(r, KILLED, "leave")
  t_back = membership_time(r, KILLED, "rejoin") if rejoin else None
  first = membership_time(r, KILLED, "first_group") if rejoin else None
  leave = ((KILLED, t_kill, t_back if t_back is not None else -1),)
  sims = {}
  # AD-PSGD's simulator has no detection window: in the runtime an exchange with a dead passive worker
  # fails at once and nothing waits for a dead active one, so the removal's time changes no one's pace.
  noticed = 0.0 if algorithm == "adpsgd" else t_leave - t_kill
  for name, detect in (("predicted", noticed), ("at_once", 0.0)):
    sim_trace, fed = fed_simulation(r, N, algorithm, leave=leave, detect=detect)
    sims[name] = np.sort([t for t, kind, *_ in sim_trace.events if kind == timeline.APPLY])
  ends = step_ends(traces)
  t_end = min(
    max(e["t1"] for e in ev if e["k"] == "step") for w, ev in traces.items() if rejoin or w != KILLED
  )
  phases = {
    "before": (2.0, t_kill),
    "undetected": (t_kill, t_leave),
    "out": (t_leave, t_back if rejoin else t_end),
  }
  if rejoin:
    phases["after"] = (first, t_end)
  out = {"fed": fed, "detect_s": t_leave - t_kill}
  for name, (a, b) in phases.items():
    measured = rate(ends, a, b)
    out[name] = {"from": a, "to": b, "measured": measured}
    for sim_name, sim_ends in sims.items():
      out[name][sim_name] = rate(sim_ends, a, b)
      out[name]["error" if sim_name == "predicted" else "error_at_once"] = rate(sim_ends, a, b) / measured - 1
  return out


def main(argv):
  del argv
  out, steps, st, kill = FLAGS.out, FLAGS.steps, FLAGS.step_time, FLAGS.kill_step
  alg, parts = FLAGS.algorithm, set(FLAGS.parts)
  res = {
    "config": {
      "workers": N,
      "steps": steps,
      "step_time": st,
      "kill_step": kill,
      "algorithm": alg,
      "heartbeat_s": HEARTBEAT_S,
      "heartbeat_timeout": HEARTBEAT_TIMEOUT,
      "targets": FLAGS.targets,
    }
  }
  runs = {}
  if parts & {"kill", "predict"}:
    runs["kill"] = run_one(f"{out}/kill", alg, 0, steps, st, fail_args(kill))
    res["kill"] = kill_part(runs["kill"], st)
  if parts & {"restart", "seeds", "predict"}:
    runs["restart"] = run_one(f"{out}/restart-0", alg, 0, steps, st, fail_args(kill), max_restarts=1)
    res["restart"] = restart_part(runs["restart"], st)
  if "seeds" in parts:
    rows = []
    for seed in map(int, FLAGS.seeds):
      row = {"seed": seed}
      label = "ripples" if alg.startswith("ripples") else alg
      for name, a, extra, restarts, elastic in (
        (label, alg, [], 0, True),
        (f"{label}_restart", alg, fail_args(kill), 1, True),
        ("allreduce", "allreduce", [], 0, False),
        ("allreduce_restart_all", "allreduce", fail_args(kill), 1, False),
      ):
        if name == f"{label}_restart" and seed == 0:
          r = runs["restart"]
        else:
          r = run_one(f"{out}/{name}-{seed}", a, seed, steps, st, extra, restarts, elastic)
        row[name] = {
          "final_test_accuracy": r["final_test_accuracy"],
          "time_to_target_s": {t: time_to(r, float(t)) for t in FLAGS.targets},
          "wall_s": wall_of(r, r["time"]),
          "starts": len(r["starts"]),
          **(kept_before_kill(r) if extra else {}),
        }
      rows.append(row)
    res["seeds"] = rows
  if "predict" in parts:
    res["predict"] = {
      "kill": predict_part(runs["kill"], alg, st, rejoin=False),
      "restart": predict_part(runs["restart"], alg, st, rejoin=True),
    }
  os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
  with open(FLAGS.json_out, "w") as f:
    json.dump(res, f, indent=2)
  print(json.dumps({k: v for k, v in res.items() if k != "seeds"}, indent=2))
  for row in res.get("seeds", []):
    print(json.dumps(row))


if __name__ == "__main__":
  define_flags()
  app.run(main)

r"""Elastic training under a cluster's churn: 16 workers, random kills for minutes, restarts, rejoins.

  python -m benchmarks.bench_churn --out=/tmp/bench_churn --json_out=results/churn/bench.json

16 worker processes and the coordinator (experiments.train, executor=async, runtime.elastic,
--max_restarts), MLP on MNIST-1D padded to `step_time` per step (0.5 s: 16 processes leave 2 cores
unsaturated, as in bench_scale), heartbeats every 0.5 s, a worker lost after 3 s without one. From the
run's first step on, a kill event every 15-30 s (uniform; one worker, or two at once with probability
1/2) for `churn_s` seconds: SIGKILL of a live worker process that has a restart left; the launcher
restarts it and it rejoins. The schedule is drawn from --kill_seed, the same for every run.

Per algorithm (Ripples Random GG and Smart GG, AD-PSGD): the run under churn and the same run
uninterrupted; All-Reduce with restart-all (torchrun's: every process restarts and resumes from the
newest checkpoint) under the same schedule. JSON per churn run:
  windows        worker steps per second in `window_s` windows against (live workers / 16) x the
                 uninterrupted run's throughput (live: not between its kill and its first group after
                 the rejoin); windows that hold a kill before its detection are left out
                 (target: every window >= 0.9)
  rejoins        per restart: its first group after the kill (target: within 10 s), refusals
  failed_groups  by cause (summary.json), and the failed exchanges between two workers neither of which
                 died within `quiet_s` of it (target: 0)
  steps          worker_steps + unmade_steps against the budget (Ripples: within one step per death)
  replay         the live workers' models against the engine's replay of the traces (target: < 1e-5),
                 beside the same figure for the uninterrupted run (float order: see replay_error)
  accuracy       final test accuracy against the uninterrupted run's, per seed (paired)
  time_to_target wall-clock seconds from the first start to each target accuracy, against All-Reduce
                 with restart-all (target: >= 2x sooner)
"""

import json
import os
import shutil
import threading
import time

import ml_collections
import numpy as np
from absl import app, flags

from benchmarks.bench_elastic import rate, step_ends, time_to, wall_of
from ripples_jax.distributed.launcher import launch
from ripples_jax.runtime import trace as trace_lib

FLAGS = flags.FLAGS
N = 16
HEARTBEAT_S, HEARTBEAT_TIMEOUT = 0.5, 3.0


def define_flags() -> None:
  flags.DEFINE_string("out", "/tmp/bench_churn", "Every run's folder.")
  flags.DEFINE_string("json_out", "results/churn/bench.json", "The figures (JSON).")
  flags.DEFINE_list("algorithms", ["ripples_random", "ripples_smart", "adpsgd"], "Elastic algorithms.")
  flags.DEFINE_list("seeds", ["0"], "Seeds of every algorithm's churn and uninterrupted runs.")
  flags.DEFINE_list("more_seeds", ["1", "2"], "Further seeds for the first algorithm (accuracy, paired).")
  flags.DEFINE_integer("steps", 200, "Steps per worker (config.num_steps).")
  # Smart GG and AD-PSGD make ~2.4x Random GG's steps/s here: at 200 steps their runs would end
  # after ~110 s, before the kill schedule does.
  flags.DEFINE_list("steps_by", ["ripples_smart=450", "adpsgd=450"], "algorithm=steps overriding --steps.")
  flags.DEFINE_float("step_time", 0.5, "Seconds every step is padded to.")
  flags.DEFINE_float("churn_s", 180.0, "Seconds of kills, from the run's first step.")
  flags.DEFINE_integer("kill_seed", 0, "Seed of the kill schedule.")
  flags.DEFINE_integer("max_restarts", 3, "Restarts per worker (elastic) or of the job (restart-all).")
  flags.DEFINE_float("window_s", 10.0, "Throughput window.")
  flags.DEFINE_list("targets", ["0.45", "0.5", "0.55"], "Test accuracies of the times to target.")
  flags.DEFINE_bool("allreduce", True, "Run All-Reduce with restart-all under the same schedule.")
  flags.DEFINE_bool("reuse", False, "Analyse the runs already in --out instead of launching them.")


def schedule(seed: int, churn_s: float) -> list[tuple[float, int]]:
  """(seconds after the first step, victims) of every kill event: gaps uniform in [15, 30] s, one or
  two victims with probability 1/2 each, until churn_s."""
  rng, t, out = np.random.default_rng(seed), 0.0, []
  while True:
    t += float(rng.uniform(15.0, 30.0))
    if t > churn_s:
      return out
    out.append((round(t, 2), int(rng.integers(1, 3))))


def worker_pids(workdir: str) -> dict[int, int]:
  """{worker: pid} of the live worker processes of the run at `workdir` (process id w + 1)."""
  out = {}
  for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
      args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
      continue
    if f"--workdir={workdir}".encode() in args:
      for a in args:
        if a.startswith(b"--process_id=") and int(a.split(b"=")[1]) > 0:
          out[int(a.split(b"=")[1]) - 1] = pid
  return out


class Killer:
  """Follows the schedule from the run's first traced step: SIGKILLs `victims` live workers (each with a
  restart left, picked by its own seeded draw), recording (wall time, workers)."""

  def __init__(self, workdir: str, events, max_restarts: int, seed: int, restart_all: bool):
    self.workdir, self.events, self.max_restarts = workdir, events, max_restarts
    self.rng, self.restart_all = np.random.default_rng(seed + 1), restart_all
    self.killed, self.done, self.stop = [], {w: 0 for w in range(N)}, threading.Event()

  def first_step(self) -> float | None:
    path = os.path.join(self.workdir, "trace-0.jsonl")
    while not self.stop.is_set():
      if os.path.exists(path) and any('"k": "step"' in line for line in open(path)):
        return time.time()
      time.sleep(0.1)
    return None

  def run(self) -> None:
    t0 = self.first_step()
    if t0 is None:
      return
    for at, victims in self.events:
      if self.stop.wait(max(0.0, t0 + at - time.time())):
        return
      pids = worker_pids(self.workdir)
      spare = sorted(w for w in pids if self.restart_all or self.done[w] < self.max_restarts)
      chosen = [int(w) for w in self.rng.permutation(spare)[:victims]]
      for w in chosen:
        try:
          os.kill(pids[w], 9)
        except ProcessLookupError:
          continue
        self.done[w] += 1
      self.killed.append((time.time(), chosen))


def start_once(thread: threading.Thread) -> None:
  if thread.ident is None:  # never started (a finished thread's ident stays set)
    thread.start()


def steps_of(algorithm: str) -> int:
  return int(dict(s.split("=") for s in FLAGS.steps_by).get(algorithm, FLAGS.steps))


def run_one(workdir, algorithm, seed, events=(), restart_all=False) -> dict:
  """One launch under the kill schedule `events` (none: uninterrupted); its summary, traces, clock,
  records and kills (--reuse: the finished run already in workdir, if it ran the same steps)."""
  if FLAGS.reuse and os.path.exists(os.path.join(workdir, "summary.json")):
    with open(os.path.join(workdir, "config.json")) as f:
      ran = json.load(f)["num_steps"]
    if ran != steps_of(algorithm):
      raise SystemExit(f"--reuse: {workdir} ran {ran} steps, not {steps_of(algorithm)}: move it away")
    return load(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  elastic = not restart_all and algorithm != "allreduce"
  args = [
    f"--config=configs/default.py:executor=async,num_workers={N},algorithm={algorithm},model=mlp",
    f"--workdir={workdir}",
    f"--config.seed={seed}",
    f"--config.num_steps={steps_of(algorithm)}",
    f"--config.runtime.step_time={FLAGS.step_time}",
    "--config.eval_every=20",
    "--config.runtime.checkpoint_every=20",
    f"--config.runtime.heartbeat_s={HEARTBEAT_S}",
    f"--config.runtime.heartbeat_timeout={HEARTBEAT_TIMEOUT}",
    f"--config.runtime.elastic={elastic}",
    "--config.schedule.group_size=3",
  ]
  # restart-all faces every kill event (a restart of the job each); elastic, max_restarts per worker.
  restarts = (len(events) if restart_all else FLAGS.max_restarts) if events else 0
  killer = Killer(workdir, events, restarts, FLAGS.kill_seed, restart_all)
  thread = threading.Thread(target=killer.run, daemon=True)
  t0 = time.monotonic()
  with open(os.path.join(workdir, "launch.log"), "w") as log:
    code = launch(
      N,
      args,
      out=log,
      grace_s=10,
      coordinator=True,
      max_restarts=restarts,
      elastic=elastic,
      on_start=lambda pids: start_once(thread) if events else None,  # restart-all: again per launch
    )
  killer.stop.set()
  with open(os.path.join(workdir, "kills.json"), "w") as f:
    json.dump(killer.killed, f)
  if code:
    raise RuntimeError(f"{workdir} failed with exit code {code}: see its launch.log")
  r = load(workdir)
  r["launch_wall_s"] = time.monotonic() - t0
  print(f"{workdir}: {r['final_test_accuracy']:.4f}, {r['launch_wall_s']:.0f} s", flush=True)
  return r


def load(workdir: str) -> dict:
  with open(os.path.join(workdir, "summary.json")) as f:
    r = json.load(f)
  r["workdir"] = workdir
  r["traces"] = trace_lib.load_traces(workdir)
  r["starts"] = trace_lib.load_starts(workdir)
  r["records"] = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  path = os.path.join(workdir, "kills.json")
  r["kills"] = json.load(open(path)) if os.path.exists(path) else []
  with open(os.path.join(workdir, "launch.log")) as f:
    r["log"] = f.read()
  return r


def run_time(r, wall: float) -> float:
  """The run clock at a wall time (clock.jsonl's first start maps one to the other)."""
  s = r["starts"][0]
  return s["run"] + wall - s["wall"]


def dead_spans(r) -> dict[int, list[tuple[float, float]]]:
  """Per worker, its spans of run time out of the training: from each kill to its first group after
  the rejoin that followed (or the end of the run)."""
  firsts = {}
  for t, w, kind in r.get("membership", []):
    if kind == "first_group":
      firsts.setdefault(w, []).append(t)
  spans = {}
  for wall, workers in r["kills"]:
    t = run_time(r, wall)
    for w in workers:
      back = [f for f in firsts.get(w, []) if f > t]
      spans.setdefault(w, []).append((t, back[0] if back else float("inf")))
  return spans


def end_time(r) -> float:
  return max(e["t1"] for ev in r["traces"].values() for e in ev if e["k"] == "step")


def windows(r, base: float, window_s: float) -> dict:
  """Throughput per window, from the first detection (a leave) on, against (live / N) x the
  uninterrupted throughput `base`; windows holding a kill before its leave (detection) are left out."""
  ends, spans = step_ends(r["traces"]), dead_spans(r)
  leaves = {}
  for t, w, kind in r.get("membership", []):
    if kind == "leave":
      leaves.setdefault(w, []).append(t)
  undetected = []
  for w, ws in spans.items():
    for a, _ in ws:
      later = [t for t in leaves.get(w, []) if t >= a - 1.0]
      undetected.append((a, later[0] if later else a + HEARTBEAT_TIMEOUT + 1.0))
  first = min((b for _, b in undetected), default=None)  # the first detection: the windows start there
  rows = []
  for a in np.arange(first if first is not None else 10.0, end_time(r) - window_s, window_s):
    b = a + window_s
    if any(u0 < b and u1 > a for u0, u1 in undetected):
      continue
    grid = np.linspace(a, b, 41)
    live = np.mean([N - sum(any(s0 <= t < s1 for s0, s1 in ws) for ws in spans.values()) for t in grid])
    got = rate(ends, a, b)
    rows.append({"from": float(a), "live": float(live), "steps_per_s": got, "ratio": got / (live / N * base)})
  return {"rows": rows, **window_summary([x["ratio"] for x in rows])}


def window_summary(ratios) -> dict:
  """The windows' ratios to the bar: smallest, median, how many reach 0.9 of how many."""
  return {
    "min_ratio": min(ratios) if ratios else None,
    "median_ratio": float(np.median(ratios)) if ratios else None,
    "met": sum(x >= 0.9 for x in ratios),
    "of": len(ratios),
  }


def steady_windows(base_run, start: float, base: float, window_s: float) -> dict:
  """The same windows on the run without kills, from the churn run's first detection on: how far a
  window of Random GG's or Smart GG's throughput strays from its mean with nobody dying."""
  ends = step_ends(base_run["traces"])
  starts = np.arange(start, end_time(base_run) - window_s, window_s)
  return window_summary([rate(ends, a, a + window_s) / base for a in starts])


def rejoins(r) -> dict:
  """Per kill of an elastic run: the worker's first group after it, in seconds."""
  spans, out = dead_spans(r), []
  for w, ws in sorted(spans.items()):
    for a, b in ws:
      out.append({"worker": w, "killed_at": a, "first_group_after_s": None if b == float("inf") else b - a})
  lat = [x["first_group_after_s"] for x in out if x["first_group_after_s"] is not None]
  return {
    "each": out,
    "median_s": float(np.median(lat)) if lat else None,
    "max_s": max(lat) if lat else None,
    "within_10_s": sum(x <= 10.0 for x in lat),
    "of": len(out),
    "refused": r["log"].count("cannot rejoin"),
  }


def failed_between_live(r, quiet_s: float) -> int:
  """Failed exchanges between two workers neither of which was killed within quiet_s before or after."""
  kills = {}
  for w, ws in dead_spans(r).items():
    kills[w] = [a for a, _ in ws]
  near = lambda w, t: any(abs(t - a) <= quiet_s for a in kills.get(w, []))  # noqa: E731
  bad = 0
  for w, ev in r["traces"].items():
    for e in ev:
      if e["k"] == "group":
        bad += sum(not near(w, e["t0"]) and not near(m, e["t0"]) for m in e.get("failed", ()))
  return bad


def replay_error(r) -> float:
  """The largest relative L2 distance between a live worker's final model and the engine's replay.
  The engine's rounds (every slot vmapped in one program) and a worker's own step and mean programs
  order float sums differently: a start's loss agrees to a few ulp, until a pre-activation within an
  ulp of a ReLU's kink takes the other side and the difference jumps to ~1e-5, then grows with the
  training (measured on an uninterrupted 16-worker run: docs/design.md 3.12)."""
  import jax
  from jax.flatten_util import ravel_pytree

  from ripples_jax.runtime.replay import replay

  workdir = r["workdir"]
  cached = os.path.join(workdir, "replay_error.json")  # a finished run's: --reuse reads it back
  if os.path.exists(cached):
    return json.load(open(cached))["replay_error"]
  config = ml_collections.ConfigDict(json.load(open(os.path.join(workdir, "config.json"))))
  want = replay(config, workdir)
  errs = []
  for w in range(N):
    path = os.path.join(workdir, "snapshots", f"final-{w}.npy")
    if not os.path.exists(path):
      continue
    got = np.load(path)
    tree = {
      "params": jax.tree.map(lambda a: a[w], want["params"]),
      "model_state": jax.tree.map(lambda a: a[w], want["model_state"]),
    }
    errs.append(float(np.linalg.norm(got - ravel_pytree(tree)[0]) / np.linalg.norm(got)))
  with open(cached, "w") as f:
    json.dump({"replay_error": max(errs)}, f)
  return max(errs)


def churn_row(r, base_run, algorithm: str) -> dict:
  deaths = sum(len(w) for _, w in r["kills"])
  made = sum(r["worker_steps"]) + r.get("unmade_steps", 0)
  base = rate(step_ends(base_run["traces"]), 10.0, end_time(base_run) - 5.0)
  budget = N * steps_of(algorithm)
  return {
    "kills": r["kills"],
    "deaths": deaths,
    "uninterrupted_steps_per_s": base,
    "windows": (churned := windows(r, base, FLAGS.window_s)),
    "uninterrupted_windows": steady_windows(
      base_run, churned["rows"][0]["from"] if churned["rows"] else 10.0, base, FLAGS.window_s
    ),
    "rejoins": rejoins(r),
    "failed_groups": r.get("failed_groups"),
    "failed_between_live": failed_between_live(r, 2 * HEARTBEAT_TIMEOUT + 2.0),
    "steps": {
      "made_and_unmade": made,
      "budget": budget,
      "over": made - budget,
      # the same run without kills: steps start until STOP reaches each worker's queue
      "uninterrupted_over": sum(base_run["worker_steps"]) + base_run.get("unmade_steps", 0) - budget,
    },
    "replay_error": replay_error(r),
    # The same check on the run without kills: the engine's vmapped rounds and the workers' own
    # programs differ in float order (a few ulp), which training amplifies over the run (ReLU kinks).
    "uninterrupted_replay_error": replay_error(base_run),
    "final_test_accuracy": r["final_test_accuracy"],
    "uninterrupted_final_test_accuracy": base_run["final_test_accuracy"],
    "time_to_target_s": {t: time_to(r, float(t)) for t in FLAGS.targets},
    "uninterrupted_time_to_target_s": {t: time_to(base_run, float(t)) for t in FLAGS.targets},
    "wall_s": wall_of(r, r["time"]),
  }


def main(argv):
  del argv
  events = schedule(FLAGS.kill_seed, FLAGS.churn_s)
  res = {
    "config": {
      "workers": N,
      "steps": FLAGS.steps,
      "steps_by": {a: steps_of(a) for a in FLAGS.algorithms},
      "step_time": FLAGS.step_time,
      "heartbeat_s": HEARTBEAT_S,
      "heartbeat_timeout": HEARTBEAT_TIMEOUT,
      "max_restarts": FLAGS.max_restarts,
      "schedule": events,
      "targets": FLAGS.targets,
      "cores": os.cpu_count(),
    },
    "runs": {},
  }
  out = FLAGS.out
  seeds = [(a, int(s)) for a in FLAGS.algorithms for s in FLAGS.seeds]
  seeds += [(FLAGS.algorithms[0], int(s)) for s in FLAGS.more_seeds]
  for algorithm, seed in seeds:
    base = run_one(f"{out}/{algorithm}-{seed}", algorithm, seed)
    churn = run_one(f"{out}/{algorithm}-churn-{seed}", algorithm, seed, events)
    res["runs"][f"{algorithm}-{seed}"] = churn_row(churn, base, algorithm)
    print(json.dumps({k: v for k, v in res["runs"][f"{algorithm}-{seed}"].items() if k != "windows"}))
  if FLAGS.allreduce:
    ar = run_one(f"{out}/allreduce-restart-all-0", "allreduce", 0, events, restart_all=True)
    res["allreduce_restart_all"] = {
      "kills": ar["kills"],
      # restarts of the job; reaching the start barrier: the runs that started (clock.jsonl), the
      # others were killed during their start-up (16 processes on 2 cores start in ~20 s)
      "restarts": ar["log"].count("restarting every process"),
      "reached_start_barrier": len(ar["starts"]),
      "final_test_accuracy": ar["final_test_accuracy"],
      "time_to_target_s": {t: time_to(ar, float(t)) for t in FLAGS.targets},
      "wall_s": wall_of(ar, ar["time"]),
    }
    for row in res["runs"].values():
      theirs = res["allreduce_restart_all"]["time_to_target_s"]
      row["sooner_than_allreduce_restart_all"] = {
        t: theirs[t] / mine if mine and theirs[t] else None for t, mine in row["time_to_target_s"].items()
      }
  os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
  with open(FLAGS.json_out, "w") as f:
    json.dump(res, f, indent=2, default=lambda o: o.item())  # numpy scalars
  print(json.dumps(res.get("allreduce_restart_all"), indent=2))


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""The ledger's claims on real processes: the asynchronous runtime, 16 worker processes and the
coordinator under the local launcher, wall-clock time to a target accuracy, paired by seed, judged by
the rule of every other ledger row (ripples_jax.verdict), with the simulator's prediction of each row.

Every run is experiments.train with executor=async: the MNIST-1D MLP, every step padded to
--runtime_step_time seconds so 17 processes leave 2 cores unsaturated (each run's CPU use is kept:
the children's CPU seconds over wall seconds x cores), the step size the simulated ledger tuned on
its light clock (--runtime_tuned: a tuning.json), and the first --runtime_steps steps of the simulated
runs' schedule (optimizer.schedule_steps = --tta_steps), so a runtime run is the start of a simulated
one. The averaged model is evaluated at every eval_every-th step's markers (summary.json's
time_to_target; a run that misses is censored at its end).

The prediction: the same config on executor=sim, its clock fed with what the run measured (the
median unslowed step and its log-normal spread, the group time as a ring latency, the authority's
round trip and service time), its virtual time to the same target. Per run its error; per claim the
predicted ratio beside the measured one.
"""

import json
import os
import shutil
import tempfile
import time

import numpy as np

from configs import default as default_config
from experiments.ledger_claims import FIGURES, SOURCES
from ripples_jax import sim, verdict
from ripples_jax.distributed.launcher import launch
from ripples_jax.runlog import write_json
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.tables import Table

N = 16
SLOW = 15  # the straggler

RUNTIME_SCENARIOS = {  # name: (the slow worker's slowdown, algorithms; All-Reduce first)
  "homogeneous": (1.0, ("allreduce", "ripples_smart", "adpsgd")),
  "2x straggler": (2.0, ("allreduce", "ripples_smart")),
  "5x straggler": (5.0, ("allreduce", "ripples_smart", "adpsgd")),
}

RUNTIME_CLAIMS = {  # claim (ledger_claims.CLAIMS) -> (scenario, (Ripples, baseline))
  "homogeneous vs All-Reduce": ("homogeneous", ("ripples_smart", "allreduce")),
  "homogeneous vs AD-PSGD": ("homogeneous", ("ripples_smart", "adpsgd")),
  "one worker 2x slower vs All-Reduce": ("2x straggler", ("ripples_smart", "allreduce")),
  "one worker 5x slower vs All-Reduce": ("5x straggler", ("ripples_smart", "allreduce")),
  "one worker 5x slower vs AD-PSGD": ("5x straggler", ("ripples_smart", "adpsgd")),
}


# All-Reduce behind a 5x straggler takes 2.5 s a step: its runs stop at 64 steps (it reaches 55% at
# 43-53 in the simulated ledger's runs; a miss is censored at its end, never counted as a hit).
STEPS_OF = {("5x straggler", "allreduce"): 64}


def overrides(scenario, algorithm, seed, lr, steps, schedule_steps, step_time, target) -> dict:
  """One run's config keys over configs/default.py's (the runtime's and its prediction's alike; the
  runtime.* keys are the runtime's alone)."""
  slowdown = RUNTIME_SCENARIOS[scenario][0]
  return {
    "num_steps": min(steps, STEPS_OF.get((scenario, algorithm), steps)),
    "seed": seed,
    "optimizer.lr": lr,
    "optimizer.schedule_steps": schedule_steps,
    "eval_every": EVAL_EVERY,
    "target_accuracy": target,
    "schedule.workers_per_node": N // 2,
    "schedule.group_size": 3,
    **({"hetero.slow_workers": (SLOW,), "hetero.slowdown": slowdown} if slowdown > 1 else {}),
    "runtime.step_time": step_time,
    "runtime.checkpoint_every": 0,
    # AD-PSGD shares the run's num_steps x num_workers steps (tickets), as Ripples' authority and the
    # simulator's clock do: without elastic each worker takes num_steps of its own, the fast ones stop
    # early, and every evaluation marker waits for the straggler (seen: 160 s to 55% at 5x, predicted 34).
    **({"runtime.elastic": True} if algorithm == "adpsgd" else {}),
  }


def base_config(algorithm: str, executor: str, n: int = N) -> str:
  return f"executor={executor},num_workers={n},algorithm={algorithm},model=mlp"


def run_args(algorithm: str, keys: dict, n: int = N) -> list[str]:
  """experiments.train's flags for one run of n workers."""
  fmt = lambda v: f"({v[0]},)" if isinstance(v, tuple) else v  # noqa: E731
  return [f"--config=configs/default.py:{base_config(algorithm, 'async', n)}"] + [
    f"--config.{k}={fmt(v)}" for k, v in keys.items()
  ]


EVAL_EVERY = 4  # steps between the markers the averaged model is evaluated at


def measured_run(
  workdir: str, args: list[str], max_restarts: int = 0, elastic: bool = False, n: int = N
) -> dict:
  """One run of n workers under the launcher (resumed from its summary.json when it has one):
  summary.json with its traces, its starts (clock.jsonl), CPU use and the evaluation records (the
  averaged model's and, where the run recorded them, the deployable model's and the median worker's).
  max_restarts, elastic: the launcher's (a killed worker restarted alone, or the whole job from the
  newest checkpoint)."""
  done = os.path.join(workdir, "summary.json")
  if not os.path.exists(done):
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    before, t0 = os.times(), time.monotonic()
    with open(os.path.join(workdir, "launch.log"), "w") as log:
      code = launch(
        n,
        [*args, f"--workdir={workdir}"],
        out=log,
        grace_s=10,
        coordinator=True,
        max_restarts=max_restarts,
        elastic=elastic,
      )
    wall, after = time.monotonic() - t0, os.times()
    ended = all(any(e["k"] == "end" for e in ev) for ev in trace_lib.load_traces(workdir).values())
    if code and not (ended and os.path.exists(done)):
      raise RuntimeError(f"{workdir} failed with exit code {code}: see its launch.log")
    # A run every worker ended and the coordinator summarised is measured whole, whatever its exit
    # code (a failure in the teardown after the end is kept with the run, not hidden: `exit_code`).
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    with open(os.path.join(workdir, "cpu.json"), "w") as f:
      json.dump(
        {"cpu_use": cpu / (wall * (os.cpu_count() or 1)), "launch_wall_s": wall, "exit_code": code}, f
      )
  with open(done) as f:
    r = json.load(f)
  with open(os.path.join(workdir, "cpu.json")) as f:
    r.update(json.load(f))
  r["traces"] = trace_lib.load_traces(workdir)
  # A job restarted from scratch archived its first life's clock.jsonl; this folder is this job's alone
  # (cleared before its first launch), so every archived start is one of its lives.
  r["starts"] = trace_lib.load_starts(workdir, earlier=True)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [e for e in map(json.loads, f) if "test_accuracy" in e]
  r["evals"] = [[e["time"], e["test_accuracy"]] for e in records]
  r["deployable"] = [[e["consensus_time"], e["consensus_accuracy"]] for e in records if "consensus_time" in e]
  r["own"] = [
    [e["time"], e["worker_median_test_accuracy"]] for e in records if "worker_median_test_accuracy" in e
  ]
  return r


def fed_costs(r: dict, slow: set) -> dict:
  """What a run measured, as the simulator's clock takes it: the median unslowed step (the padded
  step) and its log-normal spread, the group time as a ring latency per message
  (trace.ring_latency), the authority's round trip and service time per request."""
  steps = np.array(
    [
      e["t1"] - e["t0"]
      for w, ev in r["traces"].items()
      for e in ev
      if e["k"] == "step" and int(w) not in slow
    ]
  )
  authority = r.get("authority") or {}
  return {
    "base_s": float(np.median(steps)),
    "jitter": float(np.std(np.log(steps))),
    "alpha_s": trace_lib.ring_latency(r["traces"]),
    "rtt_s": ((r.get("request_rtt") or {}).get("median_ms") or 0.0) / 1e3,
    "service_s": authority.get("busy_s", 0.0) / authority["requests"] if authority.get("requests") else 0.0,
  }


def predicted_run(algorithm: str, keys: dict, fed: dict, sim_keys: dict | None = None, n: int = N) -> dict:
  """The simulator's run of the same config, its clock fed with `fed` (and `sim_keys`, the simulator's
  own keys: a measured death and rejoin): time to target and end."""
  config = default_config.get_config(base_config(algorithm, "sim", n))
  config.update_from_flattened_dict({k: v for k, v in keys.items() if not k.startswith("runtime.")})
  config.update_from_flattened_dict(sim_keys or {})
  tl = config.timeline
  tl.compute_time, tl.alpha, tl.request_rtt, tl.authority_service = (
    fed["base_s"],
    fed["alpha_s"],
    fed["rtt_s"],
    fed["service_s"],
  )
  tl.bandwidth = tl.ps_bandwidth = 1e18  # the fitted latency is the whole group time
  config.hetero.jitter = fed["jitter"]
  config.log_every, config.checkpoint_every = EVAL_EVERY, 0
  with tempfile.TemporaryDirectory() as d:
    summary, _ = sim.simulate_and_train(config, d)
  return {"time_to_target": summary.get("time_to_target"), "end": summary["time"]}


def measure_and_predict(
  workdir: str, key: str, algorithm: str, keys: dict, slow: bool, lr: float, target, n: int = N
) -> dict:
  """One run of n worker processes (its folder under workdir, named from key) and the simulator's
  prediction of it fed with what it measured: the record runs.json keeps (printed in one line)."""
  r = measured_run(
    os.path.join(workdir, key.replace(" ", "_").replace("|", "-").replace("/", "_")),
    run_args(algorithm, keys, n),
    n=n,
  )
  fed = fed_costs(r, {SLOW} if slow else set())
  p = {
    "time_to_target": r["time_to_target"],
    "end": r["time"],
    "final": r["final_test_accuracy"],
    "throughput": r["window_throughput"],
    "cpu_use": r["cpu_use"],
    "exit_code": r["exit_code"],
    "evals": r["evals"],
    "deployable": r["deployable"],
    "own": r["own"],
    "consensus_charge": r.get("consensus_charge"),
    "lr": lr,
    "fed": fed,
    "predicted": predicted_run(algorithm, keys, fed, n=n),
  }
  print(
    f"{key}: time to {target:g} {p['time_to_target']} (predicted {p['predicted']['time_to_target']})"
    f", end {p['end']:.1f} s, cpu {p['cpu_use']:.2f}",
    flush=True,
  )
  return p


def runtime_ledger(
  out_dir: str,
  seeds: int,
  steps: int,
  schedule_steps: int,
  step_time: float,
  target: float,
  tuned: str,
  workdir: str,
) -> dict:
  """Every (seed, scenario, algorithm) run of RUNTIME_SCENARIOS, seed by seed (a seed's runs measured
  close in time), its prediction beside it; runs.json in out_dir (resumed from: only this process
  writes it), the run folders under workdir; then verdicts.md. Returns runs.json's dict."""
  with open(tuned) as f:
    lr = json.load(f)["choice"]["light"]  # the simulated ledger's choice on its light clock
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "runs.json")
  held = json.load(open(path)) if os.path.exists(path) else {}
  for seed in range(seeds):
    for scenario, (slowdown, algorithms) in RUNTIME_SCENARIOS.items():
      for a in algorithms:
        key = f"{scenario}|{a}|seed={seed}"
        if key in held:
          continue
        keys = overrides(scenario, a, seed, lr[a], steps, schedule_steps, step_time, target)
        held[key] = measure_and_predict(workdir, key, a, keys, slowdown > 1, lr[a], target)
        write_json(path, held, indent=None)
  meta = {
    "seeds": seeds,
    "steps": steps,
    "schedule_steps": schedule_steps,
    "step_time": step_time,
    "target": target,
    "tuned": tuned,
  }
  with open(os.path.join(out_dir, "verdicts.md"), "w") as f:
    f.write(verdicts_text(held, meta) + "\n")
  return held


def _times(held: dict, scenario: str, a: str, seeds: int, predicted: bool = False):
  rs = [held[f"{scenario}|{a}|seed={s}"] for s in range(seeds)]
  src = [r["predicted"] for r in rs] if predicted else rs
  return [r["time_to_target"] for r in src], [r["end"] for r in src]


def verdicts_text(held: dict, meta: dict) -> str:
  """verdicts.md: one row per claim (every published figure, ours with its interval, the verdict on
  each, the simulator's predicted ratio and its error), then each scenario and algorithm's measured
  and predicted time to target, its error, CPU use and final accuracy."""
  seeds, target = meta["seeds"], meta["target"]
  rows = []
  for claim, (scenario, (m, b)) in RUNTIME_CLAIMS.items():
    tm, em = _times(held, scenario, m, seeds)
    tb, eb = _times(held, scenario, b, seeds)
    e = verdict.paired(tm, tb, (em, eb))
    ptm, pem = _times(held, scenario, m, seeds, True)
    ptb, peb = _times(held, scenario, b, seeds, True)
    p = verdict.paired(ptm, ptb, (pem, peb))
    figures = FIGURES[claim]
    rows.append(
      [claim]
      + [f"{figures[src]:g}x" if src in figures else "-" for src in SOURCES]
      + [str(e)]
      + [verdict.judge(e, figures[src]) if src in figures else "-" for src in SOURCES]
      + [str(p), f"{100 * (p.mean / e.mean - 1):+.1f}%"]
    )
  claims = Table(
    ["claim"]
    + [f"paper: {src}" for src in SOURCES]
    + [f"ours, runtime: wall time to {100 * target:.0f}%, 95% interval"]
    + [f"verdict on {src}" for src in SOURCES]
    + ["simulator's prediction", "its error"],
    rows,
  )
  rows = []
  for scenario, (_, algorithms) in RUNTIME_SCENARIOS.items():
    for a in algorithms:
      rs = [held[f"{scenario}|{a}|seed={s}"] for s in range(seeds)]
      pairs = [(r["time_to_target"], r["predicted"]["time_to_target"]) for r in rs]
      both = [(t, q) for t, q in pairs if t and q]
      err = [q / t - 1 for t, q in both]
      rows.append(
        [
          scenario,
          a,
          f"{rs[0]['lr']:g}",
          f"{sum(t is not None for t, _ in pairs)}/{seeds}",
          f"{sum(q is not None for _, q in pairs)}/{seeds}",
          f"{np.mean([t for t, _ in both]):.1f}" if both else "-",
          f"{np.mean([q for _, q in both]):.1f}" if both else "-",
          f"{100 * np.mean(err):+.1f}% (max |{100 * np.max(np.abs(err)):.1f}|%)" if err else "-",
          f"{np.mean([r['end'] for r in rs]):.1f}",
          f"{100 * np.mean([r['final'] for r in rs]):.1f}",
          f"{np.mean([r['cpu_use'] for r in rs]):.2f}",
        ]
      )
  per_run = Table(
    [
      "scenario",
      "algorithm",
      "step size",
      "reached",
      "predicted runs reached",
      f"wall s to {100 * target:.0f}% (mean, both reached)",
      "predicted",
      "prediction error (mean, max)",
      "run's end, s",
      "final accuracy %",
      "CPU use",
    ],
    rows,
  )
  return (
    f"numerics: MNIST-1D MLP, {N} worker processes and the coordinator, the asynchronous runtime "
    f"(executor=async) on one host's 2 cores; every step padded to {meta['step_time']:g} s; the first "
    f"{meta['steps']} steps of a {meta['schedule_steps']}-step schedule; step sizes the simulated "
    f"ledger's light-clock choice ({meta['tuned']}); wall-clock time to {100 * target:.0f}% test accuracy "
    f"of the averaged model (evaluated every {EVAL_EVERY} steps), {seeds} seeds paired, misses censored "
    f"at the run's end; verdicts by ripples_jax.verdict (reproduced only inside the figure +-"
    f"{100 * verdict.TOLERANCE:.0f}%). The simulator's prediction: the same configs on executor=sim, "
    f"the clock fed with each run's measured step, spread, group latency and authority costs.\n\n"
    f"{claims}\n\n{per_run}"
  )

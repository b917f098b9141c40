"""Running a study: many independent runs resumable from one runs.json, and the readings of their curves.

A study's jobs are tuples (one run's arguments each), `run(job) -> record` runs one and `key(job)`
names it in runs.json. A record holds its curve, {column: [value per evaluation]} with "time" (virtual
s), "step", "test" and "val" (accuracies), its "end" (virtual s) and "diverged" where the run broke.
The ledger (experiments.ledger_tta, experiments.baselines) and the hybrid study
(experiments.hybrid_study) run theirs here and read them with crossing, final, accuracy_at and
tuning_score.
"""

import concurrent.futures
import json
import os
from typing import Callable

import numpy as np

from experiments.pool import pinned_pool
from ripples_jax.runlog import write_json


def run_jobs(out_dir: str, jobs: list, workers: int = 1, *, run: Callable, key: Callable) -> dict:
  """Runs every job whose key out_dir/runs.json does not hold yet, `workers` at once (one core each,
  experiments.pool; `run` then must be a module-level function, the pool pickles it); returns
  runs.json's {key: record}. Only this process writes runs.json, after each run, so an interrupted
  study resumes where it stopped, and every curve of every run stays there."""
  path = os.path.join(out_dir, "runs.json")
  runs = json.load(open(path)) if os.path.exists(path) else {}
  todo = {key(j): j for j in jobs if key(j) not in runs}
  print(f"runs: {len(jobs) - len(todo)} held in {path}, {len(todo)} to run", flush=True)

  def done(k, r):
    runs[k] = r
    write_json(path, runs, indent=None)  # every curve of every run: compact
    curve = r["curve"]
    last = " ".join(f"{c} {curve[c][-1]:.4f}" for c in ("test", "val") if curve.get(c)) or "no evaluation"
    print(f"{k}: {last} end {r['end']:.4g} s{' DIVERGED' if r.get('diverged') else ''}", flush=True)

  if workers <= 1:
    for k, j in todo.items():
      done(k, run(j))
  else:
    with pinned_pool(workers) as ex:
      futures = {ex.submit(run, j): k for k, j in todo.items()}
      for fut in concurrent.futures.as_completed(futures):
        done(futures[fut], fut.result())
  return runs


def crossing(curve: dict, target: float, key: str = "test", time: str = "time"):
  """(time, step) of the first evaluation of curve[key] at or above target, or None; `time` names the
  clock column ("ctime": the deployable model's, its All-Reduce charged)."""
  i = next((i for i, a in enumerate(curve[key]) if a >= target), None)
  return None if i is None else (curve[time][i], curve["step"][i])


def final(run: dict, key: str = "test") -> float:
  """A run's last accuracy; 0.0 for a run that diverged (it ends with no model worth the name)."""
  return 0.0 if run.get("diverged") or not run["curve"][key] else run["curve"][key][-1]


def accuracy_at(curve: dict, t: float, key: str = "test") -> float:
  """curve[key] at the last evaluation at or before virtual time t (0.0 before the first)."""
  i = int(np.searchsorted(curve["time"], t, side="right"))
  return curve[key][i - 1] if i else 0.0


def tuning_score(got: list, target: float) -> tuple[float, float]:
  """One grid point's score over its tuning runs, least best: (the median validation time to the
  target, inf for a miss; minus the mean final validation accuracy, the tie-break)."""
  # A run reaches only if it also ends at or above the target: a step size whose run crosses it and
  # then collapses (CNN1D's All-Reduce at 0.5657 on one tuning seed) is not a step size a user would
  # keep, and the reported seeds would inherit its collapse.
  hit = [crossing(r["curve"], target, "val") if final(r, "val") >= target else None for r in got]
  vt = float(np.median([h[0] if h else np.inf for h in hit]))
  return vt, -float(np.mean([final(r, "val") for r in got]))

"""experiments.ledger_runtime: one run's config on both executors, the costs a run feeds the simulator,
the verdict table from stored runs (synthetic, every number known), and (nightly) the whole loop on
four processes."""

import json

import numpy as np
import pytest

from experiments import ledger_runtime
from ripples_jax import verdict


def test_run_args_carry_every_key_the_prediction_reads():
  keys = ledger_runtime.overrides("5x straggler", "allreduce", 3, 0.4, 80, 300, 0.5, 0.55)
  args = ledger_runtime.run_args("allreduce", keys)
  assert args[0] == "--config=configs/default.py:executor=async,num_workers=16,algorithm=allreduce,model=mlp"
  assert "--config.hetero.slow_workers=(15,)" in args and "--config.hetero.slowdown=5.0" in args
  assert "--config.num_steps=64" in args  # All-Reduce behind the 5x straggler: STEPS_OF
  assert "--config.optimizer.schedule_steps=300" in args and "--config.seed=3" in args
  homogeneous = ledger_runtime.overrides("homogeneous", "adpsgd", 0, 0.4, 80, 300, 0.5, 0.55)
  assert homogeneous["num_steps"] == 80 and "hetero.slowdown" not in homogeneous
  assert homogeneous["runtime.elastic"] is True and "runtime.elastic" not in keys  # AD-PSGD's shared steps


def test_fed_costs_read_the_unslowed_steps_and_the_group_latency():
  """Steps of 0.5 s and one slow worker's 2.5 s (left out); one 3-member group whose last member
  arrives at 1.0 and which ends at 1.4: 0.4 s over 2 (3 - 1) messages."""
  traces = {
    w: [{"k": "step", "t0": 0.0, "t1": 2.5 if w == 3 else 0.5}]
    + [{"k": "group", "g": 7, "m": [0, 1, 2], "t0": 0.5 + 0.25 * w, "t1": 1.4}] * (w < 3)
    for w in range(4)
  }
  fed = ledger_runtime.fed_costs({"traces": traces, "authority": {"busy_s": 0.2, "requests": 4}}, {3})
  assert fed["base_s"] == 0.5 and fed["jitter"] == 0.0 and fed["service_s"] == 0.05
  assert fed["alpha_s"] == pytest.approx(0.1) and fed["rtt_s"] == 0.0


def _held(seeds=5):
  """Ripples reaches the target at 10 s, All-Reduce at 20 s x (1 + 0.1 seed), AD-PSGD misses (its end
  is 30 s); the predictions are 10% slower for Ripples."""
  held = {}
  for scenario, (_, algorithms) in ledger_runtime.RUNTIME_SCENARIOS.items():
    for a in algorithms:
      for s in range(seeds):
        t = {"ripples_smart": 10.0, "allreduce": 20.0 * (1 + 0.1 * s), "adpsgd": None}[a]
        q = None if t is None else t * (1.1 if a == "ripples_smart" else 1.0)
        held[f"{scenario}|{a}|seed={s}"] = {
          "time_to_target": t,
          "end": 30.0,
          "final": 0.6,
          "cpu_use": 0.5,
          "lr": 0.4,
          "predicted": {"time_to_target": q, "end": 30.0},
        }
  return held


def test_verdicts_pair_seeds_censor_misses_and_set_the_prediction_beside():
  meta = {"seeds": 5, "steps": 80, "schedule_steps": 300, "step_time": 0.5, "target": 0.55, "tuned": "t"}
  text = ledger_runtime.verdicts_text(_held(), meta)
  row = next(line for line in text.splitlines() if line.startswith("| homogeneous vs All-Reduce |"))
  e = verdict.paired([10.0] * 5, [20.0 * (1 + 0.1 * s) for s in range(5)], 30.0)
  p = verdict.paired([11.0] * 5, [20.0 * (1 + 0.1 * s) for s in range(5)], 30.0)
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[4] == str(e) and cells[5] == verdict.judge(e, 1.1)
  assert cells[8] == str(p) and cells[9] == f"{100 * (p.mean / e.mean - 1):+.1f}%"
  # AD-PSGD never reached: every seed a lower bound on Ripples' lead, which supports only "larger".
  row = next(line for line in text.splitlines() if line.startswith("| homogeneous vs AD-PSGD |"))
  assert "baseline reached 0/5" in row
  row = next(line for line in text.splitlines() if line.startswith("| homogeneous | ripples_smart |"))
  assert "+10.0% (max |10.0|%)" in row


@pytest.mark.slow
@pytest.mark.nightly
def test_runtime_ledger_end_to_end_on_four_processes(tmp_path, monkeypatch):
  """Every scenario's runs on 4 processes, 8 steps; runs.json holds each run and its prediction; a
  second call resumes (nothing is run again)."""
  monkeypatch.setattr(ledger_runtime, "N", 4)
  monkeypatch.setattr(ledger_runtime, "SLOW", 3)
  tuned = tmp_path / "tuning.json"
  tuned.write_text(json.dumps({"choice": {"light": {"allreduce": 0.4, "ripples_smart": 0.4, "adpsgd": 0.4}}}))
  args = (str(tmp_path / "out"), 1, 8, 300, 0.02, 0.3, str(tuned), str(tmp_path / "runs"))
  held = ledger_runtime.runtime_ledger(*args)
  assert len(held) == sum(len(a) for _, a in ledger_runtime.RUNTIME_SCENARIOS.values())
  assert all(r["end"] > 0 and r["fed"]["base_s"] >= 0.02 and "end" in r["predicted"] for r in held.values())
  assert all(np.isfinite(r["cpu_use"]) for r in held.values())
  assert "| homogeneous vs All-Reduce |" in (tmp_path / "out" / "verdicts.md").read_text()
  monkeypatch.setattr(ledger_runtime, "measured_run", lambda *a: pytest.fail("resumed runs ran again"))
  assert ledger_runtime.runtime_ledger(*args) == held

"""The baselines study's parts: algorithm variants, the messages counted per worker-step, a lockstep
algorithm's restart after a death, the tables' pairings; and one short run of the entry point."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import baselines, ledger_tta
from ripples_jax import algorithms
from ripples_jax.timeline import APPLY, AVG, JOIN, OUTER, PULL, START, Trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_variant_sets_its_keys_under_its_algorithm():
  assert ledger_tta.variant("moshpit") == ("moshpit", {})
  assert ledger_tta.variant("diloco/inner_steps=4/outer_lr=0.35") == (
    "diloco",
    {"diloco.inner_steps": 4, "diloco.outer_lr": 0.35},
  )
  assert isinstance(ledger_tta.variant("diloco/inner_steps=4")[1]["diloco.inner_steps"], int)
  # A dotted key is the config's own, and it reaches the run's config.
  name = "ripples_smart/schedule.smart_fresh=True"
  assert ledger_tta.variant(name) == ("ripples_smart", {"schedule.smart_fresh": True})
  config, base, _ = ledger_tta.scenario_config("homogeneous, VGG-16 clock", name, 0.5, 0, 10)
  assert base == "ripples_smart" and config.schedule.smart_fresh is True


def test_diloco_as_published_tunes_adamw_then_outer_lr_by_momentum_and_local_sgd_keeps_its_outer_step(
  tmp_path, monkeypatch
):
  """The tuner's runs (train_runs and the score faked: no training) for DiLoCo as published: its inner
  step size on ADAMW_GRID at outer lr 0.7 (Nesterov 0.9), then outer lr x outer momentum {0, 0.9} at the
  chosen one; results/baselines' DiLoCo searches the outer lr at 0.9 only, as it did; local SGD (outer
  lr 1, no momentum: in the names the study takes) only its inner step size. Labels are the registry's."""
  pub = "diloco/inner_steps=16/optimizer.name=adamw/optimizer.weight_decay=0.1"
  (local,) = baselines.LOCAL_SGD
  labels = baselines.LABELS
  assert pub in baselines.DILOCO_PUBLISHED and {pub, local} | set(baselines.ALGORITHMS) <= set(labels)
  assert len(set(labels.values())) == len(labels)
  diloco = algorithms.get("diloco").label
  assert all(labels[a].startswith(diloco) for a in (*baselines.DILOCO_PUBLISHED, local))
  ran = []

  def train_runs(out_dir, jobs, workers):
    ran.extend(j[1:3] for j in jobs if j[3] == ledger_tta.TUNE_SEEDS[0])  # (variant, lr), one seed's
    return {ledger_tta.run_key(*j): j for j in jobs}

  def score(runs, target):  # least: AdamW at 0.002 with outer lr 0.5 and no momentum, SGD at 0.2
    ((_, v, lr),) = {r[:3] for r in runs}
    off = not v.endswith("/outer_lr=0.5/outer_momentum=0")
    return abs(math.log(lr / (0.002 if "adamw" in v else 0.2))) + off, -0.5

  monkeypatch.setattr(baselines, "train_runs", train_runs)
  monkeypatch.setattr(baselines, "tuning_score", score)
  old = "diloco/inner_steps=16"
  chosen = baselines.tune(str(tmp_path), "heavy", 6, 0.5, 1, algorithms=("allreduce", old, pub, local))
  lr = min(baselines.ADAMW_GRID, key=lambda x: abs(math.log(x / 0.002)))
  first = f"{pub}/outer_lr=0.7/outer_momentum=0.9"
  # The inner search, then the outer one at the chosen inner step size (its (0.7, 0.9) run is the first's).
  assert [x for v, x in ran if v == first][: len(baselines.ADAMW_GRID)] == list(baselines.ADAMW_GRID)
  assert baselines.OUTER_MOMENTUM_GRID == (0.0, 0.9)
  outer = [f"{pub}/outer_lr={o:g}/outer_momentum={mu:g}" for o in baselines.OUTER_GRID for mu in (0, 0.9)]
  assert [(v, x) for v, x in ran if v.startswith(pub)][len(baselines.ADAMW_GRID) :] == [
    (v, lr) for v in outer
  ]
  assert chosen[pub] == (f"{pub}/outer_lr=0.5/outer_momentum=0", lr)
  inner = [x for v, x in ran if v == f"{old}/outer_lr=0.7"]
  assert inner[: len(ledger_tta.LR_GRID)] == list(ledger_tta.LR_GRID)
  assert {v for v, _ in ran if v.startswith(old + "/outer")} - {local} == {
    f"{old}/outer_lr={o:g}" for o in baselines.OUTER_GRID
  }
  assert [x for v, x in ran if v.startswith(local)] == list(ledger_tta.LR_GRID)
  assert chosen[local] == (local, 0.2)
  text = (tmp_path / "tuning.md").read_text()
  assert "| outer lr 0.35 | outer lr 0.5 |" in text
  assert "| outer lr 0.35, momentum 0 | outer lr 0.35, momentum 0.9 |" in text
  # The variants' configs: AdamW with decoupled decay 0.1 and the chosen outer step; local SGD's.
  config, base, _ = ledger_tta.scenario_config("homogeneous, VGG-16 clock", chosen[pub][0], lr, 0, 10)
  assert (base, config.optimizer.name, config.optimizer.weight_decay) == ("diloco", "adamw", 0.1)
  assert (config.diloco.inner_steps, config.diloco.outer_lr, config.diloco.outer_momentum) == (16, 0.5, 0.0)
  config, _, _ = ledger_tta.scenario_config("homogeneous, VGG-16 clock", local, 0.2, 0, 10)
  got = (config.optimizer.name, config.diloco.outer_lr, config.diloco.outer_momentum)
  assert got == ("momentum", 1.0, 0.0)


def test_models_sent_count_each_collective_and_each_server_message():
  tr = Trace(4)
  tr.worker_steps[:] = (3, 2, 2, 3)  # 10 worker-steps
  tr.events += [
    (0.0, START, 0, None),  # no message
    (1.0, APPLY, 0, 0),  # a local apply: none
    (1.0, AVG, (0, 1, 2), None),  # a ring of 3: 2 * (3 - 1) = 4
    (2.0, OUTER, (0, 1, 2, 3), None),  # 6
    (2.0, AVG, (1, 3), None),  # an AD-PSGD pair: 2
    (3.0, APPLY, 4, 2),  # a push to the server's slot: 1
    (3.0, PULL, 2, 4),  # its pull: 1
    (4.0, JOIN, 3, 0),  # a rejoin's copy: 1
  ]
  assert ledger_tta.sent_models(tr, "ripples_smart") == pytest.approx((4 + 6 + 2 + 1 + 1 + 1) / 10)
  # Synchronous PS: a round of g is g pushes and g pulls, not a ring.
  sync = Trace(4)
  sync.worker_steps[:] = 2
  sync.events += [(1.0, AVG, (0, 1, 2, 3), None)]
  assert ledger_tta.sent_models(sync, "ps_sync") == pytest.approx(8 / 8)
  assert ledger_tta.sent_models(sync, "allreduce") == pytest.approx(6 / 8)


@pytest.mark.slow  # four short simulated trainings, in process
def test_a_lockstep_run_with_a_death_is_the_run_without_it_stopped_for_the_outage():
  t_leave, t_rejoin = ledger_tta.KILL[1:]
  steps = 40  # about 19 virtual s on the VGG-16 clock: the death at 10 s and the rejoin at 40 s inside
  kill, plain = "worker killed and restarted, VGG-16 clock", "homogeneous, VGG-16 clock"
  a = ledger_tta.train_run(kill, "allreduce", 0.2, 0, steps, own=False)
  b = ledger_tta.train_run(plain, "allreduce", 0.2, 0, steps, own=False)
  assert a["outage"] == [t_leave, t_rejoin - t_leave]
  assert a["curve"]["test"] == b["curve"]["test"] and a["curve"]["step"] == b["curve"]["step"]
  shifted = [t + (t_rejoin - t_leave) if t > t_leave else t for t in b["curve"]["time"]]
  assert a["curve"]["time"] == pytest.approx(shifted, abs=1e-6)
  assert any(t > t_leave for t in b["curve"]["time"]) and any(t <= t_leave for t in b["curve"]["time"])
  assert a["end"] == pytest.approx(b["end"] + t_rejoin - t_leave)
  # All-Reduce's messages: one ring of 16 after every step but the last.
  assert a["sent"] == pytest.approx(2 * 15 / 16 * (steps - 1) / steps)
  # An elastic algorithm runs the death itself: its curve is not the homogeneous one.
  c = ledger_tta.train_run(kill, "ripples_smart", 0.2, 0, steps, own=False)
  d = ledger_tta.train_run(plain, "ripples_smart", 0.2, 0, steps, own=False)
  assert "outage" not in c and c["curve"]["test"] != d["curve"]["test"]


def _record(times, ends, name):
  n = len(times)
  return {
    "time": times,
    "end": ends,
    "lr": 0.1,
    "final": [0.6] * n,
    "throughput": [1.0] * n,
    "sent": 1.0,
    "name": name,
  }


def test_the_winner_is_the_least_geometric_mean_and_smart_gg_is_paired_against_it():
  per = {
    "allreduce": _record([10.0, 12.0, 11.0], [50.0] * 3, "All-Reduce"),
    "ripples_smart": _record([5.0, 6.0, None], [40.0] * 3, "Smart GG"),  # a miss: 40 at its end
    "moshpit": _record([4.0, 5.0, 6.0], [30.0] * 3, "Moshpit"),
  }
  rows = baselines.winners_table({"s": per}).rows
  assert [r[2] for r in rows] == ["Moshpit"] and rows[0][4] == "Moshpit"
  ratios = [4.0 / 5.0, 5.0 / 6.0, 6.0 / 40.0]  # Moshpit's time over Smart GG's, the miss censored
  assert rows[0][5].startswith(f"{math.exp(np.mean(np.log(ratios))):.2f}x")
  # When Smart GG is the fastest it is paired against the runner-up.
  per["moshpit"] = _record([40.0, 50.0, 60.0], [90.0] * 3, "Moshpit")
  per["ripples_smart"] = _record([5.0, 6.0, 5.5], [40.0] * 3, "Smart GG")
  rows = baselines.winners_table({"s": per}).rows
  assert rows[0][2] == "Smart GG" and rows[0][4] == "All-Reduce"
  assert rows[0][5].startswith(f"{math.exp(np.mean(np.log([10 / 5, 12 / 6, 11 / 5.5]))):.2f}x")
  # A method that missed in every seed, its run ending early, is neither the fastest nor the
  # runner-up; one seed's miss (Smart GG's, censored at its end) does not rank it last.
  per["adpsgd"] = _record([None] * 3, [3.0] * 3, "AD-PSGD")
  rows = baselines.winners_table({"s": per}).rows
  assert rows[0][2] == "Smart GG" and rows[0][4] == "All-Reduce"
  per["ripples_smart"] = _record([5.0, 6.0, None], [40.0] * 3, "Smart GG")
  assert baselines.winners_table({"s": per}).rows[0][2] == "Smart GG"
  # A variant of Smart GG is Smart GG: the fastest, it is not what Smart GG is paired against, and
  # it gets its own ratio against the same method.
  per["ripples_smart/schedule.smart_fresh=True"] = _record([2.0, 3.0, 2.5], [40.0] * 3, "Smart GG (fresh)")
  table = baselines.winners_table({"s": per})
  row = table.rows[0]
  assert row[2] == "Smart GG (fresh)" and row[4] == "All-Reduce" and len(row) == 9
  assert table.header[7] == "Smart GG (fresh)'s speedup over it (95% interval)"
  assert (
    row[7].startswith(f"{math.exp(np.mean(np.log([10 / 2, 12 / 3, 11 / 2.5]))):.2f}x") and row[8] == "faster"
  )


@pytest.mark.slow
@pytest.mark.nightly
def test_the_study_runs_end_to_end(tmp_path):
  out = tmp_path / "study"
  algorithms = "allreduce,ripples_smart,diloco/inner_steps=4"
  args = [
    f"--out={out}",
    "--parts=tune,sim16",
    "--steps=6",
    "--seeds=2",
    "--grid=0.2",
    "--outer_grid=0.7,1.0",
    f"--algorithms={algorithms}",
    "--target=0.2",
    "--scenario=homogeneous, VGG-16 clock",
  ]
  env = dict(os.environ, RIPPLES_JAX_CACHE=str(tmp_path / "cache"))
  got = subprocess.run(
    [sys.executable, "-m", "experiments.baselines_study", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  assert got.returncode == 0, got.stderr[-3000:]
  tuning = json.load(open(out / "tuning.json"))
  assert set(tuning["chosen"]) == set(algorithms.split(","))
  assert tuning["chosen"]["diloco/inner_steps=4"][0].startswith("diloco/inner_steps=4/outer_lr=")
  study = json.load(open(out / "study16.json"))["scenarios"]["homogeneous, VGG-16 clock"]
  assert study["allreduce"]["sent"] == pytest.approx(2 * 15 / 16 * 5 / 6)
  assert len(study["ripples_smart"]["time"]) == 2 and (out / "study16.png").exists()
  # The runs are the study's records: every reported run is in runs.json under its key.
  runs = json.load(open(out / "runs.json"))
  v, lr = tuning["chosen"]["diloco/inner_steps=4"]
  assert ledger_tta.run_key("homogeneous, VGG-16 clock", v, lr, 1, 6) in runs


def test_wall_clock_puts_a_resumed_runs_times_after_its_outage():
  from ripples_jax.runtime import trace as trace_lib

  # The first start at wall 100 (run 0); the job died and resumed at marker run time 4.0, its second
  # start at wall 130: run time 6 of the second life is wall 132, i.e. 32 s after the first start.
  starts = [{"wall": 100.0, "run": 0.0}, {"wall": 130.0, "run": 4.0}]
  assert trace_lib.wall_clock(starts, 3.0) == pytest.approx(3.0)
  assert trace_lib.wall_clock(starts, 6.0) == pytest.approx(32.0)
  # A start over from scratch (no checkpoint: both starts at run 0) puts every time in the second life.
  assert trace_lib.wall_clock([{"wall": 100.0, "run": 0.0}, {"wall": 150.0, "run": 0.0}], 2.0) == 52.0


def test_the_killed_scenarios_keys_restart_lockstep_jobs_and_rejoin_elastic_workers():
  args = (0, 0.5, 80, 300, 0.5, 0.55)
  for base in ("ripples_smart", "ripples_random", "adpsgd", "moshpit"):
    keys = baselines.runtime_keys(baselines.KILLED, base, *args)
    assert keys["runtime.elastic"] is True and keys["runtime.fail_step"] == baselines.KILL_STEP
  for base in baselines.RESTART_ALL:
    keys = baselines.runtime_keys(baselines.KILLED, base, *args)
    assert "runtime.elastic" not in keys and keys["runtime.checkpoint_every"] == baselines.KILL_CKPT
    assert keys["num_steps"] == 80  # no straggler: the lockstep cut at 64 steps is the 5x scenario's
  assert baselines.runtime_keys("5x straggler", "allreduce", *args)["num_steps"] == 64
  assert "runtime.fail_worker" not in baselines.runtime_keys("homogeneous", "ripples_smart", *args)


def _killed(monkeypatch, starts, membership=()):
  """killed_and_predicted on a stubbed launch: its record and what the simulator was given."""
  from experiments import ledger_runtime

  slow = ledger_runtime.SLOW
  traces = {w: [{"k": "step", "t0": 0.0, "t1": 9.5 if w == slow else 30.0}] for w in range(ledger_runtime.N)}
  traces[slow] += [{"k": "rejoin", "t": 20.0}, {"k": "step", "t0": 21.0, "t1": 30.0}]
  run = {
    "time_to_target": 12.0,
    "time": 30.0,
    "final_test_accuracy": 0.6,
    "window_throughput": 30.0,
    "cpu_use": 0.5,
    "exit_code": 0,
    "evals": [[2.0, 0.3], [12.0, 0.56]],
    "traces": traces,
    "starts": starts,
    "membership": list(membership),
  }
  given = {}

  def predicted(base, keys, fed, sim_keys=None):
    given.update(sim_keys or {})
    return {"time_to_target": 10.0, "end": 28.0}

  monkeypatch.setattr(ledger_runtime, "measured_run", lambda *a, **k: run)
  monkeypatch.setattr(ledger_runtime, "fed_costs", lambda r, slow: {})
  monkeypatch.setattr(ledger_runtime, "predicted_run", predicted)
  return given


def test_a_restarted_jobs_times_count_its_outage_measured_and_predicted(monkeypatch):
  starts = [{"wall": 100.0, "run": 0.0}, {"wall": 130.0, "run": 4.0}]
  given = _killed(monkeypatch, starts)
  keys = baselines.runtime_keys(baselines.KILLED, "allreduce", 0, 1.0, 80, 300, 0.5, 0.55)
  r = baselines.killed_and_predicted("/nonexistent", "k", "allreduce", keys, 1.0, 0.55)
  assert given == {}  # the simulator runs the job without the death (lockstep: NO_LEAVE) ...
  down = 130.0 - 100.0 - 4.0
  assert r["kill"]["outage"] == down and r["kill"]["t_marker"] == 4.0
  # ... and every time after the resumed marker moves by the outage the starts measured.
  assert r["predicted"] == {"time_to_target": 10.0 + down, "end": 28.0 + down}
  assert r["time_to_target"] == 12.0 + down and r["end"] == 30.0 + down
  assert r["evals"] == [[2.0, 0.3], [12.0 + down, 0.56]] and r["run_time_to_target"] == 12.0


def test_an_elastic_runs_prediction_takes_its_measured_death_removal_and_rejoin(monkeypatch):
  slow = baselines.ledger_runtime.SLOW
  given = _killed(monkeypatch, [{"wall": 100.0, "run": 0.0}], [(12.5, slow, "leave"), (20.0, slow, "rejoin")])
  keys = baselines.runtime_keys(baselines.KILLED, "ripples_smart", 0, 0.5, 80, 300, 0.5, 0.55)
  r = baselines.killed_and_predicted("/nonexistent", "k", "ripples_smart", keys, 0.5, 0.55)
  assert given == {"hetero.leave": ((slow, 9.5, 20.0),), "timeline.detect_s": 3.0}
  assert r["time_to_target"] == 12.0 and r["predicted"]["time_to_target"] == 10.0
  # AD-PSGD's exchanges with a dead peer fail at once: removed at its death in the simulator.
  given = _killed(monkeypatch, [{"wall": 100.0, "run": 0.0}], [(12.5, slow, "leave")])
  baselines.killed_and_predicted("/nonexistent", "k", "adpsgd", keys, 0.5, 0.55)
  assert given == {"hetero.leave": ((slow, 9.5, -1.0),), "timeline.detect_s": 0.0}


def test_held_killed_runs_are_predicted_again_from_what_they_measured(monkeypatch, tmp_path):
  slow = baselines.ledger_runtime.SLOW
  given = _killed(monkeypatch, [{"wall": 100.0, "run": 0.0}], [(12.5, slow, "leave"), (20.0, slow, "rejoin")])
  keys = baselines.runtime_keys(baselines.KILLED, "ripples_smart", 0, 0.5, 80, 300, 0.5, 0.55)
  r = baselines.killed_and_predicted("/nonexistent", "k", "ripples_smart", keys, 0.5, 0.55)
  key = f"{baselines.KILLED}|ripples_smart|lr=0.5|seed=0"
  earlier = {"time_to_target": 99.0, "end": 99.0}  # an earlier simulator's
  held = {key: {"algorithm": "ripples_smart", "variant": "ripples_smart", **r, "predicted": earlier}}
  (tmp_path / "runtime_runs.json").write_text(json.dumps(held))
  given.clear()
  monkeypatch.setattr(baselines, "runtime_text", lambda *a: "")
  monkeypatch.setattr(baselines, "killed_and_predicted", None)  # nothing is run again
  chosen = {"ripples_smart": ("ripples_smart", 0.5)}
  args = (str(tmp_path), 0, 80, 300, 0.5, 0.55, chosen, "/nonexistent")
  baselines.runtime_study(*args, killed_seeds=1, repredict=True)
  assert given == {"hetero.leave": ((slow, 9.5, 20.0),), "timeline.detect_s": 3.0}
  again = json.loads((tmp_path / "runtime_runs.json").read_text())[key]
  assert again["predicted"] == {"time_to_target": 10.0, "end": 28.0} and again["predicted_earlier"] == earlier
  assert {k: v for k, v in again.items() if not k.startswith("predicted")} == {
    k: v for k, v in held[key].items() if not k.startswith("predicted")
  }
  baselines.runtime_study(*args, killed_seeds=1, repredict=True)  # a second time keeps the first's
  assert json.loads((tmp_path / "runtime_runs.json").read_text())[key]["predicted_earlier"] == earlier


def test_a_job_started_over_keeps_its_first_lives_start(tmp_path):
  from ripples_jax.runlog.records import archive
  from ripples_jax.runtime import trace as trace_lib

  (tmp_path / "clock.jsonl").write_text(json.dumps({"wall": 100.0, "run": 0.0}) + "\n")
  assert archive(str(tmp_path)) == 1  # what a fresh start over the first life's records does
  (tmp_path / "clock.jsonl").write_text(json.dumps({"wall": 150.0, "run": 0.0}) + "\n")
  starts = trace_lib.load_starts(str(tmp_path), earlier=True)
  assert starts == [{"wall": 100.0, "run": 0.0}, {"wall": 150.0, "run": 0.0}]
  assert trace_lib.load_starts(str(tmp_path)) == starts[1:]


def test_all_reduce_over_the_fast_workers_leaves_the_straggler_out():
  """'allreduce/drop_slow=True': the job without its fixed straggler (15 workers, none slow, the
  training set sharded over them), a valid config; homogeneous it is All-Reduce itself; a moving
  straggler cannot be dropped. The hybrid's form leaves the slow device's replica out."""
  from experiments import hybrid_study, ledger_tta
  from ripples_jax.config import validate_train_config

  config, base, _ = ledger_tta.scenario_config("5x straggler", "allreduce/drop_slow=True", 0.1, 0, 10)
  assert base == "allreduce" and config.num_workers == 15 and tuple(config.hetero.slow_workers) == ()
  validate_train_config(config, num_devices=8)
  full, _, _ = ledger_tta.scenario_config("5x straggler", "allreduce", 0.1, 0, 10)
  assert full.num_workers == 16 and tuple(full.hetero.slow_workers) == (15,)
  same, _, _ = ledger_tta.scenario_config("homogeneous", "allreduce/drop_slow=True", 0.1, 0, 10)
  assert same.num_workers == 16
  with pytest.raises(ValueError, match="moving straggler"):
    ledger_tta.scenario_config("moving 5x straggler", "allreduce/drop_slow=True", 0.1, 0, 10)
  c = hybrid_study.config_of("4x2", "5x device", "allreduce/drop_slow=True", 0.01, 0)
  assert c.replicas.count == 3 and tuple(c.replicas.slow) == () and c.replicas.algorithm == "allreduce"
  assert baselines.LABELS["allreduce/drop_slow=True"] == "All-Reduce, straggler dropped"

"""The fair fight's study (experiments.baselines2): one tuning budget, the deployable model's charged
clock, the straggler's own tuning, both metrics and the better All-Reduce as the straggler baseline."""

import math
import subprocess
import sys

import pytest

from experiments import baselines2 as b2
from experiments.ledger_tta import run_key, variant


def _keys(v):
  return variant(v)[1]


def test_every_method_searches_lr_and_momentum_on_one_budget():
  """Every SGD method's first search is the same 10 points: the effective step lr / (1 - momentum) on
  EFF_GRID at each momentum; AdamW's (DiLoCo) 5 step sizes, then its outer lr x outer momentum; a
  key of its own adds its other points, and no method searches more than 12 distinct points."""
  for k, m in b2.METHODS.items():
    first = b2.stage_one(m)
    points = set(first) | set(b2.stage_two(m, first[0]))
    assert 10 <= len(points) <= 12, (k, len(points))
    if m.momentum is None:
      assert [lr for _, lr in first] == list(b2.ADAMW_LRS)
      assert {_keys(v)["optimizer.name"] for v, _ in points} == {"adamw"}
      outer = {(_keys(v)["diloco.outer_lr"], _keys(v)["diloco.outer_momentum"]) for v, _ in points}
      assert outer == {(o, mu) for o in (0.5, 0.7, 1.0) for mu in b2.MOMENTA}
      continue
    got = sorted((_keys(v)[m.momentum], round(lr / (1 - _keys(v)[m.momentum]), 6)) for v, lr in first)
    assert got == sorted((mu, eff) for mu in b2.MOMENTA for eff in b2.EFF_GRID)
  # The windowed Moshpit and the lockstep one are two methods; only the first has a window.
  assert "moshpit.window" in _keys(b2.stage_one(b2.METHODS["moshpit"])[0][0])
  assert "moshpit.window" not in _keys(b2.stage_one(b2.METHODS["moshpit_lockstep"])[0][0])


def _run(val, cval, ctime, time=None, median=None, worst=None):
  n = len(val)
  time = time or list(range(1, n + 1))
  return {
    "curve": {
      "time": time,
      "ctime": ctime,
      "step": list(range(n)),
      "test": val,
      "val": val,
      "cval": cval,
      "consensus": cval,
      "median": median or val,
      "worst": worst or val,
    },
    "end": time[-1],
    "throughput": 1.0,
  }


def test_tuning_scores_the_deployable_model_on_its_charged_clock():
  """The averaged model reaches 0.55 at t=2, the consensus model at its charged clock 4.5: the score is
  4.5 (median over the runs); a run that crosses and ends below the target is a miss."""
  a = _run([0.3, 0.6, 0.6, 0.6], [0.3, 0.4, 0.6, 0.6], [1.5, 2.5, 3.5, 4.5])
  b = _run([0.3, 0.6, 0.6, 0.6], [0.3, 0.4, 0.4, 0.6], [1.5, 2.5, 3.5, 4.5])
  assert b2.score([a, b], 0.55)[0] == pytest.approx(4.0)  # median of 3.5 and 4.5
  collapse = _run([0.6, 0.6, 0.6, 0.5], [0.6, 0.6, 0.6, 0.5], [1, 2, 3, 4])
  assert math.isinf(b2.score([collapse], 0.55)[0])


def test_straggler_scenarios_take_the_straggler_tuning_and_only_fixed_ones_drop_it():
  kinds = {sc: b2.tuned_by(sc) for sc in b2.SCENARIOS}
  assert (
    kinds["homogeneous, VGG-16 clock"] == kinds["worker killed and restarted, VGG-16 clock"] == "homogeneous"
  )
  assert {kinds[sc] for sc in b2.SCENARIOS if "straggler" in sc or "random" in sc} == {"straggler"}
  for sc in b2.SCENARIOS:
    assert ("allreduce_drop" in b2.methods_of(sc, b2.METHODS)) == (sc in b2.FIXED_STRAGGLER)


def test_tune_takes_the_best_point_of_both_stages(monkeypatch, tmp_path):
  """Fake runs whose charged validation time is lr + group size + 5 (1 - momentum): Smart GG's first stage picks its
  least lr at group size 3, its second stage group size 2 at that lr; All-Reduce over the fast
  workers is not tuned on the homogeneous scenario."""

  def fake(out_dir, jobs, workers):
    out = {}
    for j in jobs:
      keys = _keys(j[1])
      t = j[2] + keys.get("schedule.group_size", 0) + 5 * (1 - keys.get("optimizer.momentum", 0))
      out[run_key(*j)] = _run([0.6] * 3, [0.6] * 3, [t, t + 1, t + 2])
    return out

  monkeypatch.setattr(b2, "train_runs", fake)
  got = b2.tune(str(tmp_path), "homogeneous", ["allreduce", "allreduce_drop", "smart"], 1)
  assert "allreduce_drop" not in got["chosen"]
  v, lr = got["chosen"]["smart"]
  # 0.1, its row's least step, is the grid's edge: two points past it (0.05, 0.025), then group size.
  assert lr == 0.025 and _keys(v)["schedule.group_size"] == 2 and _keys(v)["optimizer.momentum"] == 0.9
  assert len(got["points"]["smart"]) == 14


def test_a_choice_at_the_grid_edge_extends_its_row_and_one_inside_does_not(monkeypatch, tmp_path):
  """The edge rule: DiLoCo's AdamW row chosen at its largest step (0.016) searches 0.032 and 0.064;
  All-Reduce's best inside its row (lr 0.4 at momentum 0.9) adds nothing."""

  def fake(out_dir, jobs, workers):
    out = {}
    for j in jobs:
      keys = _keys(j[1])
      best = 0.05 if keys.get("optimizer.name") == "adamw" else 0.4
      t = 10 + abs(math.log(j[2] / best)) + 5 * (1 - keys.get("optimizer.momentum", 0.9))
      out[run_key(*j)] = _run([0.6] * 3, [0.6] * 3, [t, t + 1, t + 2])
    return out

  monkeypatch.setattr(b2, "train_runs", fake)
  got = b2.tune(str(tmp_path), "homogeneous", ["allreduce", "diloco"], 1)
  assert got["chosen"]["allreduce"][1] == 0.4 and len(got["points"]["allreduce"]) == 10
  assert got["chosen"]["diloco"][1] == 0.064  # past the edge: 0.064 is nearer 0.05 than 0.032 is (log)
  assert {"0.032", "0.064"} <= {p.split("|lr=")[1] for p in got["points"]["diloco"]}
  assert len(got["points"]["diloco"]) == 12
  assert b2.past_edge([("v", 1.0), ("v", 2.0), ("w", 4.0)], ("v", 2.0)) == [("v", 4.0), ("v", 8.0)]
  assert b2.past_edge([("v", 1.0), ("v", 2.0), ("v", 4.0)], ("v", 2.0)) == []


def _rec(label, times, ends, own=None, final=0.6):
  own = own or times
  m = lambda ts: {"time": ts, "end": ends, "final": [final] * len(ts)}  # noqa: E731
  return {
    "label": label,
    "variant": "x",
    "lr": 0.1,
    "deployable": m(times),
    "own": m(own),
    "mean": m(times),
    "worst_final": [final] * len(times),
    "throughput": [1.0] * len(times),
  }


def test_straggler_headlines_are_against_the_better_all_reduce_and_disagreeing_winners_are_named():
  per = {
    "allreduce": _rec("All-Reduce", [10, 11, 12], [50] * 3),
    "allreduce_drop": _rec("dropped", [6, 7, 6.5], [50] * 3),
    "smart": _rec("Smart GG", [5, 6, 5.5], [50] * 3, own=[9, 9.5, 10]),
    "adpsgd": _rec("AD-PSGD", [8, 8, 9], [50] * 3, own=[5, 5.5, 5]),
  }
  assert b2.baseline_of(per, "deployable") == "allreduce_drop"
  assert b2.fastest(per, "deployable") == "smart"
  assert b2.fastest(per, "own") == "adpsgd"
  text = str(b2.winners_table({"5x straggler, VGG-16 clock": per}))
  assert "no: the metrics disagree" in text
  # A method that never reached ranks last even where its censored end is early.
  per["never"] = _rec("never", [None] * 3, [1.0] * 3)
  assert b2.fastest(per, "deployable") == "smart"


@pytest.mark.slow  # a subprocess: jax imports
def test_the_study_refuses_an_unknown_method_in_one_line():
  r = subprocess.run(
    [sys.executable, "-m", "experiments.baselines2_study", "--methods=allreduce,bogus", "--parts=tune"],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode != 0
  assert "bogus" in r.stderr and "Traceback" not in r.stderr


def test_real_process_runs_drop_the_straggler_on_15_processes_and_time_the_consensus():
  """All-Reduce over the fast workers runs 15 processes without the straggler, every step; Smart GG
  times its consensus All-Reduce; AD-PSGD (elastic: its tickets) and All-Reduce (its workers hold the
  model) do not; every config is one the runtime takes."""
  from configs import default as default_config
  from experiments import ledger_runtime
  from ripples_jax.config import validate_train_config

  got = {k: b2.runtime_keys("5x straggler", k, 20, 0.4) for k in b2.RUNTIME_METHODS}
  base, keys, n = got["allreduce_drop"]
  assert (base, n, keys["num_steps"]) == ("allreduce", ledger_runtime.N - 1, b2.RUNTIME_STEPS)
  assert "hetero.slow_workers" not in keys and "hetero.slow_workers" in got["allreduce"][1]
  assert got["smart"][1]["runtime.consensus_allreduce"] is True
  assert "runtime.consensus_allreduce" not in got["adpsgd"][1] and got["adpsgd"][1]["runtime.elastic"]
  assert "runtime.consensus_allreduce" not in got["allreduce"][1]
  assert (
    got["moshpit"][1]["moshpit.window"] == b2.RUNTIME_WINDOW
    and got["moshpit"][1]["runtime.consensus_allreduce"]
  )
  for base, keys, n in got.values():
    config = default_config.get_config(ledger_runtime.base_config(base, "async", n))
    config.update_from_flattened_dict(keys)
    validate_train_config(config, num_devices=n + 1, num_processes=n + 1)


def test_a_real_process_runs_deployable_time_is_charged_its_own_or_a_borrowed_all_reduce():
  r = {"evals": [[1.0, 0.4], [2.0, 0.6]], "own": [[1.0, 0.3], [2.0, 0.5]], "end": 3.0, "time_to_target": 2.0}
  got = b2.runtime_record({**r, "consensus_charge": 0.25}, 9.0, 0.55)
  assert got["deployable"] == {"time": 2.25, "end": 3.25} and got["charge"] == 0.25
  assert got["own"] == {"time": None, "end": 3.0} and got["mean"]["time"] == 2.0
  borrowed = b2.runtime_record(r, 0.5, 0.55)  # an elastic run: the same seed's Smart GG's
  assert borrowed["deployable"]["time"] == 2.5 and borrowed["charge"] == 0.5
  # All-Reduce's workers hold the run's model: their own is the mean, not a marker's pre-average snapshot.
  assert b2.runtime_record(r, 0.0, 0.55, held=True)["own"]["time"] == 2.0


def test_the_real_process_table_has_every_scenario_and_the_straggler_baseline_is_the_better_all_reduce():
  lr_of = {k: 0.1 for k in b2.RUNTIME_METHODS}
  held = {}
  for sc in b2.RUNTIME_SCENARIOS:
    for k in b2.RUNTIME_METHODS:
      for s in b2.RUNTIME_SEEDS:
        t = {"allreduce": 100.0 if sc != "homogeneous" else 30.0, "allreduce_drop": 30.0}.get(
          k, 40.0
        ) + s / 100
        held[f"{sc}|{k}|lr=0.1|seed={s}"] = {
          "evals": [[t, 0.6]],
          "own": [[t, 0.6]],
          "end": 50.0 if k != "allreduce" else 160.0,
          "time_to_target": t,
          "consensus_charge": 0.1 if k in ("smart", "moshpit") else None,
          "final": 0.6,
          "predicted": {"time_to_target": t},
        }
  text = b2.runtime_text(held, lr_of, b2.RUNTIME_SEEDS, 0.55)
  rows = [line for line in text.splitlines() if line.startswith("| 5x straggler")]
  assert len(rows) == len(b2.RUNTIME_METHODS)
  smart = next(r for r in rows if "| Smart GG |" in r)
  assert "0.75x" in smart  # 40.1 s (charged) against the dropped All-Reduce's 30 s, not All-Reduce's 100


@pytest.mark.slow  # generates the 33,000-example MNIST-1D (5 s)
def test_every_one_of_256_workers_holds_100_training_examples():
  """The 256-worker part's data: after the validation hold-out, every worker's shard has >= 100."""
  from experiments.ledger_tta import scenario_config
  from ripples_jax import workload

  for sc in b2.SCENARIOS_256:
    config, _, _ = scenario_config(sc, "allreduce", 0.1, 20, b2.AT256.steps, every=b2.AT256.every)
    shards = workload.build(config).shards
    assert len(shards) == 256 and min(len(s) for s in shards) >= 100


def test_a_part_without_a_tuning_takes_the_main_choices_and_the_long_part_runs_h64_thirty_rounds(
  monkeypatch, tmp_path
):
  """sim_part(AT256) runs each scenario's kind's choice from tuning.json at the part's length and
  interval and writes at256.md/json, not tuning.md; LONG tunes at 1,920 steps, where DiLoCo H=64's
  runs make 30 outer steps."""
  jobs = []

  def fake(out_dir, js, workers):
    jobs.extend(js)
    return {run_key(*j): _run([0.6] * 3, [0.6] * 3, [1.0, 2.0, 3.0]) for j in js}

  monkeypatch.setattr(b2, "train_runs", fake)
  lr_of = {"homogeneous": 0.1, "straggler": 0.2}
  chosen = {
    kind: {"scenario": sc, "chosen": {k: [m.variant, lr_of[kind]] for k, m in b2.METHODS.items()}}
    for kind, sc in b2.TUNE_ON.items()
  }
  (tmp_path / "tuning.json").write_text(__import__("json").dumps(chosen))
  b2.sim_part(str(tmp_path), b2.AT256, b2.METHODS_256, (20,), 1)
  assert {(j[0], j[2], j[4], j[7]) for j in jobs if j[1] == b2.METHODS["smart"].variant} == {
    (b2.SCENARIOS_256[0], 0.1, 480, 8),
    (b2.SCENARIOS_256[1], 0.2, 480, 8),
  }
  assert {j[0] for j in jobs if j[1].startswith("allreduce/drop_slow")} == {b2.SCENARIOS_256[1]}
  assert {j[0] for j in jobs if j[1].startswith("adpsgd")} == {b2.SCENARIOS_256[0]}  # left out at 5x
  assert (tmp_path / "at256.md").exists() and not (tmp_path / "tuning.md").exists()
  jobs.clear()
  b2.sim_part(str(tmp_path), b2.LONG, b2.METHODS_LONG, (20,), 1)
  h64 = [j for j in jobs if "inner_steps=64" in j[1]]
  assert h64 and all(j[4] == 1920 and j[4] // _keys(j[1])["diloco.inner_steps"] >= 30 for j in h64)
  assert {j[4] for j in jobs} == {1920} and (tmp_path / "tuning_long.md").exists()

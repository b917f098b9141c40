"""experiments.ledger's reading of its runs: crossings, the step-size choice, records per target, the
accuracy after a fixed time; synthetic curves, so every number is known (no training)."""

import json

import numpy as np
import pytest

from experiments import ledger_claims, ledger_tables, ledger_tta, ledger_verdicts, study
from ripples_jax import verdict


def curve(times, test, worker=None, val=None):
  n = len(times)
  return {
    "time": list(times),
    "step": list(range(1, n + 1)),
    "test": list(test),
    "worker": list(worker if worker is not None else test),
    "val": list(val if val is not None else test),
  }


def test_crossing_and_accuracy_at_read_the_first_evaluation_at_or_above():
  c = curve([1.0, 2.0, 3.0, 4.0], [0.2, 0.5, 0.4, 0.6], worker=[0.1, 0.2, 0.5, 0.7])
  assert study.crossing(c, 0.5) == (2.0, 2) and study.crossing(c, 0.55) == (4.0, 4)
  assert study.crossing(c, 0.5, "worker") == (3.0, 3) and study.crossing(c, 0.8) is None
  assert study.accuracy_at(c, 0.5) == 0.0  # before the first evaluation
  assert study.accuracy_at(c, 2.0) == 0.5 and study.accuracy_at(c, 2.9) == 0.5
  assert study.accuracy_at(c, 3.0) == 0.4 and study.accuracy_at(c, 99.0) == 0.6


def test_tune_takes_the_least_median_validation_time_and_breaks_misses_by_final_accuracy(
  tmp_path, monkeypatch
):
  """allreduce: lr 0.1 reaches the target at 2 and 3 (median 2.5); lr 0.2 at 1 twice, but its second
  seed collapses to 0.1 by its end, so it counts as never (median never); lr 0.05 at 2 and 4 (median
  3): 0.1. adpsgd misses everywhere: the best final validation
  accuracy, 0.2's. The choice is made on validation: test accuracy says otherwise and is ignored."""
  val = {  # (algorithm, lr, seed) -> validation curve; test curves are the reverse ranking
    ("allreduce", 0.05, 0): [0.1, 0.6, 0.6, 0.6],
    ("allreduce", 0.05, 1): [0.1, 0.1, 0.1, 0.6],
    ("allreduce", 0.1, 0): [0.1, 0.6, 0.6, 0.6],
    ("allreduce", 0.1, 1): [0.1, 0.1, 0.6, 0.6],
    ("allreduce", 0.2, 0): [0.6, 0.6, 0.6, 0.6],
    ("allreduce", 0.2, 1): [0.6, 0.6, 0.6, 0.1],  # reaches, then collapses
  }
  for seed in (0, 1):
    for lr, last in ((0.05, 0.3), (0.1, 0.35), (0.2, 0.4)):
      val[("adpsgd", lr, seed)] = [0.1, 0.2, 0.3, last]

  def fake_jobs(out_dir, jobs, workers=1):
    # Tuning runs: at TUNE_SEEDS (none of them a reported seed 0..4), without the workers' own models.
    assert all(j[3] in ledger_tta.TUNE_SEEDS and j[3] >= 5 and j[6] is False for j in jobs)
    key = lambda j: (j[1], j[2], ledger_tta.TUNE_SEEDS.index(j[3]))  # noqa: E731
    return {
      ledger_tta.run_key(*j): {
        "curve": curve([1.0, 2.0, 3.0, 4.0], [0.9 - v for v in val[key(j)]], val=val[key(j)])
      }
      for j in jobs
    }

  monkeypatch.setattr(ledger_tta, "train_runs", fake_jobs)
  monkeypatch.setitem(ledger_tta.TTA_ALGORITHMS_OF, "homogeneous", ("allreduce", "adpsgd"))
  got = ledger_tta.tune(str(tmp_path), ["light"], steps=4, target=0.55, grid=(0.05, 0.1, 0.2))
  assert got == {"light": {"allreduce": 0.1, "adpsgd": 0.2}}
  stored = json.loads((tmp_path / "tuning.json").read_text())
  assert stored["points"]["light"]["allreduce"]["0.1"] == [2.5, 0.6]
  assert stored["points"]["light"]["allreduce"]["0.2"] == [None, 0.35]  # never (JSON has no infinity)
  assert "0.2 (grid edge)" in (tmp_path / "tuning.md").read_text()
  # Another clock tuned later in the same folder keeps this one's choice (tuning.json merges).
  monkeypatch.setitem(ledger_tta.TTA_ALGORITHMS_OF, "homogeneous, VGG-16 clock", ("allreduce",))
  again = ledger_tta.tune(str(tmp_path), ["heavy"], steps=4, target=0.55, grid=(0.05, 0.1, 0.2))
  assert again == {"heavy": {"allreduce": 0.1}}
  stored = json.loads((tmp_path / "tuning.json").read_text())
  assert stored["choice"] == {"light": {"allreduce": 0.1, "adpsgd": 0.2}, "heavy": {"allreduce": 0.1}}


def test_summarize_stores_every_target_both_evaluations_and_the_ends():
  runs = [
    {
      "curve": curve([1.0, 2.0, 3.0], [0.5, 0.56, 0.6], worker=[0.4, 0.5, 0.55]),
      "end": 3.5,
      "throughput": 7.0,
    },
    {
      "curve": curve([1.0, 2.0, 3.0], [0.45, 0.52, 0.57], worker=[0.4, 0.45, 0.5]),
      "end": 3.2,
      "throughput": 8.0,
    },
  ]
  r = ledger_tta.summarize(runs, 0.2, target=0.55)
  assert r["lr"] == 0.2 and r["time"] == [2.0, 3.0] and r["steps"] == [2, 3] and r["end"] == [3.5, 3.2]
  assert (
    r["times"]["0.5"] == [1.0, 2.0] and r["times"]["0.58"] == [3.0, None] and r["times"]["0.6"] == [3.0, None]
  )
  assert r["worker_times"]["0.55"] == r["worker_time"] == [3.0, None]
  assert r["final"] == [0.6, 0.57] and r["final_worker"] == [0.55, 0.5]


def test_a_claim_at_each_target_is_the_paired_estimate_of_those_times():
  def rec(times, worker, end):
    return {"time": times["0.55"], "end": end, "times": times, "worker_times": worker}

  smart_t = {"0.5": [1.0] * 5, "0.55": [2.0] * 5, "0.58": [3.0, 3.0, 3.0, 3.0, None], "0.6": [None] * 5}
  ar_t = {"0.5": [1.1] * 5, "0.55": [2.4, 2.2, 2.3, 2.2, 2.5], "0.58": [3.3] * 5, "0.6": [None] * 5}
  tta_out = {
    "scenarios": {
      "homogeneous, VGG-16 clock": {
        "ripples_smart": rec(smart_t, smart_t, [4.0] * 5),
        "allreduce": rec(ar_t, ar_t, [5.0] * 5),
      }
    }
  }
  claim = "homogeneous vs All-Reduce"
  e = ledger_verdicts.claim_estimate(tta_out, claim, target="0.55")
  assert e == verdict.paired(smart_t["0.55"], ar_t["0.55"], ([4.0] * 5, [5.0] * 5))
  miss = ledger_verdicts.claim_estimate(tta_out, claim, target="0.58")
  assert miss.reached == 4 and miss.censored == 1  # the miss at its run's end (4.0): 3.3 / 4.0
  # no AD-PSGD runs:
  assert ledger_verdicts.claim_estimate(tta_out, "homogeneous vs AD-PSGD", target="0.55") is None
  table = ledger_verdicts.targets_table(tta_out)
  assert [r[:3] for r in table.rows] == [
    [claim, "1.1x (arXiv)", "averaged model"],
    [claim, "1.1x (arXiv)", "workers' mean"],
  ]
  assert table.rows[0][4] == f"{e}: {verdict.judge(e, 1.1)}"


def test_fixed_time_is_each_algorithms_accuracy_at_fractions_of_the_shortest_run():
  seeds, steps = 5, 4
  rng = np.random.default_rng(0)
  runs, per = {}, {}
  for a, lr in (("ripples_smart", 0.1), ("adpsgd", 0.2), ("allreduce", 0.4)):
    ends = []
    for s in range(seeds):
      times = np.cumsum(rng.uniform(0.5, 1.0, steps)).tolist()
      acc = np.sort(rng.uniform(0.2, 0.7, steps)).tolist()
      runs[ledger_tta.run_key(ledger_tables.FIXED_TIME_SCENARIO, a, lr, s, steps)] = {
        "curve": curve(times, acc),
        "end": times[-1],
      }
      ends.append(times[-1])
    per[a] = {"lr": lr, "end": ends}
  got = ledger_tables.fixed_time(runs, {"scenarios": {ledger_tables.FIXED_TIME_SCENARIO: per}}, steps)
  shortest = min(min(p["end"]) for p in per.values())
  assert got["shortest_end"] == shortest
  half = got["budgets"][1]
  assert half["time"] == 0.5 * shortest
  for a, p in per.items():
    want = [
      100
      * study.accuracy_at(
        runs[ledger_tta.run_key(ledger_tables.FIXED_TIME_SCENARIO, a, p["lr"], s, steps)]["curve"],
        0.5 * shortest,
      )
      for s in range(seeds)
    ]
    assert half["accuracy"][a] == want
  d = np.array(half["accuracy"]["ripples_smart"]) - np.array(half["accuracy"]["adpsgd"])
  m, lo, hi = verdict.t_interval(d)
  got_d = half["smart_minus"]["adpsgd"]
  assert (got_d["mean"], got_d["lo"], got_d["hi"]) == (m, lo, hi)
  assert got_d["paper"] == pytest.approx(64.21 - 58.28)
  assert got_d["verdict"] == verdict.judge_difference(m, lo, hi, got_d["paper"])
  assert len(ledger_tables.fixed_time_table(got).rows) == len(ledger_tables.FIXED_TIME_FRACTIONS)


def test_a_clock_variant_is_run_at_its_base_clocks_step_size_and_judged_beside_it(tmp_path, monkeypatch):
  """tta on "..., overlap 2/3" tunes on the VGG-16 clock's homogeneous scenario (TUNED_ON) and runs
  at its choice; variants_table judges each claim on each variant from those records."""
  best = {"allreduce": 0.4, "ripples_smart": 0.2}

  def fake_jobs(out_dir, jobs, workers=1):
    out = {}
    for name, a, lr, seed, steps, model, own in jobs:
      assert name in ("homogeneous, VGG-16 clock", "homogeneous, VGG-16 clock, overlap 2/3"), name
      reach = 0.55 if lr == best[a] else 0.5  # only the best step size reaches the target
      speed = {"allreduce": 2.0, "ripples_smart": 1.0}[a] * (1 + 0.01 * seed)
      times = [speed * (i + 1) for i in range(4)]
      out[ledger_tta.run_key(name, a, lr, seed, steps, model, own)] = {
        "curve": curve(times, [0.3, 0.4, reach, reach]),
        "end": times[-1],
        "throughput": 1.0 / speed,
      }
    return out

  monkeypatch.setattr(ledger_tta, "train_runs", fake_jobs)
  monkeypatch.setattr(ledger_tta.analysis, "accuracy_vs_time", lambda *a, **k: None)
  got = ledger_tta.tta(
    str(tmp_path),
    5,
    4,
    0.55,
    ("homogeneous, VGG-16 clock, overlap 2/3",),
    ("allreduce", "ripples_smart"),
    grid=(0.2, 0.4),
  )
  variant = got["homogeneous, VGG-16 clock, overlap 2/3"]
  assert {a: r["lr"] for a, r in variant.items()} == best
  assert json.loads((tmp_path / "tuning.json").read_text())["choice"] == {"heavy": best}
  table = ledger_verdicts.variants_table({"scenarios": got})
  row = next(r for r in table.rows if r[0] == "homogeneous vs All-Reduce")
  e = verdict.paired(
    variant["ripples_smart"]["time"],
    variant["allreduce"]["time"],
    (variant["ripples_smart"]["end"], variant["allreduce"]["end"]),
  )
  assert row[2] == "-" and row[3] == f"{e}: {verdict.judge(e, 1.1)}"  # no base-clock runs; the variant's
  assert e.mean == pytest.approx(2.0)
  # Targets where training ends: 95% of All-Reduce's mean final accuracy (0.55), crossed at the third
  # evaluation by both; the budget is the shortest run of each seed (Smart GG's, at its end), where
  # All-Reduce, twice as slow, holds its second evaluation's accuracy.
  ar, smart = variant["allreduce"], variant["ripples_smart"]
  assert ar["end_target"] == smart["end_target"] == pytest.approx(0.95 * 0.55)
  assert ar["end_time"] == pytest.approx([6.0 * (1 + 0.01 * s) for s in range(5)])
  assert smart["end_time"] == pytest.approx([3.0 * (1 + 0.01 * s) for s in range(5)])
  assert ar["budget"] == smart["budget"] == pytest.approx([4.0 * (1 + 0.01 * s) for s in range(5)])
  assert ar["budget_acc"] == [0.4] * 5 and smart["budget_acc"] == [0.55] * 5
  ends = ledger_verdicts.ends_table({"scenarios": {"homogeneous, VGG-16 clock": variant}})
  row = next(r for r in ends.rows if r[0] == "homogeneous vs All-Reduce")
  assert row[4].startswith("2.00x [2.00, 2.00]") and row[6].startswith("+15.0 [+15.0, +15.0] (Ripples ahead)")


@pytest.mark.slow  # in process, too long for the fast tier
@pytest.mark.filterwarnings("ignore:Mean of empty slice")  # the diverged step's losses are all NaN
def test_a_diverged_run_is_kept_as_far_as_it_got_and_counts_zero():
  """A step size far too large: the run log stops the run at its first non-finite loss; the ledger
  keeps its records, marks it diverged and scores its final accuracy 0 (a real 10-step run)."""
  r = ledger_tta.train_run("homogeneous", "allreduce", 1e4, 0, 10)
  assert r["diverged"] and study.final(r) == 0.0 and study.final(r, "val") == 0.0
  assert 0 < len(r["curve"]["time"]) < 10 and r["end"] == r["curve"]["time"][-1]
  assert ledger_tta.summarize([r], 1e4, 0.55)["diverged"] == 1


def test_verdicts_text_names_what_each_verdict_rests_on_and_the_claims_no_run_compares(tmp_path):
  """verdicts.md's parts from stored records alone: the verdict table, what each verdict rests on, the
  sync-overhead and conflict rows (from sync_overhead.json and ledger.json)."""
  ledger_out = {
    "claims": [{"throughput_heavy": [1.0, 0.0]} for _ in ledger_claims.CLAIMS],
    "scale": [],
    "conflicts": {"ripples_random": 650.0},
  }
  (tmp_path / "sync_overhead.json").write_text(
    json.dumps({"heavy": {"ripples_smart": [0.1, 0.12], "adpsgd": [0.0, 0.0]}})
  )
  text = ledger_verdicts.verdicts_text(str(tmp_path), ledger_out, None, 0.55, 300)
  assert "What each verdict rests on:" in text and "vs AD-PSGD: AD-PSGD's sync overhead" in text
  assert (
    "Smart GG 110.00 ms, AD-PSGD 0.00 ms: AD-PSGD's over Smart GG's 0.00x against the paper's 5.10x" in text
  )
  assert "ripples_random 650.0 (the paper publishes no count)" in text


def test_the_scale_rows_pair_seeds_and_censor_misses_when_the_records_hold_ends():
  smart = {"time": [1.0, 1.1, None, 1.0, 0.9], "end": [3.0] * 5}
  ar = {"time": [4.0, 4.2, 4.1, 3.9, 4.0], "end": [9.0] * 5}
  led = {"scale": [{"n": 64, "smart_vs_allreduce": [4.6, 0.0], "limit": 4.94}]}
  rows = ledger_tables.scale_table(
    led, {"scenarios": {"5x straggler, 64 workers": {"allreduce": ar, "ripples_smart": smart}}}, 0.55
  ).rows
  want = verdict.paired(smart["time"], ar["time"], (smart["end"], ar["end"]))
  assert want.censored == 1 and rows[0][2] == f"{want} (5 seeds)"


def _tta(model, ratios):
  """A tta.json whose 'one worker 2x slower vs All-Reduce' claim (figure 2x) has Smart GG at ratio x
  All-Reduce's speed in each scenario suffix: {suffix: x}, 6 seeds with a little noise."""
  noise = np.array([1.0, 1.01, 0.99, 1.02, 0.98, 1.0])
  out = {"model": model, "scenarios": {}}
  for suffix, x in ratios.items():
    ar = list(10.0 * noise)
    out["scenarios"]["2x straggler, VGG-16 clock" + suffix] = {
      "allreduce": {"time": ar, "end": [100.0] * 6},
      "ripples_smart": {"time": list(10.0 / x * noise[::-1]), "end": [100.0] * 6},
    }
  return out


def test_a_verdict_holds_only_on_both_models_and_every_clock_variant():
  claim = "one worker 2x slower vs All-Reduce"
  same = {"": 2.0, ", overlap 2/3": 2.0, ", 58.9 MB message": 2.0}
  row = lambda t, o: next(r for r in ledger_verdicts.robust_table(t, o).rows if r[0] == claim)  # noqa: E731
  assert row(_tta("mlp", same), _tta("cnn1d", {"": 2.0}))[-1] == "holds: reproduced"
  got = row(_tta("mlp", same), _tta("cnn1d", {"": 4.0}))[-1]
  assert got == "model-dependent (mlp reproduced, cnn1d larger)"
  got = row(_tta("mlp", {**same, ", 58.9 MB message": 1.2}), _tta("cnn1d", {"": 2.0}))[-1]
  assert got == "clock-dependent (VGG-16 clock reproduced, overlap 2/3 reproduced, 58.9 MB message smaller)"
  # A cell the records lack is shown as - and left out of the reading.
  r = row(_tta("mlp", {"": 2.0}), None)
  assert r[-1] == "holds: reproduced" and r[3:5] == ["-", "-"]

"""experiments.ledger_dsp: the DSP claims ledger, on small stored results shaped like the real ones."""

import json
import math
import os

import numpy as np
import pytest
from scipy import stats

from experiments import ledger_dsp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(root, rel, obj):
  path = os.path.join(root, rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f)


def t95(values):
  v = np.asarray(values, np.float64)
  half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
  return v.mean(), v.mean() - half, v.mean() + half


# results/dsp_accuracy, trimmed: K=2, three seeds; bp, dsp, gpipe (one seed diverged); no ddg.
ACC = {
  "bp": (0.2, [0.952, 0.956, 0.935]),
  "dsp": (0.05, [0.926, 0.928, 0.935]),
  "gpipe": (0.2, [0.950, math.nan, 0.943]),
  "dsp_weight_stash": (0.05, [0.922, 0.925, 0.915]),
}


def accuracy_results(root):
  results, runs = {}, {}
  for m, (lr, accs) in ACC.items():
    ok = [a for a in accs if not math.isnan(a)]
    results[f"K2_{m}"] = {
      "K": 2,
      "method": m,
      "best_lr": lr,
      "best": {
        "test_accuracy": [0.0 if math.isnan(a) else a for a in accs],
        "mean_test_accuracy": np.mean(ok),
      },
    }
    for s, a in enumerate(accs):
      runs[f"K2_{m}_lr{lr:g}_seed{s}"] = {
        "K": 2,
        "method": m,
        "lr": lr,
        "seed": s,
        "diverged": math.isnan(a),
        "final_test_accuracy": a,
      }
  write(
    root,
    "dsp_accuracy/table.json",
    {"epochs": 120, "selected_on": "validation", "seeds": [0, 1, 2], "stage_counts": [2], "results": results},
  )
  write(root, "dsp_accuracy/runs.json", runs)


def test_accuracy_is_the_paired_difference_and_its_t_interval(tmp_path):
  accuracy_results(tmp_path)
  rows = {r["comparison"]: r for r in ledger_dsp.accuracy_rows(str(tmp_path))}
  dsp = rows["K=2: DSP as published vs BP"]
  diff = 100 * (np.array(ACC["dsp"][1]) - np.array(ACC["bp"][1]))
  mean, lo, hi = t95(diff)
  assert dsp["claim"] == "accuracy" and dsp["seeds"] == [0, 1, 2]
  assert dsp["diff_points"] == pytest.approx(diff.tolist(), abs=1e-9)
  assert (dsp["mean"], dsp["lo"], dsp["hi"]) == pytest.approx((mean, lo, hi), abs=1e-9)
  assert lo < 0 < hi and dsp["verdict"].startswith("no loss reproduced (the interval holds 0")
  stash = rows["K=2: weight stashing on DSP's schedule (not DSP as published) vs BP"]
  mean, lo, hi = t95(100 * (np.array(ACC["dsp_weight_stash"][1]) - np.array(ACC["bp"][1])))
  assert hi < 0
  assert stash["verdict"] == f"loss of {-mean:.2f} points (interval [{lo:+.2f}, {hi:+.2f}]); 3 paired seeds"
  # A diverged run (NaN) counts 0, as the grid counts it.
  gpipe = rows["K=2: GPipe (M=4) vs BP"]
  assert gpipe["diff_points"][1] == pytest.approx(-95.6, abs=1e-9)
  assert rows["K=2: DDG vs BP"]["ours"] == "not measured (no K2_ddg row)"


def curve(t_at, acc_at):
  return [[float(t), float(a)] for t, a in zip(t_at, acc_at)]


def tta_results(root, dsp_end=4.0, bp_fr_end=True):
  """bp_single_process, dsp, gpipe, ddg, fr at seeds 0-2; dsp seed 1 never reaches 92% (ends at dsp_end);
  fr seed 2 misses too, with its end recorded or not."""
  runs = {}
  times = {
    "bp_single_process": [3.0, 2.5, 3.5],
    "dsp": [6.0, None, 7.0],
    "gpipe": [20.0, 18.0, 25.0],
    "ddg": [9.0, 8.0, 6.0],
    "fr": [12.0, 11.0, None],
  }
  for name, ts in times.items():
    for s, t in enumerate(ts):
      end = (dsp_end if name == "dsp" else 30.0) if t is None else 40.0
      c = curve([1.0, t or end], [0.5, 0.93 if t else 0.91])
      run = {"name": name, "seed": s, "lr": 0.1, "epochs": 120, "K": 2, "curve": c, "whole_s": end}
      if name == "fr" and t is None and not bp_fr_end:
        del run["whole_s"]
      runs[f"{name}_seed{s}"] = run
  write(root, "dsp_time_to_accuracy/runs.json", runs)
  return times


def test_speedup_is_paired_and_a_miss_is_censored_at_the_runs_end(tmp_path):
  times = tta_results(tmp_path, bp_fr_end=False)
  rows = {r["comparison"]: r for r in ledger_dsp.speedup_rows(str(tmp_path), 0.92)}
  bp = rows["DSP as published vs BP, one process on both cores"]
  dsp = [6.0, 4.0, 7.0]  # seed 1 censored at its run's end
  logs = np.log(np.array(times["bp_single_process"]) / np.array(dsp))
  mean, lo, hi = t95(logs)
  assert (bp["mean"], bp["lo"], bp["hi"]) == pytest.approx(tuple(np.exp([mean, lo, hi])), rel=1e-12)
  assert bp["method_s"] == [6.0, None, 7.0] and bp["censored"] == 1
  assert "method reached 2/3" in bp["ours"]
  assert bp["verdict"] == (
    "not reproduced (slower) (1 censored seed); 3 seeds (fewer than the ledger's 5): not judged by "
    "ripples_jax.verdict's rule"
  )
  gpipe = rows["DSP as published vs GPipe (M=4)"]
  assert gpipe["lo"] > 1 and gpipe["verdict"].startswith("reproduced (1 censored seed); 3 seeds")
  assert rows["DSP as published vs DDG"]["verdict"].startswith("inconclusive (the interval holds 1.0)")
  # FR's seed 2 missed and its run records no end: said in the cell, no crash.
  fr = rows["DSP as published vs Features Replay"]
  assert fr["ours"].startswith("fr seed 2 missed 92% and the run's end is not recorded")
  assert fr["verdict"] == "not judged"
  assert rows["DSP as published vs PipeDream-1F1B (DDG's updates, WORKSPACE.md 18)"]["ours"] == (
    "not measured (no pipedream runs)"
  )


def stage(inputs, residuals, fifos, temp=None):
  sb = {
    "params": 1000,
    "inputs": inputs,
    "param_versions": 0,
    "fifos": fifos,
    "optimizer": 1000,
    "residuals": residuals,
    "micro_boundaries": 0,
  }
  xla = None
  if temp is not None:
    xla = {
      "forward": {"argument_size_in_bytes": 1, "temp_size_in_bytes": temp // 2},
      "backward": {"argument_size_in_bytes": 1, "temp_size_in_bytes": temp},
    }
  return sb, xla


def method(its, stages, mode="recompute"):
  return {
    "label": "x",
    "method": "m",
    "mode": mode,
    "measured_iteration_s": {"median": float(np.median(its)), "min": min(its), "max": max(its), "all": its},
    "stored_bytes": [s[0] for s in stages] if stages else None,
    "xla_memory": [s[1] for s in stages] if stages else None,
  }


def pipeline_results(root):
  bench = {
    "best_bp": {"variant": "bp_unpinned", "ms": {"median": 60.0, "min": 50.0, "max": 70.0}, "spread": 0.3},
    "unstable": True,
    "bp_variants_ms": {"bp_pinned": [90.0, 95.0, 99.0], "bp_unpinned": [60.0, 50.0, 70.0]},
    "setting": {
      "num_stages": 2,
      "model": "cnn2d",
      "cores": 2,
      "iterations": 60,
      "reps": 3,
      "microbatches": 4,
    },
    "dsp": method([0.09, 0.08, 0.1], [stage(300, 0, 200, temp=7000), stage(100, 0, 50, temp=3000)]),
    "ddg": method(
      [0.1, 0.1, 0.1], [stage(0, 2000, 200, temp=5000), stage(0, 500, 50, temp=1000)], "residuals"
    ),
    "gpipe": method([0.2, 0.15, 0.3], None),  # no memory recorded
  }
  write(root, "pipeline/k2.json", bench)
  return bench


def test_memory_and_throughput_from_the_benchmark_and_absent_quantities_not_measured(tmp_path):
  bench = pipeline_results(tmp_path)
  mem = {r["comparison"].split(": ")[-1]: r for r in ledger_dsp.memory_rows(str(tmp_path))}
  assert mem["DSP as published"]["stored_bytes"] == 300 + 200 + 100 + 50
  assert mem["DDG"]["stored_bytes"] == 2000 + 200 + 500 + 50
  assert mem["DSP as published"]["xla_temp_bytes"] == 7000
  assert mem["DSP as published"]["verdict"] == (
    f"reproduced: less than DDG ({650 / 2750:.2f}x its stored, {7000 / 5000:.2f}x its XLA temp); "
    "one run, no spread"
  )
  assert mem["GPipe (M=4)"]["ours"] == "stored: not measured; XLA temp, largest program: not measured"
  tp = {r["comparison"].split(": ")[-1]: r for r in ledger_dsp.throughput_rows(str(tmp_path))}
  ratio = np.array(bench["bp_variants_ms"]["bp_unpinned"]) / 1e3 / np.array([0.09, 0.08, 0.1])
  mean, lo, hi = t95(np.log(ratio))  # paired by repetition: the interval is the pairs', not the means'
  got = tp["DSP vs best_bp"]
  assert (got["mean"], got["lo"], got["hi"]) == pytest.approx(tuple(np.exp([mean, lo, hi])), rel=1e-12)
  assert tp["DSP vs best_bp"]["verdict"] == "not reproduced (slower); 3 repetitions paired, not seeds"
  assert tp["DSP vs fr"]["ours"] == "not measured"
  # Stragglers: none in this benchmark, and no pipeline_slack at all.
  strag = ledger_dsp.straggler_rows(str(tmp_path))
  assert [r["ours"] for r in strag] == [
    "not measured (no `_stragglers`: the run had no --slowdowns)",
    "not measured",
  ]


def test_random_stragglers_kept_share_against_the_compared_methods(tmp_path):
  def pair(calm, hit, kept, spread):
    return {"iteration_ms": calm, "iteration_ms_spread": [calm - 1, calm + 1]}, {
      "iteration_ms": hit,
      "iteration_ms_spread": [hit - 2, hit + 2],
      "kept_vs_mean_extra": kept,
      "kept_spread": spread,
    }

  slack = {"p": 0.2, "slowdown": 3.0, "reps": 3, "iterations": 60}
  for name, args in {
    "dsp_d1_slack": (100.0, 150.0, 0.9, [0.88, 0.92]),  # below BP's range, inside GPipe's
    "dsp_d2_slack": (100.0, 130.0, 1.08, [1.05, 1.10]),  # above both
    "dsp_d2_lockstep": (100.0, 140.0, 0.95, [0.90, 0.99]),  # overlaps both
    "bp_model_parallel": (160.0, 210.0, 1.0, [0.95, 1.02]),
    "gpipe": (80.0, 120.0, 0.9, [0.85, 0.95]),
  }.items():
    slack[name], slack[f"{name}_stragglers"] = pair(*args)
  write(tmp_path, "pipeline_slack/slack.json", slack)
  rows = {r["comparison"].split(" (each")[0]: r for r in ledger_dsp.straggler_rows(str(tmp_path))}
  d1 = rows["DSP as published: delay 1, links with slack (the runtime's default)"]
  assert d1["claim"] == "stragglers" and d1["slowdown_ratio"] == pytest.approx(1.5)
  assert d1["verdict"].startswith("not reproduced (less robust than model-parallel BP (no pipelining))")
  d2 = rows["DSP, delay 2, links with slack"]
  assert d2["verdict"].startswith("reproduced; above model-parallel BP (no pipelining), GPipe (M=4)")
  assert rows["DSP, delay 2, lockstep links"]["verdict"].startswith(
    "inconclusive (ranges overlap model-parallel BP (no pipelining), GPipe (M=4)); ranges over"
  )
  assert rows["DSP, delay 1, lockstep links"]["ours"] == "not measured"
  assert rows["GPipe (M=4)"]["claim"] == "stragglers (context)"


def test_the_real_results_give_every_claim_a_row(tmp_path):
  out = ledger_dsp.ledger(os.path.join(ROOT, "results"), str(tmp_path), 0.92)
  rows = [r for part in out["rows"].values() for r in part]
  for claim in ledger_dsp.CLAIMS:
    own = [r for r in rows if r["claim"] == claim]
    assert own, claim
    assert all(r["ours"] and r["verdict"] for r in own)
  assert {r["comparison"] for r in out["rows"]["speedup"] if r["claim"] == "speedup"} == {
    "DSP as published vs BP, one process on both cores",
    "DSP as published vs GPipe (M=4)",
    "DSP as published vs DDG",
    "DSP as published vs Features Replay",
  }
  assert all(r["n"] == 3 and "fewer than the ledger's 5" in r["verdict"] for r in out["rows"]["speedup"])
  md = open(tmp_path / "dsp_claims.md").read()
  assert all(text in md for text in ledger_dsp.CLAIMS.values())
  assert md.count("numerics: ") == 5
  json.loads(open(tmp_path / "dsp_claims.json").read(), parse_constant=lambda c: pytest.fail(c))

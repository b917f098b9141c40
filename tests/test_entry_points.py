"""Every benchmark's run() in-process at tiny sizes, and one short end-to-end run of every reproduction
entry point (flax-examples style; those start a process and are marked slow, as are the benchmarks whose
tiny run still takes several seconds)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(module, *args, tmp_path):
  env = dict(os.environ, RIPPLES_JAX_CACHE=str(tmp_path / "cache"))
  out = subprocess.run(
    [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def positive(cells) -> bool:
  """Every cell a finite positive number (a trailing 'x' or '%' allowed)."""
  values = [float(str(c).rstrip("x%").replace(",", "")) for c in cells]
  return all(math.isfinite(v) and v > 0 for v in values)


# -- benchmarks, in-process --------------------------------------------------------------------------


def test_bench_collectives():
  from benchmarks import bench_collectives

  table = bench_collectives.run(sizes=(1024,), reps=2)
  layouts = bench_collectives.schedule_layouts(8)
  assert table.column("layout") == list(layouts) + ["(switch over all layouts)"]
  rows = table.rows[:-1]
  assert positive(r[table.header.index("ratio")] for r in rows)
  assert positive(r[table.header.index("switched ratio")] for r in rows)
  assert positive(table.column("compile s"))
  assert "| 1K | gg_intra | 4 |" in str(table) and "| 1K | hypercube2 | 2 |" in str(table)


@pytest.mark.slow  # a benchmark's run at tiny sizes: seconds of timing loops
@pytest.mark.nightly
def test_bench_engine():
  from benchmarks import bench_engine

  table = bench_engine.run(cases=("cnn1d/mnist1d",), batch_size=4, reps=2)
  assert table.column("step") == ["dp", "allreduce", "ripples_static", "ripples_hypercube"]
  ratios = table.column("ratio to DP step")
  assert ratios[0] == "1.000" and positive(ratios) and positive(table.column("median ms"))


def test_bench_timeline():
  from benchmarks import bench_timeline
  from ripples_jax.algorithms import names

  table = bench_timeline.run(workers=(4,), steps=20)
  assert table.column("algorithm") == list(names()) and set(table.column("workers")) == {4}
  assert all(e >= 4 * 20 for e in table.column("events"))  # at least one event per step
  assert positive(table.column("clock events/s")) and positive(table.column("packing events/s"))


@pytest.mark.slow  # a benchmark's run at tiny sizes: seconds of timing loops
@pytest.mark.nightly
def test_bench_dsp():
  from benchmarks import bench_dsp

  table = bench_dsp.run(cases=("cnn1d/mnist1d",), stage_counts=(2,), batch_size=8, reps=2)
  [row] = table.rows
  assert row[:2] == ["cnn1d/mnist1d", 2]
  assert positive(row[2:])
  assert float(table.column("DSP equal, fused")[0]) == pytest.approx(2.0)  # K, without a bubble


@pytest.mark.slow  # a benchmark's run at tiny sizes: seconds of timing loops
@pytest.mark.nightly
def test_bench_checkpoint():
  from benchmarks import bench_checkpoint

  table = bench_checkpoint.run(reps=1, steps=8)
  [row] = table.rows
  assert row[:5] == ["ripples_static", "spmd", 8, 2, 4]
  assert positive(row[5:7]) and math.isfinite(float(row[7].rstrip("%")))


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_runtime(tmp_path):
  from benchmarks import bench_runtime

  table = bench_runtime.run(
    str(tmp_path / "runtime"),
    num_processes=2,
    slowdowns=(1.0,),
    algorithms=("allreduce", "ripples_smart"),
    steps=10,
    step_time=0.02,
    target=0.05,
    extra_args=["--config.schedule.group_size=2"],
  )
  assert table.column("algorithm") == ["allreduce", "ripples_smart"]
  assert table.column("vs All-Reduce")[0] == "1.00x" and positive(table.column("worker-steps/s"))
  for f in ("table.md", "accuracy_vs_time.png"):
    assert (tmp_path / "runtime" / f).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_pipeline(tmp_path):
  out_json = tmp_path / "k2.json"
  rows = ("bp_model_parallel", "dsp_weight_stash", "gpipe", "pipedream")
  out = run(
    "benchmarks.pipeline",
    "--num_stages=2",
    "--iterations=8",
    "--reps=2",
    "--bp_reps=2",
    "--model=cnn1d",
    "--input_shape=40,1",
    "--variants=" + ",".join(rows),
    "--slowdowns=2",
    f"--json_out={out_json}",
    tmp_path=tmp_path,
  )
  got = json.loads(out_json.read_text())
  assert set(got) == {
    "best_bp",
    "unstable",
    "ceiling_vs_best_bp",
    "bp_variants_ms",
    "setting",
    "_stragglers",
    *rows,
  }
  assert got["best_bp"]["variant"] in got["bp_variants_ms"] and len(got["bp_variants_ms"]["bp_pinned"]) == 2
  # Each ratio is paired with its repetition's best BP; the median lies within the spread.
  for name in rows:
    r = got[name]
    its, best = r["measured_iteration_s"]["all"], got["bp_variants_ms"][got["best_bp"]["variant"]]
    assert len(its) == 2
    want = sorted(b / 1e3 / i for b, i in zip(best, its))
    assert r["measured_speedup_vs_best_bp"]["min"] == pytest.approx(want[0])
    assert r["measured_speedup_vs_best_bp"]["max"] == pytest.approx(want[-1])
    assert 0 < r["tick_efficiency"]["median"] and len(r["stored_bytes"]) == 2
  for name in ("dsp_weight_stash", "gpipe", "pipedream"):  # predicted from model-parallel BP's calls
    assert "prediction_error" in got[name] and got[name]["predicted_from_bp_s"]["median"] > 0
  assert "weight stashing on DSP's schedule" in got["dsp_weight_stash"]["label"]
  # the stash variant: the middle stage keeps its vjp residuals (S_0 = 2 ticks of them), no input ring
  assert got["dsp_weight_stash"]["stored_bytes"][0]["residuals"] > 0
  assert got["dsp_weight_stash"]["stored_bytes"][0]["inputs"] == 0
  assert got["gpipe"]["stored_bytes"][0]["micro_boundaries"] > 0
  assert set(got["_stragglers"]["2.0"]["iteration_s"]) == {
    "bp_single_process",
    "bp_model_parallel",
    "gpipe",
    "dsp",
    "dsp_weight_stash",
  }
  assert "| dsp_weight_stash | weight stashing on DSP's schedule" in out
  # --ablate on the per-process placement: the stage processes inherit the setting; the ratio is of
  # the row's time per iteration.
  args = ["--num_stages=2", "--iterations=8", "--bp_reps=2", "--model=cnn1d", "--input_shape=40,1"]
  check_ablation(args, out_json, tmp_path)


def check_ablation(args, out_json, tmp_path):
  """benchmarks.pipeline --ablate=threads, once: whole processes with and without the setting, the
  ratio per row (DSP's and best BP's)."""
  run(
    "benchmarks.pipeline",
    *args,
    "--variants=dsp",
    "--ablate=threads",
    "--ablate_rounds=1",
    f"--json_out={out_json}",
    tmp_path=tmp_path,
  )
  got = json.loads(out_json.read_text())["ablations"]["threads"]
  assert set(got) == {"best_bp", "dsp"} and got["dsp"]["median"] > 0 and len(got["dsp"]["all"]) == 1


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_sim_scale(tmp_path):
  out_json, png = tmp_path / "scale.json", tmp_path / "scale.png"
  run(
    "benchmarks.bench_sim_scale",
    "--workers=4,8",
    "--steps=2",
    "--per_worker=20",
    "--malloc=tuned,default",
    f"--json_out={out_json}",
    f"--plot={png}",
    tmp_path=tmp_path,
  )
  rows = json.loads(out_json.read_text())["rows"]
  assert [(r["workers"], r["malloc"]) for r in rows] == [
    (4, "tuned"),
    (4, "default"),
    (8, "default"),
    (8, "tuned"),
  ]
  assert png.stat().st_size > 0
  # The allocator changes no number a run computes.
  assert rows[0]["final_test_accuracy"] == rows[1]["final_test_accuracy"]
  assert rows[2]["final_test_accuracy"] == rows[3]["final_test_accuracy"]
  for r in rows:
    assert r["wall_s"] > 0 and r["peak_rss_gb"] > 0 and r["events"] > 0 and r["compiles"] > 0
    assert r["cost_per_worker_step_ms"] == pytest.approx(1e3 * r["wall_s"] / (r["workers"] * 2))
    assert r["train_examples_per_worker"] >= 20


# -- reproductions, one process each -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_slack(tmp_path):
  """Two rows of the slack benchmark, once: lockstep and slack at link delay 2, and their ratio."""
  out = tmp_path / "slack.json"
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.bench_slack",
      "--rows=dsp_d2_slack,dsp_d2_lockstep",
      "--reps=1",
      "--iterations=8",
      f"--json_out={out}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(out.read_text())
  assert got["dsp_d2_slack"]["iteration_ms"] > 0 and 0 < got["dsp_d2_lockstep"]["tick_efficiency"] <= 1.5
  assert got["slack_speedup_d2"]["median"] > 0


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_pipeline_on_devices(tmp_path):
  """benchmarks.pipeline --placement=devices, one repetition of two rows: the issue's keys per row."""
  out_json = tmp_path / "dev.json"
  rows = ("dsp", "pipedream_chunks4", "gpipe")
  args = ["--placement=devices", "--model=cnn1d", "--input_shape=40,1", "--iterations=8", "--reps=1"]
  args += ["--ticks=3", "--bp_reps=2", "--variants=" + ",".join(rows), f"--json_out={out_json}"]
  run("benchmarks.pipeline", *args, tmp_path=tmp_path)
  got = json.loads(out_json.read_text())
  assert got["setting"]["placement"] == "devices" and got["best_bp"]["variant"] in got["bp_variants_ms"]
  for name in rows:
    r = got[name]
    assert r["measured_speedup_vs_best_bp"]["median"] > 0 and r["ceiling_vs_best_bp"]["median"] > 0
    M, K, cores = got["setting"]["microbatches"] if name == "gpipe" else 1, 2, got["setting"]["cores"]
    work = [f + b for f, b in zip(r["stage_forward_all_s"], r["stage_backward_all_s"])]
    one = [f + b for f, b in zip(r["stage_forward_s"], r["stage_backward_s"])]
    slots = M + K - 1 if name == "gpipe" else 1  # GPipe: M + K - 1 micro-batch slots a flush
    assert r["ceiling_s"] == pytest.approx(max(slots * max(work), M * sum(one) / cores))
    assert r["one_core_per_stage_s"] > 0
    gap = r["gap_s"]
    assert gap["total"] == pytest.approx(gap["dispatch"] + gap["transfers"] + gap["rest"])
  check_ablation(args[:-2], out_json, tmp_path)  # --ablate on the devices


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_devices(tmp_path):
  """One row of the devices benchmark, once: one_device, devices and one per_process launch."""
  out = tmp_path / "ticks.json"
  args = ["--models=cnn1d", "--methods=dsp", "--reps=1", "--ticks=4", "--launches=1", f"--json_out={out}"]
  run("benchmarks.bench_devices", *args, tmp_path=tmp_path)
  row = json.loads(out.read_text())["rows"]["cnn1d/dsp"]
  assert row["devices"]["median"] > 0 and row["per_process"]["median"] > 0
  assert row["devices_over_per_process"] == row["devices"]["median"] / row["per_process"]["median"]


@pytest.mark.slow
@pytest.mark.nightly
def test_reproduce_ripples(tmp_path):
  out_dir = tmp_path / "rep"
  out = run(
    "experiments.reproduce_ripples",
    "--workers=4",
    "--steps=4",
    "--algorithms=allreduce,ripples_smart",
    "--target_accuracy=0.05",
    f"--out_dir={out_dir}",
    tmp_path=tmp_path,
  )
  assert "one worker 5x slower | ripples_smart" in out
  for f in ("table.md", "accuracy_vs_time.png", "gantt.png"):
    assert (out_dir / f).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.nightly
def test_reproduce_dsp(tmp_path):
  out_dir = tmp_path / "dsp"
  out = run(
    "experiments.reproduce_dsp",
    "--datasets=synthetic",
    "--stages=2",
    "--methods=bp,dsp",
    "--epochs=1",
    "--sweep_epochs=1",
    "--sweep_delays=0,1",
    "--sweep_lrs=0.05",
    f"--out_dir={out_dir}",
    tmp_path=tmp_path,
  )
  assert "| synthetic | 2 | dsp |" in out and "stage 1 slowed 3x" in out
  for f in ("table.md", "accuracy_vs_epoch.png", "accuracy_vs_modeled_time.png", "staleness_lr_sweep.png"):
    assert (out_dir / f).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.nightly
def test_dsp_accuracy_grid(tmp_path):
  out_dir = tmp_path / "acc"
  run(
    "experiments.dsp_accuracy",
    "--epochs=1",
    "--lrs=0.02,0.05",
    "--seeds=0,1",
    "--methods=bp,dsp",
    "--stage_counts=2",
    f"--out_dir={out_dir}",
    f"--run_dir={tmp_path / 'runs'}",
    tmp_path=tmp_path,
  )
  runs = json.loads((out_dir / "runs.json").read_text())
  assert len(runs) == 2 * 2 * 2  # methods x lrs x seeds
  assert all(0 < r["final_val_accuracy"] <= 1 for r in runs.values())
  table = json.loads((out_dir / "table.json").read_text())
  assert "| 2 | dsp |" in (out_dir / "table.md").read_text() and table["selected_on"] == "validation"
  assert (out_dir / "lr_grid.png").stat().st_size > 0
  # The time-to-accuracy runs read that table: each row at its chosen lr, one seed, in the runtime.
  tta = tmp_path / "tta"
  run(
    "experiments.dsp_time_to_accuracy",
    f"--grid={out_dir / 'table.json'}",
    "--methods=dsp",
    "--seeds=0",
    "--targets=0.1,1.0",
    "--eval_every=5",
    f"--out_dir={tta}",
    tmp_path=tmp_path,
  )
  t = json.loads((tta / "table.json").read_text())["results"]
  assert t["dsp"]["lr"] == table["results"]["K2_dsp"]["best_lr"]
  assert t["dsp"]["0.1"]["reached"] == 1 and t["dsp"]["1"]["reached"] == 0
  assert (tta / "curves.png").stat().st_size > 0


def _grid_run(val, test):
  return {
    "epochs": 1,
    "diverged": False,
    "final_val_accuracy": val,
    "final_test_accuracy": test,
    "final_train_loss": 0.1,
    "final_test_loss": 0.2,
  }


def test_dsp_accuracy_chooses_the_step_size_on_validation_and_reports_test():
  from experiments import dsp_accuracy

  # lr 0.1 is best on validation, lr 0.2 on test: the table must take 0.1 and report its test accuracy.
  runs = {}
  for name in ("bp", "dsp"):
    for lr, (val, test) in {0.1: (0.9, 0.7), 0.2: (0.8, 0.95)}.items():
      for seed in (0, 1):
        runs[dsp_accuracy._run_name(2, name, lr, seed)] = _grid_run(val, test + 0.01 * seed)
  out = dsp_accuracy.summarise(runs, (2,), ("bp", "dsp"), (0.1, 0.2), (0, 1), 1)
  e = out["K2_dsp"]
  assert e["best_lr"] == 0.1 and e["best_lr_on_test"] == 0.2
  assert e["best"]["mean_test_accuracy"] == pytest.approx(0.705)
  assert e["best"]["mean_val_accuracy"] == pytest.approx(0.9)


def test_time_to_accuracy_censors_misses_and_pairs_by_seed():
  from experiments import dsp_time_to_accuracy as tta

  ref = tta.REFERENCE
  runs = {
    f"{ref}_seed0": {"lr": 0.1, "curve": [[1, 0.5], [2, 0.9]], "whole_s": 3, "final_test_accuracy": 0.9},
    f"{ref}_seed1": {"lr": 0.1, "curve": [[1, 0.8], [4, 0.9]], "whole_s": 5, "final_test_accuracy": 0.9},
    "dsp_seed0": {"lr": 0.05, "curve": [[1, 0.85], [3, 0.95]], "whole_s": 3, "final_test_accuracy": 0.95},
    "dsp_seed1": {"lr": 0.05, "curve": [[1, 0.5], [6, 0.7]], "whole_s": 8, "final_test_accuracy": 0.7},
  }
  assert tta.time_to([[1, 0.5], [2, 0.9]], 0.9) == 2 and tta.time_to([[1, 0.5]], 0.9) is None
  s = tta.summarise(runs, [ref, "dsp"], [0, 1], [0.8, 0.9])["dsp"]
  # 0.8: seed 0 at 1 s (BP 2 s: 2x), seed 1 never: censored at its whole run, 8 s (BP 1 s: 0.125x).
  assert s["0.8"]["reached"] == 1 and s["0.8"]["of"] == 2
  assert s["0.8"]["seconds"] == {"median": 4.5, "min": 1.0, "max": 8.0}
  assert s["0.8"]["speedup_vs_bp_single_process"] == {"median": 1.0625, "min": 0.125, "max": 2.0}
  assert s["0.9"]["speedup_vs_bp_single_process"]["max"] == pytest.approx(2 / 3)


@pytest.mark.slow
@pytest.mark.nightly
def test_reproduce_regenerates_a_step_with_its_provenance(tmp_path):
  results = tmp_path / "results"
  run(
    "experiments.reproduce",
    "--steps=spectral",
    f"--results={results}",
    f"--work={tmp_path / 'work'}",
    tmp_path=tmp_path,
  )
  for f in ("table.md", "spectral_gap.png", "provenance.json", "stdout.txt"):
    assert (results / "spectral" / f).exists()
  prov = json.loads((results / "spectral" / "provenance.json").read_text())
  assert prov["command"].startswith("python -m experiments.spectral") and prov["machine"]["cpus"]
  assert "| spectral |" in (results / "index.md").read_text()


def test_spectral_gap_matches_the_closed_form():
  from ripples_jax.analysis import spectral_table

  n = 16
  table = spectral_table(n, samples=400)
  for g in (2, 4, 8):
    # One random group of g: E[W] has diagonal 1 - (g - 1)/n and off-diagonal (g - 1)/(n (n - 1)).
    exact = 1 - ((1 - (g - 1) / n) - (g - 1) / (n * (n - 1)))
    assert abs(table["random GG (one group per round)"][g] - exact) < 0.01
    # A random partition into groups of g: diagonal 1/g, off-diagonal (g - 1)/(g (n - 1)).
    exact = 1 - (1 / g - (g - 1) / (g * (n - 1)))
    assert abs(table["group division (a partition per round)"][g] - exact) < 0.01
  assert table["hypercube (radix g)"][4] == pytest.approx(0.5)


def test_the_passive_wait_figure_counts_only_workers_that_can_wait():
  """AD-PSGD with a slow passive worker 0: the figure is the active workers' wait; the other passive
  worker (2) serves from a thread and never waits, and averaging it in would halve the figure."""
  from benchmarks import bench_online

  assert bench_online.waiting_workers(4, slow=(0,)) == [1, 3]
  assert bench_online.waiting_workers(6, slow=(3,)) == [1, 5]
  traces = {w: [{"k": "step", "t0": 0.0, "t1": 10.0}] for w in range(4)}
  r = {"traces": traces, "wait_time": [0.0, 2.0, 0.0, 2.0]}
  assert bench_online.wait_fraction(r, bench_online.waiting_workers(4, slow=(0,))) == pytest.approx(0.2)


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_preduce_pairs_are_exact_and_bounded(tmp_path):
  from benchmarks import bench_preduce

  n = 5
  out = bench_preduce.run(str(tmp_path), num_processes=n, rounds=16, size=1000)
  for mode in bench_preduce.MODES:
    assert out[mode]["members_agree_bitwise"] and out[mode]["max_abs_error"] < 1e-6, out
  assert out["pairs"]["compiles_max"] <= n - 1  # compiled on first use: at most one per partner
  assert out["pairs_ahead"]["compiles_max"] == n - 1 and out["pairs_ahead"]["compiles_second_half"] == 0
  assert out["group"]["compiles_max"] > n - 1  # 5 workers in groups of 3 and 2: more member sets than pairs


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_authority_keeps_the_store_and_its_state_bounded(tmp_path):
  from benchmarks import bench_authority

  n = 6
  row = bench_authority.run(
    n, steps=600, step_time=0.0, algorithm="ripples_random", clients=1, out_dir=str(tmp_path)
  )
  assert row["worker_steps"] >= 600 and row["requests"] > 0 and row["requests_per_s"] > 0
  assert row["store_keys_after"] <= 2 * n  # start reports and final batches: no request, no read batch
  assert row["service_state"] == {
    **row["service_state"],
    "entries_kept": 0,
    "groups_kept": 0,
    "snapshots_kept": 0,
  }
  assert row["service_state"]["groups_made"] > 0


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_scale_measures_and_predicts_a_run(tmp_path):
  from benchmarks import bench_scale

  r = bench_scale.measured(str(tmp_path), "tiny", 2, "ripples_smart", 12, 0.05)
  row = bench_scale.setup_row(r, 2)
  assert row["group_compiles_max"] <= 1 and 0 < row["cpu_use"] <= 1.5 and row["authority"]["requests"] > 0
  p = bench_scale.predicted(r, 2, "ripples_smart")
  assert p["predicted"] > 0 and abs(p["error"]) < 1.0 and p["fed"]["service_ms"] > 0


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_online(tmp_path):
  from benchmarks import bench_online

  out = bench_online.run(
    str(tmp_path / "online"), n=2, steps=8, ar_steps=4, step_time=0.02, scenarios=("slow2",)
  )
  assert set(out["ratios"]) == {"worker 1 2x slower/ripples_smart", "worker 1 2x slower/adpsgd"}
  assert all(r["measured"] > 0 and r["predicted"] > 0 for r in out["ratios"].values())
  assert (tmp_path / "online" / "table.md").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.nightly
def test_ledger(tmp_path):
  from experiments import ledger_claims, ledger_throughput, ledger_tta, ledger_verdicts

  out = ledger_throughput.run(str(tmp_path), seeds=1, steps=20)
  assert len(out["claims"]) == len(ledger_claims.CLAIMS) and len(out["adpsgd_cost"]) == 6
  assert all(c["throughput_light"][0] > 0 for c in out["claims"])
  got = ledger_tta.tta(
    str(tmp_path),
    seeds=1,
    steps=4,
    target=0.0,
    scenarios=("homogeneous",),
    algorithms=("allreduce", "ripples_smart"),
    grid=(0.05, 0.1),
  )
  assert got["homogeneous"]["ripples_smart"]["steps"] == [1]  # target 0: reached at the first step
  assert (tmp_path / "tta.md").stat().st_size > 0 and (tmp_path / "tta_homogeneous.png").exists()
  # Tuned on validation at seeds apart from the reported ones: every grid point's runs are kept.
  runs = json.loads((tmp_path / "runs.json").read_text())
  assert len(runs) == 2 * 2 * len(ledger_tta.TUNE_SEEDS) + 2  # tuning runs, then the two reported
  lr = got["homogeneous"]["ripples_smart"]["lr"]
  curve = runs[ledger_tta.run_key("homogeneous", "ripples_smart", lr, 0, 4)]["curve"]
  assert len(curve["time"]) == 4 and all(0 <= v <= 1 for v in curve["val"] + curve["worker"])
  table = ledger_verdicts.verdict_table(out, {"scenarios": got}, 0.0)
  assert len(table.rows) == len(ledger_claims.CLAIMS) and all(r[-1] for r in table.rows)


@pytest.mark.slow
@pytest.mark.nightly
def test_ledger_sensitivity(tmp_path):
  """Every claim at every point of every sweep; the base point of each sweep is the VGG-16 clock
  itself, so its ratio equals the ledger's heavy-setting throughput ratio exactly."""
  from experiments import ledger_claims, ledger_throughput

  out = ledger_throughput.sensitivity(str(tmp_path), seeds=1, steps=10)
  assert set(out) == set(ledger_throughput.SWEEPS)
  for sweep, per in out.items():
    assert list(per) == [c[0] for c in ledger_claims.CLAIMS]
    assert all(
      [p[0] for p in points] == [p[0] for p in ledger_throughput.SWEEPS[sweep]] for points in per.values()
    )
  claim, _, _, slowdown, (a, b) = ledger_claims.CLAIMS[-1]
  base = ledger_throughput.ratio(a, b, "heavy", slowdown, seeds=1, steps=10)[0]
  assert out["bandwidth"][claim][2][1] == base and out["model"][claim][2][1] == base
  assert out["overlap"][claim][0][1] == base  # overlap 0 is the base clock
  # Hiding communication behind compute removes Smart GG's only cost beyond AD-PSGD's (whose average
  # already runs beside its compute): the ratio rises toward parity with overlap.
  ad = out["overlap"]["homogeneous vs AD-PSGD"]
  assert ad[0][1] < ad[-1][1] <= 1.0
  # Slower links cost All-Reduce more than Smart GG's groups of 3: the homogeneous ratio falls with them.
  homo = out["bandwidth"]["homogeneous vs All-Reduce"]
  assert homo[0][1] > homo[-1][1]
  assert (tmp_path / "sensitivity.png").stat().st_size > 0 and "| claim |" in (
    tmp_path / "sensitivity.md"
  ).read_text()


def test_ledger_dsp_end_to_end(tmp_path):
  """The DSP ledger from the stored results, as its command line runs it."""
  run("experiments.ledger_dsp", "--results=results", f"--out={tmp_path}", tmp_path=tmp_path)
  got = json.loads((tmp_path / "dsp_claims.json").read_text())
  text = (tmp_path / "dsp_claims.md").read_text()
  assert got and "numerics:" in text and "(2) no accuracy loss against BP" in text


@pytest.mark.slow
@pytest.mark.nightly
def test_ledger_sync_overhead(tmp_path):
  """Wait + comm over worker-steps, from the clock's own intervals; All-Reduce, which computes in
  lockstep and then averages everything, pays more per step than Smart GG's groups on the VGG-16 clock."""
  from experiments import ledger_claims, ledger_throughput

  out = ledger_throughput.sync_overhead(str(tmp_path), seeds=1, steps=10)
  assert list(out) == list(ledger_claims.OVERHEAD_SETTINGS) and list(out["heavy"]) == list(
    ledger_throughput.OVERHEAD_ALGORITHMS
  )
  for a in ("allreduce", "adpsgd"):
    _, trace = ledger_throughput.throughput(a, "heavy", 1.0, seed=0, steps=10)
    split = trace.time_split()
    assert out["heavy"][a][0] == (split["wait"].sum() + split["comm"].sum()) / trace.worker_steps.sum()
  assert split["comm"].sum() == 0  # AD-PSGD's averages hide behind its compute on this clock: no overhead
  assert out["heavy"]["allreduce"][0] > out["heavy"]["ripples_smart"][0] > 0
  assert "over Smart GG's" in (tmp_path / "sync_overhead.md").read_text()


def fake_run(path, algorithm, executor, points, target=0.8):
  """A finished run's folder: summary.json, config.json and metrics.jsonl with (time, accuracy) evals."""
  os.makedirs(path)
  summary = {
    "algorithm": algorithm,
    "executor": executor,
    "num_workers": 4,
    "num_steps": 10 * len(points),
    "final_test_accuracy": points[-1][1],
    "time": points[-1][0],
  }
  json.dump(summary, open(os.path.join(path, "summary.json"), "w"))
  json.dump({"target_accuracy": target}, open(os.path.join(path, "config.json"), "w"))
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for i, (t, acc) in enumerate(points):
      f.write(json.dumps({"step": 10 * i, "time": t}) + "\n")  # a log record: no evaluation
      f.write(json.dumps({"step": 10 * i + 5, "time": t, "test_accuracy": acc}) + "\n")


def test_compare_reads_curves_and_times_to_target(tmp_path):
  from ripples_jax import analysis

  fake_run(tmp_path / "a", "ripples_smart", "sim", [(1.0, 0.5), (2.0, 0.85), (3.0, 0.9)])
  fake_run(tmp_path / "b", "allreduce", "sim", [(4.0, 0.81)])
  fake_run(tmp_path / "c", "adpsgd", "async", [(1.0, 0.1), (2.0, 0.2)])
  runs = [analysis.read_run(str(tmp_path / d)) for d in "abc"]
  assert [r["curve"] for r in runs][0] == [(1.0, 0.5), (2.0, 0.85), (3.0, 0.9)]
  assert [r["time_to_target"] for r in runs] == [2.0, 4.0, None]
  rows = analysis.compare_table(runs).splitlines()[2:]
  assert rows[0].endswith("| 3 | 80% | 2.00 virtual s |")
  assert rows[1].endswith("| <= 4.00 virtual s (at the first evaluation) |")  # no crossing seen
  assert rows[2].endswith("| 2 | 80% | - |") and "2.00 s" in rows[2]  # wall seconds
  analysis.compare_plot(runs, str(tmp_path / "cmp.png"))
  assert os.path.getsize(tmp_path / "cmp.png") > 10_000


@pytest.mark.slow
@pytest.mark.nightly
def test_compare_entry_point(tmp_path):
  fake_run(tmp_path / "a", "ripples_smart", "sim", [(1.0, 0.5), (2.0, 0.85)])
  out = run("experiments.compare", str(tmp_path / "a"), f"--plot={tmp_path / 'c.png'}", tmp_path=tmp_path)
  assert "| ripples_smart | 4 | 20 | 85.00% |" in out and os.path.exists(tmp_path / "c.png")
  bad = subprocess.run(
    [sys.executable, "-m", "experiments.compare", str(tmp_path / "missing")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1, bad


def test_gg_scale_gap_is_the_dense_second_eigenvalue():
  import numpy as np

  from experiments import gg_scale
  from ripples_jax import collectives, timeline

  rng = np.random.default_rng(0)
  n = 12
  groups = [tuple(rng.choice(n, int(rng.integers(2, 5)), replace=False)) for _ in range(40)]
  events = [(0.0, timeline.AVG, g, None) for g in groups] + [(0.0, timeline.APPLY, 3, 3)]
  got = gg_scale.sweep_gap(events, n)
  m = np.mean([collectives.mixing_matrix([g], n) for g in groups], axis=0)
  lam2 = np.sort(np.linalg.eigvalsh(m))[-2]
  size = np.mean([len(g) for g in groups])
  assert got["groups"] == 40 and got["mean_group_size"] == size
  assert got["gap_per_event"] == pytest.approx(1 - lam2, abs=1e-9)
  assert got["gap_per_sweep"] == pytest.approx(n / size * (1 - lam2), abs=1e-9)
  # Groups that never join {0..5} to {6..11}: disconnected, so the gap is 0 (never below it).
  split = [(0, 1), (2, 3, 4), (1, 5, 2), (6, 7), (8, 9, 10), (7, 11, 8), (0, 3), (6, 9)] * 3
  cut = gg_scale.sweep_gap([(0.0, timeline.AVG, g, None) for g in split], n)
  assert 0.0 <= cut["gap_per_sweep"] < 1e-9 and 0.0 <= cut["gap_per_event"] < 1e-9


@pytest.mark.slow
@pytest.mark.nightly
def test_gg_scale_end_to_end(tmp_path):
  out_dir = tmp_path / "gg"
  run(
    "experiments.gg_scale",
    "--workers=8",
    "--seeds=0",
    "--steps=4",
    "--eval_every=2",
    "--target=0.05",
    "--algorithms=allreduce,ripples_smart,moshpit",
    f"--out_dir={out_dir}",
    tmp_path=tmp_path,
  )
  t = json.loads((out_dir / "table.json").read_text())["results"]
  assert t["n8_allreduce"]["speedup_vs_allreduce"]["median"] == 1.0
  for a in ("ripples_smart", "moshpit"):
    assert t[f"n8_{a}"]["reached"] == 1 and 0 <= t[f"n8_{a}"]["gap_per_sweep"]["median"] <= 1
  assert (out_dir / "gg_scale.png").stat().st_size > 0


def test_bench_sim_profile_names_programs_and_counts_ops_once(tmp_path):
  import glob

  import jax
  import jax.numpy as jnp

  from benchmarks import bench_sim_profile

  def my_prog(x):
    return jnp.tanh(x @ x).sum()

  f, x = jax.jit(my_prog), jnp.ones((128, 128))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(3):
      f(x).block_until_ready()
  (path,) = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
  got = bench_sim_profile.summarise_trace(path)
  assert got["programs"]["jit_my_prog"] > 0 and got["xla_threads"] >= 1
  # Only the ops' own events, each under its program: the enclosing executor events are left out.
  assert all(k.split("/", 1)[0] in got["programs"] for k in got["xla"])
  assert not [k for k in got["xla"] if "ThunkExecutor" in k or "ThreadpoolListener" in k]
  assert sum(got["xla"].values()) == pytest.approx(sum(got["programs"].values()))


@pytest.mark.slow
@pytest.mark.nightly
def test_bench_hybrid_devices(tmp_path):
  """benchmarks.hybrid_devices, one seed of two runs: measured and predicted figures for each."""
  out_json = tmp_path / "h.json"
  args = ["--epochs=2", "--seeds=0", "--scenarios=5x device", "--pad_s=0.01", "--target=0.2"]
  args += [f"--workdir={tmp_path / 'runs'}", f"--json_out={out_json}", "--chosen=none"]
  run("benchmarks.hybrid_devices", *args, tmp_path=tmp_path)
  got = json.loads(out_json.read_text())
  assert {r["algorithm"] for r in got["runs"]} == {"ripples_smart", "allreduce"}
  for r in got["runs"]:
    assert r["end"] > 0 and r["predicted_end"] > 0 and r["tick_s"] >= 0.01
  assert "5x device" in got["speedup"]


def test_group_windows_counts_sets_repeats_and_components():
  from ripples_jax.analysis import group_windows

  groups = [(1.0, [0, 1, 2]), (2.0, (2, 1, 0)), (3.0, [3, 4]), (12.0, [0, 5]), (25.0, [1, 2])]
  first, second, empty = group_windows(groups, [(0, 10), (10, 20), (20, 25)], 6)
  # {0, 1, 2} twice (members in any order are one set), {3, 4}; worker 5 in no group: 3 components.
  assert first == {
    "window": (0, 10),
    "groups": 3,
    "distinct": 2,
    "top": (0, 1, 2),
    "top_count": 2,
    "components": 3,
  }
  assert (second["groups"], second["distinct"], second["top"], second["components"]) == (1, 1, (0, 5), 5)
  assert (empty["groups"], empty["top_count"], empty["components"]) == (0, 0, 6)  # [lo, hi): 25 is out


@pytest.mark.slow
def test_group_mix_shows_smart_gg_locking_while_a_worker_is_away(tmp_path):
  """One short run of the entry point on the killed scenario (worker 15 away from 10 s): before the
  death nearly every Smart GG group is new; with 15 live workers its groups repeat (the lock
  results/baselines/README.md names)."""
  out = run(
    "experiments.group_mix",
    "--scenario=worker killed and restarted, VGG-16 clock",
    "--steps=50",
    "--windows=0-10,14-20",
    tmp_path=tmp_path,
  )
  assert "leave 15 at 10.0 s" in out
  cells = [
    [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("|")
  ]
  rows = {c[0]: c for c in cells}
  before, during = rows["0-10"], rows["14-20"]
  assert int(before[2]) >= 0.8 * int(before[1])  # distinct sets against groups
  assert int(during[2]) <= 0.4 * int(during[1]) and int(during[4]) >= 10  # one set 10+ times
  assert before[5] == "1" and int(during[5]) > 2  # connected before; parted while worker 15 is away


def test_the_results_index_keeps_its_hand_written_columns(tmp_path):
  """experiments.reproduce --index_only: every column from provenance.json but each folder's status and
  how it was made, which a rewrite keeps (the repository's own index rewrites to itself); a new folder
  is current."""
  import json
  import shutil

  from experiments import reproduce

  shutil.copytree("results", tmp_path / "results", ignore=shutil.ignore_patterns("*.png", "*.npz", "*.jsonl"))
  before = (tmp_path / "results" / "index.md").read_text()
  reproduce.write_index(str(tmp_path / "results"))
  assert (tmp_path / "results" / "index.md").read_text() == before
  (tmp_path / "results" / "zz_new").mkdir()
  (tmp_path / "results" / "zz_new" / "provenance.json").write_text(json.dumps({"command": "python -m x"}))
  reproduce.write_index(str(tmp_path / "results"))
  _, rows = reproduce.read_index(str(tmp_path / "results" / "index.md"))
  assert rows["zz_new"]["status"] == "current" and rows["zz_new"]["command"] == "`python -m x`"
  assert rows["ledger"]["status"].startswith("superseded by ledger4")

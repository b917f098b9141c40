"""One short end-to-end run of every benchmark and reproduction entry point (flax-examples style)."""
import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(module, *args, tmp_path):
  env = dict(os.environ, RIPPLES_JAX_CACHE=str(tmp_path / "cache"))
  out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_bench_collectives(tmp_path):
  out = run("experiments.bench_collectives", "--sizes=1024", "--reps=2", tmp_path=tmp_path)
  assert "| 1K | gg_intra | 4 |" in out and "| 1K | hypercube2 | 2 |" in out


def test_bench_engine(tmp_path):
  out = run("experiments.bench_engine", "--cases=cnn1d/mnist1d", "--reps=2", "--batch_size=4",
            tmp_path=tmp_path)
  for step in ("dp", "allreduce", "ripples_static", "ripples_hypercube"):
    assert f"| {step} |" in out


def test_bench_timeline(tmp_path):
  out = run("experiments.bench_timeline", "--workers=4", "--steps=20", tmp_path=tmp_path)
  assert out.count("| 4 |") == 9  # every algorithm


def test_reproduce_ripples(tmp_path):
  out_dir = tmp_path / "rep"
  out = run("experiments.reproduce_ripples", "--workers=4", "--steps=4", "--algorithms=allreduce,ripples_smart",
            "--target_accuracy=0.05", f"--out_dir={out_dir}", tmp_path=tmp_path)
  assert "one worker 5x slower | ripples_smart" in out
  for f in ("table.md", "accuracy_vs_time.png", "gantt.png"):
    assert (out_dir / f).stat().st_size > 0


def test_bench_dsp(tmp_path):
  out = run("experiments.bench_dsp", "--cases=cnn1d/mnist1d", "--stages=2", "--reps=2", "--batch_size=8",
            tmp_path=tmp_path)
  assert "| cnn1d/mnist1d | 2 |" in out


def test_reproduce_dsp(tmp_path):
  out_dir = tmp_path / "dsp"
  out = run("experiments.reproduce_dsp", "--datasets=synthetic", "--stages=2", "--methods=bp,dsp", "--epochs=1",
            "--sweep_epochs=1", "--sweep_delays=0,1", "--sweep_lrs=0.05", f"--out_dir={out_dir}",
            tmp_path=tmp_path)
  assert "| synthetic | 2 | dsp |" in out and "stage 1 slowed 3x" in out
  for f in ("table.md", "accuracy_vs_epoch.png", "accuracy_vs_modeled_time.png", "staleness_lr_sweep.png"):
    assert (out_dir / f).stat().st_size > 0


def test_reproduce_regenerates_a_step_with_its_provenance(tmp_path):
  results = tmp_path / "results"
  run("experiments.reproduce", "--steps=spectral", f"--results={results}", f"--work={tmp_path / 'work'}",
      tmp_path=tmp_path)
  for f in ("table.md", "spectral_gap.png", "provenance.json", "stdout.txt"):
    assert (results / "spectral" / f).exists()
  prov = json.loads((results / "spectral" / "provenance.json").read_text())
  assert prov["command"].startswith("python -m experiments.spectral") and prov["machine"]["cpus"]
  assert "| spectral |" in (results / "index.md").read_text()


def test_bench_checkpoint(tmp_path):
  out = run("experiments.bench_checkpoint", "--reps=1", "--steps=8", tmp_path=tmp_path)
  assert "| ripples_static | spmd | 8 | 2 | 4 |" in out


def test_spectral_gap_matches_the_closed_form():
  from ripples_jax.reproduce import spectral_table
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

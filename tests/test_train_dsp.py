"""experiments.train_dsp end to end, and its config validation."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import dsp as dsp_config
from ripples_jax.config import ConfigError, validate_dsp_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize(
  "method",
  ["dsp", pytest.param("gpipe", marks=pytest.mark.nightly), pytest.param("dni", marks=pytest.mark.nightly)],
)
def test_entry_point_runs_and_writes_outputs(tmp_path, method):
  workdir = tmp_path / method
  env = dict(os.environ, RIPPLES_JAX_CACHE=str(tmp_path / "cache"))
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train_dsp",
      f"--config=configs/dsp.py:method={method},num_stages=2,dataset=synthetic,model=mlp,epochs=1",
      "--config.log_every=2",
      "--config.eval_every=4",
      "--config.batch_size=32",
      "--config.slowdown=3.0",
      "--config.straggler_stage=0",
      f"--workdir={workdir}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  table = out.stdout.splitlines()
  head = next(i for i, l in enumerate(table) if l.split()[:2] == ["method", "stages"])
  assert table[head + 2].split()[:2] == [method, "2"], out.stdout  # the result table's row
  summary = json.load(open(workdir / "summary.json"))
  assert summary["num_batches"] == 512 // 32
  assert 0 <= summary["final_test_accuracy"] <= 1 and summary["modeled_speedup_vs_bp"] > 0
  records = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  assert records[-1]["step"] == 16 and "test_accuracy" in records[-1]
  assert summary["straggler"]["slowed_iteration"] > 0
  assert json.load(open(workdir / "config.json"))["method"] == method


BAD = [
  (
    "method",
    "pipedream_2bw",
    "config.method: 'pipedream_2bw' is not allowed: one of bp, gpipe, 1f1b, zbh1, ddg, pipedream, pipemare, fr, dni, dsp",
  ),
  ("num_stages", 5, "config.num_stages: 5 is not allowed: cnn1d splits into at most 4 stages"),
  ("microbatches", 5, "config.microbatches: 5 is not allowed: a divisor of batch_size=64"),
  ("mode", "replay", "config.mode: 'replay' is not allowed: one of recompute, stash, fused, residuals"),
  (
    "mode",
    "fused",
    "config.mode: 'fused' is not allowed: recompute or stash unless placement=per_process "
    "(the fused call and the residual ring exist in the multi-process runtime)",
  ),
  ("delay", -1, "config.delay: -1 is not allowed: an integer number of ticks in [0, 64]"),
  ("chunks", 3, "config.chunks: 3 is not allowed: a divisor of batch_size=64"),
  ("slowdown", 0.5, "config.slowdown: 0.5 is not allowed: a factor >= 1"),
  (
    "checkpoint_every",
    130,
    "config.checkpoint_every: 130 is not allowed: a multiple of log_every=50 "
    "(checkpoints are taken at logged batches)",
  ),
  (
    "checkpoint_every",
    -1,
    "config.checkpoint_every: -1 is not allowed: an integer number of batches >= 0 (0: no checkpoints)",
  ),
  ("checkpoint_keep", 0, "config.checkpoint_keep: 0 is not allowed: a positive integer"),
  ("pipemare.ema_decay", 1.0, "config.pipemare.ema_decay: 1.0 is not allowed: a number in [0, 1)"),
  (
    "pipemare.lr_anneal",
    -1,
    "config.pipemare.lr_anneal: -1 is not allowed: an integer number of updates >= 0 (0: none)",
  ),
]


@pytest.mark.parametrize("key,value,message", BAD, ids=[k for k, _, _ in BAD])
def test_dsp_validation(key, value, message):
  config = dsp_config.get_config("method=gpipe" if key == "microbatches" else None)
  config.update_from_flattened_dict({key: value})
  with pytest.raises(ConfigError) as e:
    validate_dsp_config(config)
  assert str(e.value) == message


def test_dsp_refuses_several_processes():
  with pytest.raises(
    ConfigError,
    match="--jax_distributed: 2 processes are not allowed with "
    "placement=one_device: a pipeline runs inside one process",
  ):
    validate_dsp_config(dsp_config.get_config(), num_processes=2)


PER_PROCESS_BAD = [
  (
    {"num_stages": 4},
    "config.placement: 'per_process' is not allowed: one process per stage: num_stages=4 "
    "processes (python -m experiments.launch --num_processes=4 --module=experiments.train_dsp -- ...), this "
    "job has 2",
  ),
  (
    {"method": "dni"},
    "config.method: 'dni' is not allowed: one of bp, gpipe, ddg, pipedream, pipemare, fr, dsp with "
    "placement=per_process (DNI runs in one process: its step is a whole-model step, not a pipeline tick)",
  ),
  (
    {"method": "fr", "mode": "residuals"},
    "config.mode: 'residuals' is not allowed: recompute or stash for method=fr (the runtime picks its "
    "mode: the recompute ring; fused and residuals are for dsp)",
  ),
  (
    {"mode": "fused", "chunks": 4},
    "config.chunks: 4 is not allowed: 1 with mode=fused (its one call runs two batches)",
  ),
  (
    {"method": "gpipe", "chunks": 4},
    "config.chunks: 4 is not allowed: 1 with method=gpipe and placement=per_process (a whole-model "
    "step; GPipe's micro-batches are config.microbatches)",
  ),
  ({"mode": "residuals", "chunks": 3}, "config.chunks: 3 is not allowed: a divisor of batch_size=64"),
  (
    {"mode": "fused", "delay": 0},
    "config.mode: 'fused' is not allowed: recompute, stash or residuals with "
    "delay=0 (fusing needs a stored batch)",
  ),
]


@pytest.mark.parametrize("overrides,message", PER_PROCESS_BAD)
def test_per_process_validation(overrides, message):
  config = dsp_config.get_config()
  config.placement = "per_process"
  config.update(overrides)
  with pytest.raises(ConfigError) as e:
    validate_dsp_config(config, num_processes=2)
  assert str(e.value) == message


@pytest.mark.slow
def test_bad_stage_count_stops_before_compile(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train_dsp",
      "--config=configs/dsp.py:num_stages=9",
      f"--workdir={tmp_path / 'x'}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
    "error: config.num_stages: 9 is not allowed: cnn1d splits into at most 4 stages"
  )
  assert not (tmp_path / "x").exists()


@pytest.mark.slow  # in process, too long for the fast tier
def test_evaluations_come_at_eval_every_whatever_log_every(tmp_path):
  from ripples_jax import run

  config = dsp_config.get_config("method=dsp,num_stages=2,dataset=synthetic,model=mlp,epochs=1")
  config.log_every, config.eval_every, config.checkpoint_every = 6, 4, 0
  run.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  evals = [r["step"] for r in records if "test_accuracy" in r]
  n = records[-1]["step"]
  assert evals == sorted({*range(4, n + 1, 4), n}), evals
  assert {r["step"] for r in records} == {*range(6, n + 1, 6), *evals}


@pytest.mark.slow  # in process, too long for the fast tier
def test_validation_is_held_out_of_training_and_evaluated_beside_test(tmp_path):
  from ripples_jax import data as data_lib
  from ripples_jax import run
  from ripples_jax.pipeline import inputs as pipeline_inputs

  config = dsp_config.get_config("method=dsp,num_stages=2,dataset=synthetic,model=mlp,epochs=1")
  config.synthetic.num_train, config.validation_examples = 256, 64
  config.log_every = config.eval_every = 2
  config.checkpoint_every = 0
  p = pipeline_inputs.build_pipeline(config)
  full = data_lib.load_dataset("synthetic", seed=config.seed, **dict(config.synthetic))
  assert len(p.data["y_train"]) == 192 and p.num_batches == 192 // config.batch_size
  run.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  evals = [r for r in records if "test_accuracy" in r]
  assert evals and all("val_accuracy" in r and "val_loss" in r for r in evals)
  # The pipeline evaluates on exactly the held-out examples and trains on the rest.
  held = data_lib.hold_out(full, 64)
  assert np.array_equal(p.data["x_val"], held["x_val"]) and np.array_equal(p.data["x_train"], held["x_train"])


def test_the_single_process_clock_is_net_of_evaluation(tmp_path, monkeypatch):
  """An evaluation that takes 1000 (fake) seconds adds nothing to the records' training time, as in the
  per-process runtime."""
  import time as time_mod

  from ripples_jax import run
  from ripples_jax.pipeline import baselines
  from ripples_jax.pipeline import train as pipeline_train

  offset = [0.0]
  real = time_mod.perf_counter
  monkeypatch.setattr(pipeline_train.time, "perf_counter", lambda: real() + offset[0])
  make_eval = baselines.make_eval

  def slow_eval(stages):
    ev = make_eval(stages)

    def evaluate(*a):
      offset[0] += 1000.0  # the evaluation "takes" 1000 s
      return ev(*a)

    return evaluate

  monkeypatch.setattr(pipeline_train.baselines, "make_eval", slow_eval)
  config = dsp_config.get_config("method=dsp,num_stages=2,dataset=synthetic,model=mlp,epochs=1")
  config.log_every = config.eval_every = 2
  config.checkpoint_every = 0
  s = run.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert offset[0] >= 2000 and all(r["time"] < 500 for r in records) and s["time"] < 500

"""End-to-end: the entry point in a subprocess, an in-process run, and config validation."""

import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import default as default_config
from ripples_jax import run
from ripples_jax.config import ConfigError, validate_train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_entry_point(args, tmp_path):
  env = dict(os.environ, RIPPLES_JAX_CACHE=str(tmp_path / "cache"))
  return subprocess.run(
    [sys.executable, "-m", "experiments.train", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


@pytest.mark.slow
def test_entry_point_one_step(tmp_path):
  workdir = tmp_path / "run"
  out = run_entry_point(
    [
      "--config=configs/default.py:steps=1,dataset=synthetic,model=mlp",
      "--config.log_every=1",
      "--config.eval_every=1",
      f"--workdir={workdir}",
    ],
    tmp_path,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "ripples_static" in out.stdout and f"run files: {workdir}" in out.stdout
  config = json.load(open(workdir / "config.json"))
  assert config["algorithm"] == "ripples_static" and config["num_steps"] == 1
  records = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in records] == [1]
  assert {"step", "time", "train_loss", "test_accuracy", "consensus_distance"} <= set(records[0])
  assert glob.glob(str(workdir / "events.out.tfevents.*"))
  summary = json.load(open(workdir / "summary.json"))
  assert summary["worker_steps"] == [1] * 8
  assert summary["throughput"] > 0 and 0 <= summary["final_test_accuracy"] <= 1


@pytest.mark.slow
def test_bad_config_stops_before_compile_with_one_line(tmp_path):
  workdir = tmp_path / "bad"
  out = run_entry_point(["--config=configs/default.py:algorithm=gossip", f"--workdir={workdir}"], tmp_path)
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1] == (
    "error: config.algorithm: 'gossip' is not allowed: one of allreduce, ripples_static"
  )
  assert "Traceback" not in out.stderr
  assert not workdir.exists()  # nothing was created or compiled


BAD = [
  ("algorithm", "gossip", "config.algorithm: 'gossip' is not allowed: one of allreduce, ripples_static"),
  (
    "dataset",
    "imagenet",
    "config.dataset: 'imagenet' is not allowed: one of mnist1d, digits, cifar10, synthetic",
  ),
  (
    "model",
    "vit",
    "config.model: 'vit' is not allowed: one of mlp, mlp_gelu, cnn1d, cnn2d, resnet20, resnet56, rescnn",
  ),
  ("executor", "cluster", "config.executor: 'cluster' is not allowed: one of spmd, sim, async"),
  ("num_workers", 12, "config.num_workers: 12 is not allowed: at most the 8 devices or a multiple of 8"),
  ("num_workers", 0, "config.num_workers: 0 is not allowed: a positive integer"),
  ("optimizer.lr", 0.0, "config.optimizer.lr: 0.0 is not allowed: a finite number > 0"),
  ("optimizer.lr", -0.1, "config.optimizer.lr: -0.1 is not allowed: a finite number > 0"),
  (
    "optimizer.name",
    "lion",
    "config.optimizer.name: 'lion' is not allowed: one of sgd, momentum, nesterov, adam, adamw",
  ),
  ("optimizer.b1", 1.0, "config.optimizer.b1: 1.0 is not allowed: a number in [0, 1)"),
  ("optimizer.b2", -0.1, "config.optimizer.b2: -0.1 is not allowed: a number in [0, 1)"),
  ("optimizer.eps", 0.0, "config.optimizer.eps: 0.0 is not allowed: a finite number > 0"),
  (
    "schedule.workers_per_node",
    9,
    "config.schedule.workers_per_node: 9 is not allowed: an integer group size in [1, num_workers=8]",
  ),
  ("schedule.layout", "ring", "config.schedule.layout: 'ring' is not allowed: one of node, hypercube"),
  ("preduce_impl", "nccl", "config.preduce_impl: 'nccl' is not allowed: one of auto, collective, segment"),
  ("data_sharding", "dirichlet", "config.data_sharding: 'dirichlet' is not allowed: one of iid, noniid"),
  (
    "checkpoint_every",
    -5,
    "config.checkpoint_every: -5 is not allowed: an integer number of steps >= 0 (0: no checkpoints)",
  ),
  ("checkpoint_keep", 0, "config.checkpoint_keep: 0 is not allowed: a positive integer"),
  (
    "profile_steps",
    "5",
    "config.profile_steps: '5' is not allowed: 'a:b' with 0 <= a < b (steps [a, b) are traced), or ''",
  ),
  (
    "on_config_change",
    "ignore",
    "config.on_config_change: 'ignore' is not allowed: one of refuse, new, force",
  ),
]


@pytest.mark.parametrize("key,value,message", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_validation_names_the_key_and_what_is_allowed(key, value, message):
  set_and_check(default_config.get_config(), key, value, message)


SIM = "executor=sim,num_workers=16"
BAD_SIM = [
  (
    SIM,
    "timeline.overlap",
    1.5,
    "config.timeline.overlap: 1.5 is not allowed: a fraction of a step in [0, 1]",
  ),
  (
    SIM,
    "validation_examples",
    -1,
    ("config.validation_examples: -1 is not allowed: an integer number of training examples >= 0 (0: none)"),
  ),
  (
    "",
    "validation_examples",
    100,
    (
      "config.validation_examples: 100 is not allowed: 0 with executor=spmd (the simulator records val_accuracy)"
    ),
  ),
  (
    "",
    "eval_workers",
    False,
    "config.eval_workers: False is not allowed: True with executor=spmd (the simulator's evaluations)",
  ),
  (
    SIM + ",algorithm=ripples_smart",
    "hetero.slowdown",
    0.5,
    "config.hetero.slowdown: 0.5 is not allowed: a factor >= 1",
  ),
  (
    SIM,
    "hetero.slow_workers",
    (3, 16),
    "config.hetero.slow_workers: (3, 16) is not allowed: worker ids in [0, num_workers=16)",
  ),
  (
    SIM + ",algorithm=ripples_random",
    "schedule.group_size",
    17,
    "config.schedule.group_size: 17 is not allowed: an integer group size in [2, num_workers=16]",
  ),
  (SIM, "hetero.random_p", 1.5, "config.hetero.random_p: 1.5 is not allowed: a probability in [0, 1]"),
  (SIM, "timeline.bandwidth", 0.0, "config.timeline.bandwidth: 0.0 is not allowed: a number > 0"),
  (
    SIM,
    "algorithm",
    "gossip",
    "config.algorithm: 'gossip' is not allowed: one of allreduce, ps_sync, "
    "ps_async, adpsgd, dpsgd, ripples_static, ripples_random, ripples_division, ripples_smart, diloco, moshpit",
  ),
  (
    "",
    "algorithm",
    "adpsgd",
    "config.algorithm: 'adpsgd' is not allowed: one of allreduce, ripples_static with executor=spmd; "
    "adpsgd needs executor=sim or executor=async",
  ),
]


ASYNC = "executor=async,num_workers=1,algorithm=allreduce"
BAD_SIM += [
  (
    ASYNC,
    "algorithm",
    "dpsgd",
    "config.algorithm: 'dpsgd' is not allowed: one of allreduce, ps_sync, ps_async, adpsgd, ripples_static, "
    "ripples_random, ripples_division, ripples_smart, diloco, moshpit with executor=async; "
    "dpsgd needs executor=sim",
  ),
  (
    ASYNC,  # validated with its 2 processes (a worker and the coordinator)
    "num_workers",
    4,
    "config.num_workers: 4 is not allowed: the number of worker processes (1 of 2: process 0 is the "
    "coordinator) with executor=async (one process per worker and a coordinator: experiments.launch "
    "--num_processes=<workers> starts both; on a cluster, --jax_distributed with num_workers + 1 "
    "processes)",
  ),
  (
    ASYNC,
    "runtime.step_time",
    -1.0,
    "config.runtime.step_time: -1.0 is not allowed: seconds >= 0 (0: no padding)",
  ),
  (ASYNC, "runtime.warmup_steps", 0, "config.runtime.warmup_steps: 0 is not allowed: a positive integer"),
  (
    ASYNC,
    "runtime.adpsgd_passive",
    "lazy",
    "config.runtime.adpsgd_passive: 'lazy' is not allowed: one of concurrent, blocking",
  ),
  (
    SIM,
    "hetero.rotate_every",
    -1.0,
    "config.hetero.rotate_every: -1.0 is not allowed: seconds >= 0 (0: the slow workers stay)",
  ),
  (
    ASYNC,
    "runtime.heartbeat_timeout",
    1.0,
    "config.runtime.heartbeat_timeout: 1.0 is not allowed: seconds > 2 x runtime.heartbeat_s=1.0",
  ),
  (
    ASYNC,
    "runtime.stall_timeout",
    10.0,
    "config.runtime.stall_timeout: 10.0 is not allowed: seconds > runtime.heartbeat_timeout=15.0",
  ),
  (ASYNC, "hetero.slowdown", 0.5, "config.hetero.slowdown: 0.5 is not allowed: a factor >= 1"),
  (
    ASYNC,
    "runtime.fail_worker",
    1,
    "config.runtime.fail_worker: 1 is not allowed: -1 (none) or a worker id < num_workers=1",
  ),
]


@pytest.mark.parametrize("arg,key,value,message", BAD_SIM, ids=[f"{k}={v}" for _, k, v, _ in BAD_SIM])
def test_validation_of_simulation_keys(arg, key, value, message):
  set_and_check(default_config.get_config(arg), key, value, message)


def processes(config) -> int:
  """The processes a config runs in: its workers and the coordinator (async), else one."""
  return config.num_workers + 1 if config.executor == "async" else 1


def set_and_check(config, key, value, message):
  n = processes(config)  # the job's, before the bad value
  config.update_from_flattened_dict({key: value})
  with pytest.raises(ConfigError) as e:
    validate_train_config(config, num_devices=8, num_processes=n)
  assert str(e.value) == message


def test_hypercube_needs_a_power_of_two():
  config = default_config.get_config("layout=hypercube,num_workers=6")
  with pytest.raises(ConfigError, match="config.num_workers: 6 is not allowed: a power of"):
    validate_train_config(config, num_devices=8)


def test_default_config_is_valid():
  validate_train_config(default_config.get_config(), num_devices=8)
  validate_train_config(default_config.get_config("executor=sim,num_workers=12"), num_devices=8)
  validate_train_config(default_config.get_config("algorithm=allreduce,num_workers=16"), num_devices=8)


@pytest.mark.slow  # in process, too long for the fast tier
def test_in_process_run_learns_and_writes_metrics(tmp_path):
  config = default_config.get_config("dataset=digits,model=mlp,steps=60")
  config.eval_every, config.log_every = 30, 10
  summary = run.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
  assert [r["step"] for r in records if "test_accuracy" in r] == [30, 60]
  assert records[-1]["train_loss"] < records[0]["train_loss"]
  assert summary["final_test_accuracy"] > 0.8  # digits, 10 classes: chance is 0.1
  assert summary["worker_steps"] == [60] * 8
  assert all(r["time"] >= 0 for r in records)
  assert records[-1]["consensus_distance"] >= 0
  # The trained model back: the averaged params evaluate to the run's final accuracy, on one device.
  model = run.load(str(tmp_path))
  assert model["step"] == 60 and model["executor"] == "spmd"
  from ripples_jax import workload

  s = workload.build(model["config"])
  logits = s.model.apply({"params": model["params_avg"], **model["model_state_avg"]}, s.data["x_test"])
  acc = float((logits.argmax(-1) == s.data["y_test"]).mean())
  assert abs(acc - summary["final_test_accuracy"]) < 1e-6
  # The model is callable: apply and evaluate give the same numbers, for the average and for a worker.
  got = model["evaluate"](s.data["x_test"], s.data["y_test"])
  assert abs(got["accuracy"] - summary["final_test_accuracy"]) < 1e-6 and got["loss"] > 0
  np.testing.assert_allclose(model["apply"](s.data["x_test"][:5]), logits[:5], rtol=1e-5, atol=1e-6)
  w3 = jax.tree.map(lambda a: a[3], {"params": model["params"], **model["model_state"]})
  np.testing.assert_allclose(
    model["apply"](s.data["x_test"][:5], worker=3),
    s.model.apply(w3, s.data["x_test"][:5]),
    rtol=1e-5,
    atol=1e-6,
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a.mean(0), b, rtol=1e-6), model["params"], model["params_avg"]
  )


@pytest.mark.slow  # in process, too long for the fast tier
def test_profile_steps_write_a_trace(tmp_path):
  config = default_config.get_config("dataset=synthetic,model=mlp,steps=6")
  config.profile_steps, config.checkpoint_every = "2:4", 0
  run.train_and_evaluate(config, str(tmp_path))
  assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))


def test_the_default_group_size_fits_a_small_run():
  """Random GG, Group Division and Smart GG default to groups of 3, or of every worker when fewer."""
  from ripples_jax.config import validate_train_config

  for n, want in ((2, 2), (3, 3), (16, 3)):
    config = default_config.get_config(f"executor=async,num_workers={n},algorithm=ripples_division")
    assert config.schedule.group_size == want
    validate_train_config(config, num_devices=n + 1, num_processes=n + 1, local_devices=1)

"""RunLog owns a run's files: records, resume cut-back, checkpoints with cursors, the summary."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default as default_config
from ripples_jax.runlog import SUMMARY_KEYS, RunLog


def config(**kw):
  c = default_config.get_config("steps=100")
  c.checkpoint_every, c.log_every = 10, 10
  c.update_from_flattened_dict(kw)
  return c


def lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


def test_resume_cuts_metrics_back_to_the_checkpoint_and_restores_the_cursor(tmp_path):
  wd = str(tmp_path)
  state = {"w": jnp.arange(4.0)}
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    assert log.restore(state) is None
    for step in (10, 20):
      log.record(step, 0.5 * step, train_loss=1.0 / step)
      log.checkpoint(step, {"w": state["w"] + step}, {"round": step, "starts": [step, 1]})
    log.record(30, 15.0, train_loss=0.03, test_accuracy=0.5)  # after the last checkpoint: a lost record
  assert [r["step"] for r in lines(wd)] == [10, 20, 30]
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    step, got, cursor = log.restore(state)
    assert step == 20 and cursor == {"round": 20, "starts": [20, 1]}
    np.testing.assert_array_equal(got["w"], np.arange(4.0) + 20)
    assert [r["step"] for r in lines(wd)] == [10, 20]  # cut back: nothing repeated after the resume
    assert log.last["train_loss"] == 1.0 / 20 and "test_accuracy" not in log.last
    log.record(30, 15.0, train_loss=0.03)
  assert [r["step"] for r in lines(wd)] == [10, 20, 30]
  assert json.load(open(os.path.join(wd, "config.json")))["num_steps"] == 100


def test_a_fresh_start_keeps_an_old_metrics_file_aside(tmp_path):
  wd = str(tmp_path)
  with RunLog(wd, config(checkpoint_every=0), 100, progress=False, tensorboard=False) as log:
    log.restore({})
    log.record(1, 0.1, train_loss=2.0)
  with RunLog(wd, config(checkpoint_every=0), 100, progress=False, tensorboard=False) as log:
    assert log.restore({}) is None
    log.record(5, 0.1, train_loss=1.0)
  assert [r["step"] for r in lines(wd)] == [5]
  assert json.loads(open(os.path.join(wd, "metrics.jsonl.old")).read())["step"] == 1


def test_a_non_finite_loss_is_written_then_stops_the_run(tmp_path):
  wd = str(tmp_path)
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    log.restore({"w": jnp.zeros(2)})
    log.checkpoint(10, {"w": jnp.zeros(2)}, {})
    with pytest.raises(FloatingPointError, match=r"train_loss is nan at step 12; .* checkpoint is .*ckpt/10"):
      log.record(12, 1.0, train_loss=float("nan"))
  assert lines(wd)[-1]["step"] == 12


def test_summary_has_the_shared_keys_and_the_newest_values(tmp_path):
  wd = str(tmp_path)
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    log.record(50, 2.0, train_loss=0.5, test_accuracy=0.7, worker_test_accuracy=0.6, consensus_distance=0.1)
    log.record(100, 4.0, train_loss=0.25)
    summary = log.finish(time=4.0, worker_steps=np.array([100, 100]), conflicts=[0, 1])
  assert list(summary)[:len(SUMMARY_KEYS)] == list(SUMMARY_KEYS)
  assert summary["final_train_loss"] == 0.25 and summary["final_test_accuracy"] == 0.7
  assert summary["throughput"] == 50.0 and summary["conflicts"] == [0, 1]
  assert json.load(open(os.path.join(wd, "summary.json"))) == summary


def test_only_the_lead_writes_files(tmp_path):
  wd = str(tmp_path / "w")
  with RunLog(wd, config(checkpoint_every=0), 100, is_lead=False, progress=False) as log:
    log.record(1, 0.1, train_loss=1.0)
    log.finish(time=1.0, worker_steps=[1])
  assert not os.path.exists(wd)

"""RunLog owns a run's files: records, resume cut-back, checkpoints with cursors, the summary, and
TensorBoard events that hold every record exactly once across a kill and a resume."""

import json
import logging
import os
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default as default_config
from ripples_jax import checkpoint, runlog
from ripples_jax.config import ConfigError
from ripples_jax.runlog import SUMMARY_KEYS, RunLog, make_workdir


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


def test_fresh_starts_never_overwrite_earlier_records(tmp_path):
  wd = str(tmp_path)
  for step in (1, 5, 9):
    with RunLog(wd, config(checkpoint_every=0), 100, progress=False, tensorboard=False) as log:
      assert log.restore({}) is None
      log.record(step, 0.1, train_loss=1.0)
      log.finish(time=1.0, worker_steps=[step])
  assert [r["step"] for r in lines(wd)] == [9]
  for k, step in ((1, 1), (2, 5)):  # numbered, in order, each run's files together
    assert json.loads(open(os.path.join(wd, f"metrics.{k}.jsonl")).read())["step"] == step
    assert json.load(open(os.path.join(wd, f"summary.{k}.json")))["worker_steps"] == [step]
    assert os.path.exists(os.path.join(wd, f"config.{k}.json"))


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
  assert list(summary)[: len(SUMMARY_KEYS)] == list(SUMMARY_KEYS)
  assert summary["final_train_loss"] == 0.25 and summary["final_test_accuracy"] == 0.7
  assert summary["throughput"] == 50.0 and summary["conflicts"] == [0, 1]
  assert json.load(open(os.path.join(wd, "summary.json"))) == summary


def test_only_the_lead_writes_files(tmp_path):
  wd = str(tmp_path / "w")
  with RunLog(wd, config(checkpoint_every=0), 100, is_lead=False, progress=False) as log:
    log.record(1, 0.1, train_loss=1.0)
    log.finish(time=1.0, worker_steps=[1])
  assert not os.path.exists(wd)


def saved_run(wd, **kw):
  with RunLog(wd, config(**kw), 100, progress=False, tensorboard=False) as log:
    log.restore({"w": jnp.zeros(4)})
    log.record(10, 1.0, train_loss=0.5)
    log.checkpoint(10, {"w": jnp.arange(4.0)}, {"round": 10})


def test_a_changed_config_is_refused_with_the_differing_keys(tmp_path):
  wd = str(tmp_path)
  saved_run(wd)
  with pytest.raises(ConfigError, match=r"is another run \(num_steps 100 -> 200; optimizer.lr 0.1 -> 0.05\)"):
    make_workdir(wd, config(**{"optimizer.lr": 0.05, "num_steps": 200}))
  assert make_workdir(wd, config(log_every=5, eval_every=7)) == wd  # cadence may change
  fresh = make_workdir(wd, config(**{"optimizer.lr": 0.05, "on_config_change": "new"}))
  assert fresh == os.path.join(wd, "run-1") and os.path.isdir(fresh)
  assert make_workdir(wd, config(**{"optimizer.lr": 0.05, "on_config_change": "force"})) == wd
  with RunLog(
    wd, config(**{"optimizer.lr": 0.05, "on_config_change": "force"}), 100, progress=False, tensorboard=False
  ) as log:
    assert log.restore({"w": jnp.zeros(4)})[0] == 10
  assert json.load(open(os.path.join(wd, "config.1.json")))["optimizer"]["lr"] == 0.1  # kept
  assert json.load(open(os.path.join(wd, "config.json")))["optimizer"]["lr"] == 0.05


def values(step):
  return jax.random.normal(jax.random.key(step), (160_000,))  # big enough for its own data file


def test_a_flipped_byte_in_a_checkpoint_falls_back_to_the_previous_one(tmp_path):
  wd = str(tmp_path)
  like = {"w": jnp.zeros(160_000)}
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    log.restore(like)
    for step in (10, 20):
      log.checkpoint(step, {"w": values(step)}, {"round": step})
  # One flipped byte in checkpoint 20's largest data file: orbax restores other numbers without an
  # error (checked below); only the fingerprint can catch it.
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(wd, "ckpt", "20", "state")) for f in fs]
  path = max(files, key=os.path.getsize)
  raw = bytearray(open(path, "rb").read())
  raw[len(raw) // 2] ^= 0x10
  open(path, "wb").write(bytes(raw))
  mgr = checkpoint.manager(os.path.join(wd, "ckpt"), 2)
  silent, _ = checkpoint.restore(mgr, 20, like)
  checkpoint.finish(mgr)
  assert not np.array_equal(silent["w"], values(20))  # what orbax alone would resume from
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    step, state, cursor = log.restore(like)
  assert step == 10 and cursor == {"round": 10}
  np.testing.assert_array_equal(state["w"], values(10))
  assert sorted(os.listdir(os.path.join(wd, "ckpt"))) == ["10"]  # the bad one is gone: saves resume


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
  wd = str(tmp_path)
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    log.restore({"w": jnp.zeros(2)})
    log.checkpoint(10, {"w": jnp.zeros(2)}, {})
    log.checkpoint(20, {"w": jnp.array([0.0, jnp.nan])}, {})
    assert log.describe_last().endswith("ckpt/10")
    with pytest.raises(FloatingPointError, match=r"ckpt/10"):
      log.record(20, 2.0, train_loss=float("nan"))
  assert sorted(os.listdir(os.path.join(wd, "ckpt"))) == ["10"]
  last = open(os.path.join(wd, "metrics.jsonl")).read().splitlines()[-1]
  assert json.loads(last) == {"step": 20, "time": 2.0, "train_loss": None, "nonfinite": {"train_loss": "nan"}}


def test_one_run_per_workdir(tmp_path):
  wd = str(tmp_path)
  with RunLog(wd, config(), 100, progress=False, tensorboard=False):
    with pytest.raises(ConfigError, match=rf"in use by pid {os.getpid()} on "):
      RunLog(wd, config(), 100, progress=False, tensorboard=False)
  with open(os.path.join(wd, ".lock"), "w") as f:  # a run that died without releasing it
    f.write(f"999999999 {socket.gethostname()} 2026-01-01T00:00:00\n")
  with RunLog(wd, config(), 100, progress=False, tensorboard=False):
    assert open(os.path.join(wd, ".lock")).read().startswith(f"{os.getpid()} ")
  assert not os.path.exists(os.path.join(wd, ".lock"))


def test_a_checkpoint_of_an_older_version_is_refused_not_resumed(tmp_path):
  wd = str(tmp_path)
  saved_run(wd)
  meta_path = os.path.join(wd, "ckpt", "10", "meta", "metadata")
  meta = json.load(open(meta_path))
  del meta["identity"]  # what the code before run identities wrote
  json.dump(meta, open(meta_path, "w"))
  with pytest.raises(ConfigError, match=r"ckpt/10 was written by an older version \(no run identity\)"):
    make_workdir(wd, config())


def test_a_lock_held_on_another_host_is_not_taken_over(tmp_path):
  wd = str(tmp_path)
  with open(os.path.join(wd, ".lock"), "w") as f:
    f.write("12345 other-host 2026-01-01T00:00:00\n")
  with pytest.raises(
    ConfigError, match=r"in use by pid 12345 on other-host since 2026-01-01T00:00:00 .*delete"
  ):
    RunLog(wd, config(), 100, progress=False, tensorboard=False)


# -- TensorBoard ------------------------------------------------------------------------------------


def tensorboard_events(workdir):
  """({(tag, step): [values]} of the scalars, {tag: steps} of the other summaries) as TensorBoard reads
  `workdir`: with tensorboard's EventAccumulator (its purge rules included)."""
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(
    workdir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
  )
  acc.Reload()
  scalars, other = {}, {}
  for tag in acc.Tags()["scalars"]:
    for e in acc.Scalars(tag):
      scalars.setdefault((tag, e.step), []).append(e.value)
  for tag in acc.Tags()["tensors"]:
    other[tag] = [e.step for e in acc.Tensors(tag)]
  for tag in acc.PluginTagToContent("hparams"):  # kept as plugin metadata, not as tensors: step 0
    other.setdefault(tag, [0])
  return scalars, other


def tensorboard_live(workdir):
  """TensorBoard's reader of `workdir` after one load; Reload() reads on from where it was."""
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(workdir, size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return acc


def raw_scalars(workdir):
  """{(tag, step): [values]} of every scalar in the events files of `workdir`, read with the protobufs
  alone: no project code and no purge rule (what tbparse or a script over the files sees). A record
  cut short by a kill ends its file."""
  import glob
  import struct

  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.record_writer import masked_crc32c as masked

  out = {}
  for path in sorted(glob.glob(os.path.join(workdir, "events.out.tfevents.*"))):
    data, i = open(path, "rb").read(), 0
    while i + 12 <= len(data):
      header, (length_crc,) = data[i : i + 8], struct.unpack("<I", data[i + 8 : i + 12])
      (n,) = struct.unpack("<Q", header)
      if masked(header) != length_crc or i + 16 + n > len(data):
        break
      body, (body_crc,) = data[i + 12 : i + 12 + n], struct.unpack("<I", data[i + 12 + n : i + 16 + n])
      if masked(body) != body_crc:
        break
      i += 16 + n
      event = Event.FromString(body)
      for v in event.summary.value:
        if v.WhichOneof("value") == "simple_value":
          out.setdefault((v.tag, event.step), []).append(v.simple_value)
  return out


def assert_tensorboard_once(workdir, simulated=False):
  """Every metrics.jsonl number once under its tag and step, and nothing else but steps_per_s (once a
  step): read raw and as TensorBoard reads it."""
  for scalars in (raw_scalars(workdir), tensorboard_events(workdir)[0]):
    same(without_rate(scalars), expected_scalars(workdir, simulated))
    assert all(len(v) == 1 for v in scalars.values()), [k for k, v in scalars.items() if len(v) > 1]


def expected_scalars(workdir, simulated=False):
  """{(tag, step): [value]}: every number of every metrics.jsonl record, once."""
  out = {}
  for r in lines(workdir):
    for k, v in r.items():
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
        out.setdefault((runlog.tb_tag(k, simulated), r["step"]), []).append(v)
  return out


def without_rate(scalars):
  """The scalars but steps_per_s (TensorBoard's own, not in metrics.jsonl)."""
  return {k: v for k, v in scalars.items() if not k[0].startswith("train/steps_per_")}


def same(got, expected):
  """Equal keys, and values equal as TensorBoard stores them (float32)."""
  assert sorted(got) == sorted(expected)
  for k in expected:
    assert np.float32(got[k]).tolist() == np.float32(expected[k]).tolist(), k


def test_tensorboard_is_on_disk_at_each_record_and_a_resume_drops_what_followed_the_checkpoint(tmp_path):
  wd = str(tmp_path)
  state = {"w": jnp.arange(4.0)}
  with RunLog(wd, config(), 100, progress=False) as log:
    log.restore(state)
    for step in (10, 20):
      log.record(step, 0.5 * step, train_loss=1.0 / step)
      log.checkpoint(step, state, {"round": step})
    log.record(30, 15.0, train_loss=0.03, test_accuracy=0.5)  # after the last checkpoint: lost
    scalars, other = tensorboard_events(wd)  # while the run is live: nothing waits for close()
    same(without_rate(scalars), expected_scalars(wd))
    assert scalars[("train/loss", 30)] == pytest.approx([0.03]) and ("eval/accuracy", 30) in scalars
    assert scalars[("train/steps_per_s", 20)] == pytest.approx([2.0])  # 10 steps in 5 s
    assert other["config/text_summary"] == [0]
    assert other["_hparams_/experiment"] == [0] and other["_hparams_/session_start_info"] == [0]
    live = tensorboard_live(wd)  # a TensorBoard left running: it has read step 30 before the "kill"
    assert live.Scalars("train/loss")[-1].step == 30
  with RunLog(wd, config(), 100, progress=False) as log:
    assert log.restore(state)[0] == 20
    log.record(30, 16.0, train_loss=0.04)
    log.record(40, 20.0, train_loss=0.05, test_accuracy=0.7)
    log.finish(time=20.0, worker_steps=[40])
  live.Reload()  # it reads on where it was: the purge makes it forget the lost step 30
  loss = live.Scalars("train/loss")
  assert [e.step for e in loss] == [10, 20, 30, 40]
  assert [e.value for e in loss] == pytest.approx([0.1, 0.05, 0.04, 0.05])
  scalars, other = tensorboard_events(wd)
  assert [r["step"] for r in lines(wd)] == [10, 20, 30, 40]
  same(without_rate(scalars), expected_scalars(wd))  # each record once, the lost one gone
  assert_tensorboard_once(wd)  # in the files too, for a reader without TensorBoard's purge
  assert scalars[("train/steps_per_s", 30)] == pytest.approx([10 / 6])  # from the checkpoint's record
  assert other["config/text_summary"] == [0]  # the config once: the resumed run kept it
  assert len(runlog.event_files(wd)) == 2


def test_a_fresh_start_moves_the_earlier_runs_events_aside(tmp_path):
  wd = str(tmp_path)
  for step in (5, 9):
    with RunLog(wd, config(checkpoint_every=0), 100, progress=False) as log:
      assert log.restore({}) is None
      log.record(step, 1.0, train_loss=1.0)
  assert set(tensorboard_events(wd)[0]) == {("train/loss", 9), ("train/time_s", 9)}
  assert set(tensorboard_events(os.path.join(wd, "tensorboard.1"))[0]) == {
    ("train/loss", 5),
    ("train/time_s", 5),
  }


def test_tags_group_train_and_eval_and_name_the_time_unit():
  assert [
    runlog.tb_tag(k)
    for k in (
      "train_loss",
      "test_accuracy",
      "test_loss",
      "worker_test_accuracy",
      "consensus_distance",
      "time",
      "epoch",
    )
  ] == [
    "train/loss",
    "eval/accuracy",
    "eval/loss",
    "eval/worker_accuracy",
    "eval/consensus_distance",
    "train/time_s",
    "train/epoch",
  ]
  assert runlog.tb_tag("time", simulated=True) == "train/virtual_s"


def test_a_committed_checkpoint_gets_one_console_line(tmp_path, caplog):
  wd = str(tmp_path)
  with caplog.at_level(logging.INFO):
    with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
      log.restore({"w": jnp.zeros(2)})
      for step in (10, 20):
        log.checkpoint(step, {"w": jnp.zeros(2) + step}, {})
  ours = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint ")]
  assert ours == [
    f"checkpoint {s} saved: {os.path.join(os.path.abspath(wd), 'ckpt', str(s))}" for s in (10, 20)
  ]

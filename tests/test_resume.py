"""Checkpoint and resume for every entry point: a run killed by PID and started again equals one that
was never interrupted (byte for byte in simulation), a corrupt latest checkpoint falls back to the
previous one, and the SPMD path runs the same on 2 processes as on one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ripples_jax import runlog
from tests.test_runlog import assert_tensorboard_once, tensorboard_events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(module, workdir, args):
  return [sys.executable, "-m", module, f"--workdir={workdir}", *args]


def run(module, workdir, args, timeout=300):
  out = subprocess.run(
    command(module, workdir, args), cwd=ROOT, capture_output=True, text=True, timeout=timeout
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def past_checkpoint(workdir) -> bool:
  """Whether metrics.jsonl holds a record after the newest committed checkpoint (a kill now loses it)."""
  ckpt = os.path.join(workdir, "ckpt")
  steps = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
  got = records(workdir) if os.path.exists(os.path.join(workdir, "metrics.jsonl")) else []
  return bool(steps and got and got[-1]["step"] > max(steps))


def run_and_kill(module, workdir, args, checkpoint_step, timeout=300, between=False):
  """Starts a run, SIGKILLs it once checkpoint `checkpoint_step` is committed (and, with `between`,
  once a record follows the newest checkpoint: the kill falls between checkpoints); returns the lines
  it had written to metrics.jsonl by then."""
  proc = subprocess.Popen(
    command(module, workdir, args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  target = os.path.join(workdir, "ckpt", str(checkpoint_step))
  deadline = time.monotonic() + timeout
  try:
    while not os.path.isdir(target) or (between and not past_checkpoint(workdir)):
      assert proc.poll() is None, "the run ended before it could be interrupted"
      assert time.monotonic() < deadline, "no checkpoint appeared"
      time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
  finally:
    if proc.poll() is None:
      proc.kill()
  return open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()


def records(workdir):
  # A line being written as it is read is not a record yet.
  out = []
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    if line.endswith("\n"):
      out.append(json.loads(line))
  return out


SIM = [
  "--config=configs/default.py:executor=sim,num_workers=4,model=mlp,algorithm=ripples_smart,steps=400",
  "--config.hetero.slow_workers=(3,)",
  "--config.hetero.slowdown=3.0",
  "--config.log_every=10",
  "--config.eval_every=50",
  "--config.checkpoint_every=50",
]


@pytest.mark.slow
def test_simulation_resumes_byte_identical_and_survives_a_corrupt_checkpoint(tmp_path):
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  run("experiments.train", whole, SIM)
  expected = open(os.path.join(whole, "metrics.jsonl"), "rb").read()

  run_and_kill("experiments.train", cut, SIM, 100, between=True)
  run("experiments.train", cut, SIM)
  assert open(os.path.join(cut, "metrics.jsonl"), "rb").read() == expected
  assert_tensorboard_once(cut, simulated=True)  # the steps redone after the kill: once each

  # The newest checkpoint is damaged: the run falls back to the previous one, warns, and the metrics
  # still come out the same (cut back to that checkpoint, then redone).
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(whole, "ckpt")) if d.isdigit())
  assert len(ckpts) == 2
  state_dir = os.path.join(whole, "ckpt", str(ckpts[-1]), "state")
  for name in os.listdir(state_dir):
    path = os.path.join(state_dir, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif name != "commit_success.txt":
      os.remove(path)
  out = run("experiments.train", whole, SIM)
  assert f"ckpt/{ckpts[-1]} does not read back" in out.stderr
  assert f"resuming from {os.path.join(whole, 'ckpt')}/{ckpts[0]}" in out.stderr
  assert open(os.path.join(whole, "metrics.jsonl"), "rb").read() == expected


SPMD = [
  "--config=configs/default.py:model=mlp,steps=300",
  "--config.log_every=10",
  "--config.eval_every=100",
  "--config.checkpoint_every=100",
]


@pytest.mark.slow
def test_spmd_resumes_within_float_tolerance(tmp_path):
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  run("experiments.train", whole, SPMD)
  before = run_and_kill("experiments.train", cut, SPMD, 100, between=True)
  assert 10 < len(before) < 30  # killed after a record that followed checkpoint 100, before the end
  run("experiments.train", cut, SPMD)
  a, b = records(whole), records(cut)
  assert [r["step"] for r in a] == [r["step"] for r in b]  # nothing lost, nothing repeated
  assert [r["step"] for r in b] == list(range(10, 301, 10))
  assert_tensorboard_once(cut)  # TensorBoard too, read raw and as TensorBoard reads it
  assert len(runlog.event_files(cut)) == 2 and tensorboard_events(cut)[1]["config/text_summary"] == [0]
  for ra, rb in zip(a, b):
    for k in ("train_loss", "test_accuracy", "consensus_distance"):
      if k in ra:
        np.testing.assert_allclose(rb[k], ra[k], rtol=1e-4, atol=1e-5)


DSP = [
  "--config=configs/dsp.py:method=dsp,num_stages=2,model=mlp",
  "--config.num_epochs=3",
  "--config.log_every=25",
  "--config.eval_every=125",
  "--config.checkpoint_every=125",
]


@pytest.mark.slow
@pytest.mark.parametrize(
  "extra",
  [
    [],
    # The program's checkpoint holds its stages' trees; PipeMare's empty input rings are saved as
    # nothing and restored from the template (checkpoint._sized).
    pytest.param(
      ["--config.placement=spmd", "--config.method=pipemare", "--config.spmd_ticks=16"], id="spmd"
    ),
  ],
)
def test_dsp_pipeline_resumes_exactly(tmp_path, extra):
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  args = DSP + extra
  run("experiments.train_dsp", whole, args)
  run_and_kill("experiments.train_dsp", cut, args, 125, between=True)
  run("experiments.train_dsp", cut, args)
  assert_tensorboard_once(cut)
  # Wall time and the modeled time (from measured stage times) differ between runs; the rest must not.
  strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time", "modeled_time")} for r in rs]
  assert strip(records(cut)) == strip(records(whole))


@pytest.mark.slow
def test_spmd_on_two_processes_equals_one_process(tmp_path):
  import io

  from ripples_jax.distributed.launcher import launch

  args = [
    "--config=configs/default.py:model=mlp,steps=60",
    "--config.log_every=10",
    "--config.eval_every=30",
    "--config.checkpoint_every=30",
  ]
  one = str(tmp_path / "one")
  run("experiments.train", one, args)
  two = str(tmp_path / "two")
  out = io.StringIO()
  # 2 processes x 4 CPU devices: the same 8-device mesh, each process feeding the workers it owns.
  code = launch(2, [*args, f"--workdir={two}"], cpu_devices=4, out=out, cwd=ROOT, grace_s=5)
  assert code == 0, out.getvalue()[-3000:]
  a, b = records(one), records(two)
  assert [r["step"] for r in a] == [r["step"] for r in b]  # one writer: no duplicated lines
  for ra, rb in zip(a, b):
    for k in ("train_loss", "test_accuracy", "consensus_distance"):
      if k in ra:
        np.testing.assert_allclose(rb[k], ra[k], rtol=1e-4, atol=1e-5)
  assert "2 processes" in out.getvalue()


def test_non_finite_loss_names_the_step_and_the_last_checkpoint():
  with pytest.raises(
    FloatingPointError,
    match=r"train_loss is nan at step 70; stopping the run; "
    r"the last good checkpoint is /w/ckpt/50",
  ):
    runlog.check_finite(70, "/w/ckpt/50", train_loss=float("nan"))


@pytest.mark.slow
def test_a_second_run_in_the_same_workdir_refuses_and_the_first_is_unharmed(tmp_path):
  wd = str(tmp_path / "run")
  args = SIM[:1] + [
    "--config.log_every=10",
    "--config.eval_every=100",
    "--config.checkpoint_every=100",
    "--config.timeline.compute_time=0.01",
  ]
  first = subprocess.Popen(
    command("experiments.train", wd, args),
    cwd=ROOT,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(wd, ".lock")):
      assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
      time.sleep(0.05)
    # Freeze the first run while the second starts: it holds the lock the whole time, however fast it
    # would otherwise finish (on a slow machine its 400 steps can end before the second run has imported).
    os.kill(first.pid, signal.SIGSTOP)
    try:
      second = subprocess.run(
        command("experiments.train", wd, args), cwd=ROOT, capture_output=True, text=True, timeout=120
      )
    finally:
      os.kill(first.pid, signal.SIGCONT)
    assert second.returncode != 0 and "Traceback" not in second.stderr
    assert (
      second.stderr.strip()
      .splitlines()[-1]
      .startswith(f"error: --workdir: '{wd}' is not allowed: it is in use by pid {first.pid} on ")
    )
    assert first.wait(300) == 0
  finally:
    if first.poll() is None:
      first.kill()
  steps = [r["step"] for r in records(wd)]
  assert steps == sorted(set(steps)) and steps[-1] == 400  # the first run's records, whole
  # A rerun with another learning rate is another run: refused with the differing key, nothing touched.
  before = open(os.path.join(wd, "metrics.jsonl")).read()
  out = subprocess.run(
    command("experiments.train", wd, args + ["--config.optimizer.lr=0.05"]),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode != 0 and "optimizer.lr 0.1 -> 0.05" in out.stderr.strip().splitlines()[-1]
  assert open(os.path.join(wd, "metrics.jsonl")).read() == before


# A real stuck collective: device 0 waits forever in a host callback just before its P-Reduce of
# round STALL, so the other participants wait in XLA's rendezvous (which would abort after 40 s).
STALL_SCRIPT = """
import sys, time
import numpy as np, jax
from jax.experimental import io_callback
from ripples_jax import collectives, run
STALL = int(sys.argv[1])
seen = [0] * 8
def hold(dev):
  seen[int(dev)] += 1
  if int(dev) == 0 and seen[0] == STALL:
    time.sleep(3600)
  return np.float32(0)
original = collectives.switched_grouped_mean_in_shard
def stalling(buf, layouts, layout_idx, axis_name=collectives.WORKER_AXIS):
  dev = jax.lax.axis_index(axis_name)
  zero = io_callback(hold, jax.ShapeDtypeStruct((), np.float32), dev, ordered=False)
  return original(buf + zero, layouts, layout_idx, axis_name)
collectives.switched_grouped_mean_in_shard = stalling
from configs import default
c = default.get_config("model=mlp,steps=400")
c.log_every, c.eval_every, c.checkpoint_every, c.stuck_timeout_s = 25, 200, 100, 3.0
run.train_and_evaluate(c, sys.argv[2])
"""


@pytest.mark.slow
def test_a_stuck_collective_ends_with_one_line_and_the_rerun_resumes(tmp_path, caplog):
  workdir = str(tmp_path / "run")
  out = subprocess.run(
    [sys.executable, "-c", STALL_SCRIPT, "250", workdir],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 75, out.stderr[-3000:]
  lines = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1, out.stderr[-3000:]
  assert "the P-Reduce (grouped psum over " in lines[0], lines[0]
  assert "of step 250 " in lines[0] and workdir in lines[0], lines[0]
  assert f"{workdir}/ckpt/200" in lines[0], lines[0]  # the newest committed checkpoint, named
  assert "Termination timeout" not in out.stderr  # the guard spoke before XLA's abort
  # The rerun (no stall) resumes from step 200 and logs every step once.
  from configs import default
  from ripples_jax import run as run_lib

  c = default.get_config("model=mlp,steps=400")
  c.log_every, c.eval_every, c.checkpoint_every = 25, 200, 100
  caplog.set_level("INFO")
  run_lib.train_and_evaluate(c, workdir)
  assert f"resuming from {workdir}/ckpt/200" in caplog.text
  steps = [r["step"] for r in records(workdir)]
  assert steps == list(range(25, 401, 25)), steps

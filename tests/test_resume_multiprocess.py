"""Multi-process resume never destroys a run: the asynchronous runtime and the per-process pipeline
refuse another config (every checkpoint file kept byte for byte), a killed worker stops the run and
the rerun resumes at a marker every worker restores, falling back when one worker's newest is corrupt
(deleting nothing else), and every process ends with exit 74 on a read-only ckpt/ instead of
hanging. Real processes: all slow."""

import json
import os
import re
import subprocess
import threading
import time

import pytest

from tests.fakes import exited, start_directly
from tests.test_pipeline_runtime import pipeline_config
from tests.test_runlog import assert_tensorboard_once
from tests.test_runtime import MODEL, assert_replay_matches, launch_bounded, make_config, run_args
from tests.test_workdir import corrupt, tree_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def finish(procs, timeout_s):
  """(exit codes, outputs, seconds until the last exit); SIGKILLs whatever is left at the timeout."""
  t0, outs = time.monotonic(), []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))[0])
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait()
  return [p.returncode for p in procs], outs, time.monotonic() - t0


def kept(workdir):
  """Every file of the run that a refusal must leave as it was."""
  return {k: v for k, v in tree_digest(workdir).items() if k != ".lock"}


@pytest.fixture(scope="module")
def killed_async_run(tmp_path_factory):
  """2 workers, worker 1 SIGKILLs itself at local step 30: markers on disk, no final state."""
  workdir = str(tmp_path_factory.mktemp("async") / "run")
  args = run_args(workdir, "ripples_division", 2, 60, ["--config.runtime.step_time=0.02"])
  code, out = launch_bounded(2, args + ["--config.runtime.fail_worker=1", "--config.runtime.fail_step=30"])
  assert code != 0 and "kills itself at local step 30" in out, out[-3000:]
  assert os.listdir(os.path.join(workdir, "ckpt", "0")) and os.listdir(os.path.join(workdir, "ckpt", "1"))
  return workdir, args


@pytest.mark.parametrize(
  "change,says",
  [
    (["--config.optimizer.lr=0.05"], r"is another run (optimizer.lr 0.1 -> 0.05)"),
    (["--config.model=cnn1d"], "is another run (model 'mlp_gelu' -> 'cnn1d')"),
    pytest.param(  # the third case of the kind: it compiles before its arrays are found not to fit
      ["--config.model=cnn1d", "--config.on_config_change=force"],
      "the config changed (model 'mlp_gelu' -> 'cnn1d') and its arrays do not fit this config",
      marks=pytest.mark.nightly,
    ),
  ],
)
def test_async_rerun_with_another_config_is_refused_and_keeps_every_file(killed_async_run, change, says):
  workdir, args = killed_async_run
  before = kept(workdir)
  code, out = launch_bounded(2, args + change)
  assert code == 2, out[-3000:]
  errors = [l for l in out.splitlines() if "error:" in l]
  assert errors and says in errors[0] and "Traceback" not in out, out[-3000:]
  assert kept(workdir) == before


@pytest.mark.nightly  # 34 s, for the README command's 15 minutes (WORKSPACE.md section 41)
def test_a_read_only_ckpt_ends_every_worker_with_74_and_keeps_every_file(killed_async_run):
  workdir, args = killed_async_run
  ckpt = os.path.join(workdir, "ckpt")
  before = tree_digest(ckpt)
  if subprocess.run(["mount", "--bind", ckpt, ckpt], capture_output=True).returncode:
    pytest.skip("needs root (mount) for a read-only bind mount")
  try:
    subprocess.run(["mount", "-o", "remount,bind,ro", ckpt], check=True)
    codes, outs, seconds = finish(
      start_directly(2, "experiments.train", args, coordinator=True), timeout_s=120
    )
  finally:
    subprocess.run(["umount", "-l", ckpt])
  # The workers, which write ckpt/, exit 74; the coordinator (it writes no checkpoint) then names them
  # lost and exits 75.
  assert codes == [75, 74, 74], [o[-2000:] for o in outs]
  for out in outs[1:]:
    errors = [l for l in out.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "Read-only file system" in errors[0] and "make it writable" in errors[0], out
  # Its watchdog names them: silent, or (their heartbeats go on while they leave) stalled.
  assert re.search(
    r"coordinator: (worker\(s\) \[0, 1\] lost|no progress for \d+ s; worker \d stalled)", outs[0]
  ), outs[0]
  print(f"read-only ckpt: every process exited in {seconds:.1f} s from its start")
  assert seconds < 60, seconds  # start-up (~15 s here) and the resume included; no hang
  # The resumed run got as far as its first marker; its records after the checkpoint are cut again by
  # the next resume. The checkpoints are as they were.
  assert tree_digest(ckpt) == before


def newest_marker(workdir, worker):
  return max(int(d) for d in os.listdir(os.path.join(workdir, "ckpt", str(worker))) if d.isdigit())


# Nightly for the README command's 15 minutes (68 s): a corrupt checkpoint's fallback stays in its tier
# through test_resume.py's simulation (WORKSPACE.md section 41).
@pytest.mark.nightly
def test_a_killed_worker_stops_the_run_and_a_corrupt_newest_marker_falls_back_deleting_nothing_else(
  tmp_path,
):
  """Three launches of one run. 1: worker 2 SIGKILLs itself before its local step 50; the launcher
  names it at once and stops the others (SIGTERM, the coordinator last), each saying why. 2: worker
  2's newest marker is corrupted; every worker falls back to the newest marker all of them restore,
  deleting only the marker tried and found unusable; then worker 1 kills itself. 3: the run resumes
  from what launch 2 saved and completes; the replay of the recorded order from x_0, across both
  kills, lands on the parameters the workers hold, and TensorBoard holds every record once."""
  workdir = str(tmp_path / "run")
  n, steps = 3, 120  # three workers: a launch's start-up is most of its time on two cores
  args = run_args(workdir, "ripples_division", n, steps, ["--config.runtime.step_time=0.02"])
  died = {}

  def watch_worker_2(pids):
    def watch():
      deadline = time.monotonic() + 180
      while time.monotonic() < deadline and not exited(pids[1 + 2]):  # process 0: the coordinator
        time.sleep(0.05)
      died["at"] = time.monotonic()

    threading.Thread(target=watch, daemon=True).start()

  fail = ["--config.runtime.fail_worker=2", "--config.runtime.fail_step=50"]
  code, out = launch_bounded(n, args + fail, on_pids=watch_worker_2, grace_s=60)
  assert code != 0 and "at" in died, out[-3000:]
  elapsed = time.monotonic() - died["at"]
  assert elapsed < 60, f"the other workers took {elapsed:.0f} s to exit"
  assert "worker 2 kills itself at local step 50" in out, out[-3000:]
  # The launcher names worker 2 at once and stops the others; each says why, with every worker's last
  # completed step. (Without the launcher their watchdogs name worker 2 and exit 75: test_launcher.py.)
  assert "[launch] worker 2 exited with -9 (SIGKILL); stopping the others" in out, out[-3000:]
  stopped = [l for l in out.splitlines() if "received SIGTERM (stopped by the launcher" in l]
  assert len(stopped) == n and sum("[c] coordinator: " in l for l in stopped) == 1, out[-3000:]
  assert "last completed step per worker" in stopped[0]
  assert "exit codes: coordinator 143, workers [143, 143, -9]" in out

  # The newest marker every worker committed (the launcher's SIGTERM may have caught some in the
  # middle of a newer one): the one the rerun would agree on, had worker 2's copy not been corrupted.
  bad = min(newest_marker(workdir, w) for w in range(n))
  corrupt(workdir, bad, process=2)
  others = {w: tree_digest(os.path.join(workdir, "ckpt", str(w))) for w in (0, 1)}
  code, out = launch_bounded(n, args + ["--config.runtime.fail_worker=1", "--config.runtime.fail_step=90"])
  assert code != 0 and "worker 1 kills itself at local step 90" in out, out[-3000:]
  resumed = [
    int(l.split("resuming at checkpoint marker")[1].split()[0])
    for l in out.splitlines()
    if "resuming at checkpoint marker" in l
  ]
  assert len(resumed) == n and len(set(resumed)) == 1 and 1 <= resumed[0] < bad, out[-3000:]
  assert f"checkpoint {bad}: worker [2] cannot restore it" in out, out[-3000:]
  assert "Traceback" not in out and "Event loop is closed" not in out, out[-3000:]
  # Only what was tried and found unusable is reported so: worker 2's corrupt marker, nothing else.
  unreadable = [l for l in out.splitlines() if "does not read back (" in l]
  assert len(unreadable) == 1 and f"ckpt/2/{bad} does not read back" in unreadable[0], unreadable
  deleted = [l for l in out.splitlines() if "deleting checkpoint" in l]
  assert len(deleted) == 1 and f"ckpt/2/{bad}: it does not read back" in deleted[0], deleted
  # Worker 2 deleted only the marker it tried and found corrupt; the others' newer markers were set
  # aside byte for byte, never deleted.
  aside = {w: tree_digest(os.path.join(workdir, "ckpt.superseded", str(w))) for w in others}
  for w in others:
    moved = {
      k: v for k, v in others[w].items() if k.split(os.sep)[0].isdigit() and int(k.split(os.sep)[0]) >= bad
    }
    assert moved and {k: aside[w].get(k) for k in moved} == moved, (w, sorted(moved), sorted(aside[w]))

  code, out = launch_bounded(n, args)
  assert code == 0, out[-3000:]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert sum(summary["worker_steps"]) >= n * steps
  assert_replay_matches(make_config("ripples_division", n, steps, MODEL), workdir, tmp_path)
  assert_tensorboard_once(workdir)  # the coordinator's records past each marker, written twice, show once


# Nightly (21 s): refusing another config stays in the README's tier through the async rerun above.
@pytest.mark.nightly
def test_pipeline_rerun_with_other_stages_or_lr_is_refused_and_a_finished_rerun_rewrites_nothing(tmp_path):
  workdir = str(tmp_path / "run")
  args = pipeline_config("dsp", "recompute", 1, extra=["--config.checkpoint_every=31"]) + [
    f"--workdir={workdir}"
  ]
  code, out = launch_bounded(2, args, module="experiments.train_dsp", timeout_s=300)
  assert code == 0, out[-3000:]
  before = kept(workdir)
  three = [a.replace("num_stages=2", "num_stages=3") for a in args]
  for n, argv, says in (
    (3, three, "is another run (num_stages 2 -> 3)"),
    (2, args + ["--config.optimizer.lr=0.05"], "is another run (optimizer.lr"),
  ):
    code, out = launch_bounded(n, argv, module="experiments.train_dsp")
    assert code == 2, out[-3000:]
    errors = [l for l in out.splitlines() if "error:" in l]
    assert errors and says in errors[0], out[-3000:]
    assert kept(workdir) == before
  code, out = launch_bounded(2, args, module="experiments.train_dsp")
  assert code == 0 and "is complete" in out and "nan" not in out.lower(), out[-3000:]
  now = kept(workdir)
  assert now["summary.json"] == before["summary.json"]
  assert {k: v for k, v in now.items() if k.startswith("ckpt")} == {
    k: v for k, v in before.items() if k.startswith("ckpt")
  }

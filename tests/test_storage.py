"""Durable writes (runlog/storage.py): a snapshot or a trace is whole or absent, a failed write leaves
the old file and no temporary; the summary skips an unreadable snapshot with one warning."""

import errno
import logging
import os
import re

import numpy as np
import pytest

from ripples_jax.runlog import storage
from ripples_jax.runtime import summary


def test_a_write_the_disk_refuses_leaves_the_old_file_whole_and_no_temporary(tmp_path):
  path = str(tmp_path / "final-0.npy")
  storage.save_array(path, np.arange(4.0))

  def full(f):
    f.write(b"\x93NUMPY partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

  with pytest.raises(OSError) as e:
    storage.durable_write(path, full)
  assert e.value.errno == errno.ENOSPC and storage.storage_failure(e.value) == os.strerror(errno.ENOSPC)
  assert sorted(os.listdir(tmp_path)) == ["final-0.npy"]  # no .tmp behind
  np.testing.assert_array_equal(np.load(path), np.arange(4.0))  # the old snapshot, whole
  storage.save_array(path, np.ones(3))
  np.testing.assert_array_equal(np.load(path), np.ones(3))


def test_the_summary_skips_an_unreadable_snapshot_with_one_warning(tmp_path, caplog):
  good, torn = str(tmp_path / "eval1-0.npy"), str(tmp_path / "eval1-1.npy")
  storage.save_array(good, np.arange(3.0))
  with open(good, "rb") as f:
    data = f.read()
  with open(torn, "wb") as f:
    f.write(data[: len(data) // 2])  # torn by a crash of a writer before durable writes
  with caplog.at_level(logging.WARNING):
    assert summary._load(torn) is None
  np.testing.assert_array_equal(summary._load(good), np.arange(3.0))
  assert [r.getMessage().split(":")[0] for r in caplog.records] == [torn]


@pytest.mark.slow
@pytest.mark.nightly
def test_a_full_disk_ends_the_run_74_with_no_partial_checkpoint_and_a_rerun_resumes(tmp_path):
  """Real processes on a 3 MB tmpfs (root only): a 2-worker run fills it at its second or third
  checkpoint marker; the job ends 74 with the line naming the last good checkpoint, nothing is
  restarted (max_restarts=2), no half-written checkpoint folder is left; after the tmpfs is grown
  (space freed) the same command resumes and finishes."""
  import subprocess
  import sys

  if os.geteuid() != 0:
    pytest.skip("mounting a tmpfs needs root")
  mnt = tmp_path / "small"
  mnt.mkdir()
  subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
  try:
    cmd = [
      sys.executable,
      "-m",
      "experiments.launch",
      "--num_processes=2",
      "--max_restarts=2",
      "--grace_s=10",
      "--",
      "--config=configs/default.py:executor=async,num_workers=2,algorithm=ripples_smart,model=mlp",
      "--config.num_steps=400",
      "--config.runtime.checkpoint_every=40",
      "--config.runtime.checkpoint_keep=50",
      f"--workdir={mnt / 'run'}",
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    first = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    out = first.stdout + first.stderr
    assert first.returncode == 74, out[-3000:]
    assert "No space left on device; the last good checkpoint is" in out, out[-3000:]
    assert "nothing restarted; free space" in out and "restarting" not in out, out[-3000:]
    failed = re.search(r"error: \S*/ckpt/(\d+)/\d+: No space left", out).group(1)
    leftovers = list((mnt / "run" / "ckpt" / failed).glob("*orbax-checkpoint-tmp*"))
    assert not leftovers, leftovers  # the failed writer removed its half-written checkpoint
    subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
    second = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "resum" in out, out[-3000:]
  finally:
    subprocess.run(["umount", "-l", str(mnt)], check=False)

"""Resume never destroys a run: the workdir lock (atomic takeover, full disk), the identity of both
checkpoint layouts, refusals that delete nothing, torn metrics.jsonl, and the multi-process agreement."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import pytest

from configs import default as default_config
from ripples_jax import runlog
from ripples_jax.config import ConfigError
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.runlog import ResumeRefused, RunLog
from ripples_jax.runlog import workdir as workdir_lib
from tests.fakes import FakeKV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(**kw):
  c = default_config.get_config("steps=100")
  c.checkpoint_every, c.log_every = 10, 10
  c.update_from_flattened_dict(kw)
  return c


def tree_digest(path):
  """{relative path: sha256} of every file under `path`: 'every checkpoint file still there byte for byte'."""
  out = {}
  for d, _, files in os.walk(path):
    for f in files:
      p = os.path.join(d, f)
      out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
  return out


def saved(wd, steps=(10, 20), **kw):
  with RunLog(wd, config(**kw), 100, progress=False, tensorboard=False) as log:
    log.restore({"w": jnp.zeros(4)})
    for step in steps:
      log.record(step, 1.0, train_loss=0.5)
      log.checkpoint(step, {"w": jnp.arange(4.0) + step}, {"round": step})


def corrupt(wd, step, process=None):
  """Breaks every data file of a checkpoint's state (it no longer reads back)."""
  where = os.path.join(wd, "ckpt", *([str(process)] if process is not None else []), str(step), "state")
  for d, _, files in os.walk(where):
    for f in files:
      with open(os.path.join(d, f), "wb") as fh:
        fh.write(b"garbage")


# -- refusals delete nothing ------------------------------------------------------------------------


def test_no_checkpoint_reads_back_refuses_and_deletes_nothing(tmp_path):
  wd = str(tmp_path)
  saved(wd)
  corrupt(wd, 10)
  corrupt(wd, 20)
  before = tree_digest(os.path.join(wd, "ckpt"))
  for _ in range(2):  # a second rerun finds the same files, refuses the same way
    with pytest.raises(
      ResumeRefused,
      match=r"ckpt/20 \(nor do the 1 older ones\) cannot be resumed: it does "
      r"not read back .*nothing was deleted",
    ):
      with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
        log.restore({"w": jnp.zeros(4)})
    assert tree_digest(os.path.join(wd, "ckpt")) == before
  assert [json.loads(l)["step"] for l in open(os.path.join(wd, "metrics.jsonl"))] == [10, 20]


def test_force_with_other_shapes_is_refused_not_a_fresh_run(tmp_path):
  wd = str(tmp_path)
  saved(wd)
  before = tree_digest(wd)
  c = config(num_workers=4, on_config_change="force")
  assert workdir_lib.make_workdir(wd, c) == wd
  with pytest.raises(
    ResumeRefused, match=r"the config changed \(num_workers 8 -> 4\) and its arrays do not fit"
  ):
    with RunLog(wd, c, 100, progress=False, tensorboard=False) as log:
      log.restore({"w": jnp.zeros(3)})  # another shape, as another num_workers makes
  after = tree_digest(wd)
  assert {k: v for k, v in after.items() if k != ".lock"} == before


def test_only_what_was_tried_and_failed_is_deleted_once_an_older_one_restored(tmp_path):
  wd = str(tmp_path)
  saved(wd, steps=(10, 20, 30), checkpoint_keep=3)
  corrupt(wd, 30)
  with RunLog(wd, config(checkpoint_keep=3), 100, progress=False, tensorboard=False) as log:
    step, state, _ = log.restore({"w": jnp.zeros(4)})
  assert step == 20 and sorted(os.listdir(os.path.join(wd, "ckpt"))) == ["10", "20"]


def per_process_meta(wd, process, step, ident):
  """A per-process checkpoint's metadata as the runtime writes it: ckpt/<process>/<step>/meta/metadata."""
  where = os.path.join(wd, "ckpt", str(process), str(step), "meta")
  os.makedirs(where)
  json.dump({"identity": ident, "cursor": {}}, open(os.path.join(where, "metadata"), "w"))


@pytest.mark.parametrize("change", [{"optimizer.lr": 0.05}, {"model": "mlp"}, {"num_workers": 4}])
def test_the_per_process_layout_is_checked_for_the_run_identity(tmp_path, change):
  wd = str(tmp_path)
  ident = runlog.identity(config())
  for p in range(2):
    per_process_meta(wd, p, 8, ident)
    per_process_meta(wd, p, 16, ident)
  assert workdir_lib.make_workdir(wd, config()) == wd
  key = next(iter(change))
  with pytest.raises(ConfigError, match=rf"its checkpoint .*ckpt/\d/16 is another run \({key} "):
    workdir_lib.make_workdir(wd, config(**change))


def test_one_process_folder_with_another_identity_is_enough_to_refuse(tmp_path):
  wd = str(tmp_path)
  per_process_meta(wd, 0, 8, runlog.identity(config()))
  per_process_meta(wd, 1, 8, runlog.identity(config(**{"optimizer.lr": 0.05})))
  with pytest.raises(ConfigError, match=r"ckpt/1/8 is another run \(optimizer.lr 0.05 -> 0.1\)"):
    workdir_lib.make_workdir(wd, config())


# -- metrics.jsonl ----------------------------------------------------------------------------------


def test_a_torn_line_in_the_middle_is_cut_to_the_last_whole_record(tmp_path, caplog):
  wd = str(tmp_path)
  saved(wd, steps=(10, 20, 30), checkpoint_keep=3)
  path = os.path.join(wd, "metrics.jsonl")
  rows = open(path, "rb").readlines()
  rows[1] = rows[1][:9] + b"\n"  # record 2 torn mid-line
  open(path, "wb").writelines(rows)
  with RunLog(wd, config(checkpoint_keep=3), 100, progress=False, tensorboard=False) as log:
    assert log.restore({"w": jnp.zeros(4)})[0] == 30
  assert [json.loads(l)["step"] for l in open(path)] == [10]
  warned = [r.getMessage() for r in caplog.records if "not a whole record" in r.getMessage()]
  assert len(warned) == 1 and "line 2" in warned[0] and "dropped 2 of the 3" in warned[0], warned


def test_a_short_or_missing_metrics_file_is_named(tmp_path, caplog):
  wd = str(tmp_path)
  saved(wd, steps=(10, 20))
  path = os.path.join(wd, "metrics.jsonl")
  first = open(path, "rb").readlines()[:1]
  open(path, "wb").writelines(first)
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    assert log.restore({"w": jnp.zeros(4)})[0] == 20
  assert any(
    "holds 1 of the 2 records the checkpoint counted: record 2 is lost" in r.getMessage()
    for r in caplog.records
  )
  os.remove(path)
  caplog.clear()
  with RunLog(wd, config(), 100, progress=False, tensorboard=False) as log:
    assert log.restore({"w": jnp.zeros(4)})[0] == 20
  assert any(
    "metrics.jsonl is missing: the checkpoint counted 2 records" in r.getMessage() for r in caplog.records
  )


def test_a_record_cut_short_at_the_end_is_dropped_by_the_cut(tmp_path):
  path = str(tmp_path / "m.jsonl")
  open(path, "wb").write(b'{"step": 1}\n{"step": 2}\n{"st')
  assert runlog.cut_records(path, 2) is None
  assert open(path, "rb").read() == b'{"step": 1}\n{"step": 2}\n'
  assert runlog.last_step(path) == 2


# -- the lock ---------------------------------------------------------------------------------------

LOCKER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from ripples_jax.runlog.workdir import WorkdirLock
for line in sys.stdin:
  path, start = line.split()
  while time.time() < float(start):  # every contender starts at the same instant
    pass
  lock = WorkdirLock(path)
  try:
    lock.acquire()
    print("held", flush=True)
  except Exception as e:
    print("refused", flush=True)
  sys.stdin.readline()  # hold it until every contender has tried
  lock.release()
  print("released", flush=True)
"""


@pytest.mark.slow
def test_concurrent_stale_lock_takeovers_never_make_two_holders(tmp_path):
  """Three processes race to take over the same stale lock (a dead pid of this host), 300 times; each
  holds what it got until all have tried. Exactly one holds it every time."""
  trials, n = 300, 3
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", LOCKER, ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    for _ in range(n)
  ]
  holders = []
  try:
    for t in range(trials):
      wd = tmp_path / str(t)
      wd.mkdir()
      (wd / ".lock").write_text(f"999999999 {socket.gethostname()} 2026-01-01T00:00:00\n")
      start = time.time() + 0.02
      for p in procs:
        p.stdin.write(f"{wd} {start}\n")
        p.stdin.flush()
      got = [p.stdout.readline().strip() for p in procs]
      holders.append(got.count("held"))
      for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
      assert all(p.stdout.readline().strip() == "released" for p in procs)
  finally:
    for p in procs:
      p.stdin.close()
      p.wait(timeout=30)
  assert holders == [1] * trials, {k: holders.count(k) for k in set(holders)}


def test_a_lock_is_exclusive_within_one_process_too(tmp_path):
  a, b = workdir_lib.WorkdirLock(str(tmp_path)), workdir_lib.WorkdirLock(str(tmp_path))
  a.acquire()
  with pytest.raises(ConfigError, match=rf"in use by pid {os.getpid()} "):
    b.acquire()
  a.release()
  b.acquire()
  b.release()
  assert not os.path.exists(tmp_path / ".lock")


def test_an_empty_lock_nobody_holds_is_taken_over(tmp_path, caplog):
  (tmp_path / ".lock").write_text("")  # what a full disk left behind before the flock
  lock = workdir_lib.WorkdirLock(str(tmp_path))
  lock.acquire()
  assert (tmp_path / ".lock").read_text().startswith(f"{os.getpid()} ")
  lock.release()
  (tmp_path / ".lock").write_text("\x00\x00 half")
  lock.acquire()
  lock.release()
  assert any("unreadable lock nobody holds" in r.getMessage() for r in caplog.records)


def small_tmpfs(path, size="64k"):
  """A tiny tmpfs at `path` (root only), or skip."""
  os.makedirs(path, exist_ok=True)
  if subprocess.run(
    ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
  ).returncode:
    pytest.skip("needs root (mount) for a small tmpfs")


def test_a_full_disk_while_taking_the_lock_leaves_no_unusable_lock(tmp_path):
  disk = str(tmp_path / "disk")
  small_tmpfs(disk)
  try:
    filler = os.path.join(disk, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
      while os.write(fd, b"x" * 512):
        pass
    except OSError:  # ENOSPC: the disk is full
      pass
    os.close(fd)
    lock = workdir_lib.WorkdirLock(disk)
    with pytest.raises(runlog.StorageError, match=r"\.lock: No space left on device; nothing of the run"):
      lock.acquire()
    assert not os.path.exists(os.path.join(disk, ".lock"))
    os.remove(filler)  # space again: the next run takes the lock at once
    lock.acquire()
    lock.release()
  finally:
    subprocess.run(["umount", "-l", disk])


# -- the multi-process agreement (protocol; the real runs are in test_resume_multiprocess.py) ---------


class FakeLog:
  """RunLog's resume interface over a dict of this process's steps (True: reads back)."""

  def __init__(self, steps: dict):
    self.steps, self.workdir, self.ckpt_dir, self.identity = dict(steps), "wd", "wd/ckpt/p", {}
    self.deleted, self.set_aside_steps, self.tried, self.outcome = [], [], [], None

  def committed(self):
    return sorted(self.steps, reverse=True)

  def try_restore(self, step, like):
    self.tried.append(step)
    return ({"w": step}, {"cursor": step}) if self.steps[step] else "ValueError: corrupt"

  def resume_from(self, step, state, meta, unusable=()):
    self.deleted = [s for s in unusable if s > step]
    self.set_aside_steps = [s for s in self.committed() if s > step and s not in self.deleted]
    self.outcome = step
    return step, state, meta["cursor"]

  def saved_identity(self, step):
    return {}

  def start_fresh(self):
    self.outcome = "fresh"


def agree(logs, resumable=True):
  kv, out = FakeKV(), {}

  def one(w):
    try:
      out[w] = resume_lib.restore_common(logs[w], kv, w, len(logs), None, 10.0, resumable=resumable)
    except ResumeRefused as e:
      out[w] = e

  threads = [threading.Thread(target=one, args=(w,)) for w in range(len(logs))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  return [out[w] for w in range(len(logs))]


def test_a_worker_whose_newest_marker_is_corrupt_makes_all_fall_back_to_an_older_common_one():
  logs = [
    FakeLog({1: True, 2: True, 3: True}),
    FakeLog({1: True, 2: True}),
    FakeLog({1: True, 2: False}),
    FakeLog({1: True, 2: True, 3: True}),
  ]
  got = agree(logs)
  assert [g[0] for g in got] == [1, 1, 1, 1]
  assert [log.tried for log in logs] == [[2, 1]] * 4  # 3 is not common: never tried
  # Only worker 2 deletes, and only its own marker 2 that it tried and found unusable; the others'
  # newer good markers are set aside, never deleted.
  assert [log.deleted for log in logs] == [[], [], [2], []]
  assert [log.set_aside_steps for log in logs] == [[3, 2], [2], [], [3, 2]]


def test_markers_but_none_common_refuses_everywhere_and_no_markers_is_a_fresh_start():
  logs = [FakeLog({5: True}), FakeLog({})]
  got = agree(logs)
  assert all(isinstance(g, ResumeRefused) for g in got), got
  assert "no checkpoint every process can restore (process 0: [5]; process 1: none)" in str(got[0])
  assert [log.deleted + log.set_aside_steps for log in logs] == [[], []] and logs[0].outcome is None
  logs = [FakeLog({}), FakeLog({})]
  assert agree(logs) == [None, None] and [log.outcome for log in logs] == ["fresh", "fresh"]


def test_an_executor_without_markers_refuses_a_workdir_holding_checkpoints():
  logs = [FakeLog({}), FakeLog({9: True})]
  got = agree(logs, resumable=False)
  assert all(
    isinstance(g, ResumeRefused) and "does not resume from them; nothing was deleted" in str(g) for g in got
  ), got


def test_a_good_checkpoint_newer_than_the_agreed_one_is_set_aside_byte_for_byte(tmp_path):
  """What a process does when the others cannot restore its newest checkpoint: it resumes from the
  older one every process restores, and keeps the newer one outside the manager's folder."""
  wd = str(tmp_path)
  saved(wd, steps=(10, 20, 30), checkpoint_keep=3)
  newest = tree_digest(os.path.join(wd, "ckpt", "30"))
  with RunLog(wd, config(checkpoint_keep=3), 100, progress=False, tensorboard=False) as log:
    step, state, cursor = log.resume_from(20, *log.try_restore(20, {"w": jnp.zeros(4)}))
    assert step == 20 and cursor == {"round": 20} and log.committed() == [20, 10]
  assert sorted(os.listdir(os.path.join(wd, "ckpt"))) == ["10", "20"]
  assert tree_digest(os.path.join(wd, "ckpt.superseded", "30")) == newest

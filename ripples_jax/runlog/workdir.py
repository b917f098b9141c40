"""A run's folder: where it is, which run it holds (identity), and who holds it now (the lock).

Identity: every checkpoint's metadata stores the config's identity (every key but IDENTITY_FREE). A
run resumes in a workdir only when the identity of every checkpoint layout found there is its own;
otherwise make_workdir refuses with one line naming the differing keys (on_config_change="new": a
fresh subfolder; "force": resume anyway). Both layouts are read: ckpt/<step>/ (one manager over every
process: spmd, sim, the single-process pipeline) and ckpt/<process>/<step>/ (each process alone: the
asynchronous runtime's markers, the per-process pipeline's ticks). Nothing here deletes a file.

Lock: WORKDIR/.lock, held with flock(2) for the run's life by the lead process and holding
"pid host start-time". The kernel drops a flock when its holder dies, so a stale lock is one nobody
holds: taking it over is the same atomic flock every acquire does, and two processes can never both
hold it (a remove-then-create takeover can: tests/test_workdir.py races hundreds of takeovers). The
file is only written while locked and emptied again when a write fails (a full disk), so no state of it
blocks later runs. A lock that names another host is refused (flock may not reach across hosts on a
network file system; that host's pid cannot be checked from here).
"""

import fcntl
import json
import os
import socket
import time

import jax
from absl import logging

from ripples_jax.errors import ON_CONFIG_CHANGE, ConfigError, StorageError

# Keys a resumed run may change without becoming another run: logging, evaluation and checkpoint
# cadence, where data is read from, and the runtime's failure detection. num_steps is not among them:
# it sets the learning-rate schedule's horizon, so a longer run is a different run.
IDENTITY_FREE = (
  "log_every",
  "eval_every",
  "checkpoint_every",
  "checkpoint_keep",
  "data_dir",
  "target_accuracy",
  "runtime.heartbeat_s",
  "runtime.heartbeat_timeout",
  "runtime.stall_timeout",
  "runtime.checkpoint_keep",
  "runtime.checkpoint_every",
  "runtime.cache_size",
  "runtime.fail_worker",
  "runtime.fail_step",
  "runtime.fail_stage",
  "runtime.fail_tick",
  "runtime.pin_cores",
  "on_config_change",
  "profile_steps",
  "stuck_timeout_s",
)


def flat_config(config) -> dict:
  """The config as {dotted key: value}, sorted by key."""
  flat = {}

  def walk(prefix, d):
    for k, v in d.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}.", v)
      else:
        flat[prefix + k] = v

  walk("", config.to_dict())
  return dict(sorted(flat.items()))


def identity(config) -> dict:
  """The config as flat {dotted key: JSON value}, without the keys a resume may change."""
  return json.loads(
    json.dumps({k: v for k, v in flat_config(config).items() if k not in IDENTITY_FREE}, default=str)
  )


def differences(saved: dict, now: dict) -> list[str]:
  return [
    f"{k} {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}"
    for k in sorted(set(saved) | set(now))
    if saved.get(k, "<unset>") != now.get(k, "<unset>")
  ]


def make_workdir(workdir: str | None, config=None) -> str:
  """The run's folder: the given one, or a fresh timestamped folder under runs/ (one process only).

  With `config`, a workdir whose checkpoints hold another run (another config identity) is refused
  with one line, or per config.on_config_change: "new" runs in a fresh subfolder run-<k>, "force"
  resumes anyway (the earlier config.json is kept as config.<k>.json).
  """
  if workdir is None and jax.process_count() > 1:
    raise ConfigError("--workdir: None is not allowed with several processes: a folder every process sees")
  if not workdir:
    workdir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    base, k = workdir, 1
    while os.path.exists(workdir):
      workdir, k = f"{base}-{k}", k + 1
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir: {workdir!r} is not allowed: it is a file, not a folder")
  if config is not None:
    workdir = _check_identity(workdir, config)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--workdir: {workdir!r} is not allowed: {e.strerror}") from None
  if not os.access(workdir, os.W_OK):
    raise ConfigError(f"--workdir: {workdir!r} is not allowed: not writable")
  return workdir


def _steps(folder: str) -> list[int]:
  """The committed step folders in `folder` (orbax names a step's folder by its number once its write
  has committed), newest first."""
  try:
    return sorted((int(d) for d in os.listdir(folder) if d.isdigit()), reverse=True)
  except OSError:
    return []


def _newest_meta_in(folder: str):
  """(path, metadata) of the newest step in `folder` whose metadata reads, or None."""
  for step in _steps(folder):
    path = os.path.join(folder, str(step))
    try:
      with open(os.path.join(path, "meta", "metadata")) as f:
        return path, json.load(f)
    except (OSError, ValueError):
      continue
  return None


def checkpoint_metas(workdir: str) -> list[tuple[str, dict]]:
  """(path, metadata) of the newest readable checkpoint of each layout in the workdir: ckpt/<step>/,
  and ckpt/<process>/<step>/ for every process folder (a folder of step folders, not a step)."""
  ckpt = os.path.join(workdir, "ckpt")
  found = []
  top = _newest_meta_in(ckpt)
  if top is not None:
    found.append(top)
  for d in _steps(ckpt):
    folder = os.path.join(ckpt, str(d))
    if not os.path.isdir(os.path.join(folder, "meta")) and (got := _newest_meta_in(folder)) is not None:
      found.append(got)
  return found


def newest_meta(workdir: str):
  """(path, metadata) of the newest readable checkpoint of any layout, or None."""
  found = checkpoint_metas(workdir)
  return found[0] if found else None


def _check_identity(workdir: str, config) -> str:
  found = checkpoint_metas(workdir)
  if not found:
    return workdir
  mode = config.get("on_config_change", "refuse")
  if mode not in ON_CONFIG_CHANGE:
    raise ConfigError(
      f"config.on_config_change: {mode!r} is not allowed: one of {', '.join(ON_CONFIG_CHANGE)}"
    )
  now = identity(config)
  for where, meta in found:
    if "identity" not in meta:
      raise ConfigError(
        f"--workdir: {workdir!r} is not allowed: {where} was written by an older version "
        "(no run identity); resume it with that version, or use another --workdir"
      )
  diffs = [(where, differences(meta["identity"], now)) for where, meta in found]
  diffs = [(where, d) for where, d in diffs if d]
  if not diffs:
    return workdir
  where, diff = diffs[0]
  if mode == "force":
    logging.warning("resuming %s with a changed config (on_config_change=force): %s", where, "; ".join(diff))
    return workdir
  if mode == "new":
    if jax.process_count() > 1:
      raise ConfigError(
        "config.on_config_change: 'new' is not allowed with several processes: give a new --workdir"
      )
    k = 1
    while os.path.exists(os.path.join(workdir, f"run-{k}")):
      k += 1
    logging.warning("%s holds another run (%s): starting in %s/run-%d", workdir, "; ".join(diff), workdir, k)
    return _check_identity(os.path.join(workdir, f"run-{k}"), config)
  raise ConfigError(
    f"--workdir: {workdir!r} is not allowed: its checkpoint {where} is another run "
    f"({'; '.join(diff)}); nothing was changed in it; rerun with that config, another "
    "--workdir, or --config.on_config_change=new (a fresh subfolder) or force (resume anyway)"
  )


class WorkdirLock:
  """WORKDIR/.lock: flock(2) held for the run's life, the file holding "pid host start-time"."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, ".lock")
    self.fd = None

  @property
  def held(self) -> bool:
    return self.fd is not None

  def acquire(self) -> None:
    me = f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
    fd = self._lock_the_file()
    holder = _holder(_read(fd))
    if holder is not None and (holder[1] != socket.gethostname() or _alive(holder[0])):
      # Another host's run (its flock may not reach here), or one of a version before the flock: its
      # file is left as it is.
      os.close(fd)
      raise ConfigError(self._in_use(holder))
    if holder is not None:
      logging.warning("%s: taking over a stale lock of pid %d (no longer running)", self.path, holder[0])
    elif os.fstat(fd).st_size:
      logging.warning("%s: taking over an unreadable lock nobody holds", self.path)
    try:
      os.ftruncate(fd, 0)
      os.pwrite(fd, me.encode(), 0)
      os.fsync(fd)
    except OSError as e:
      # Never a half-written holder left behind: the file goes (the flock is still ours).
      self._unlink_and_close(fd)
      raise StorageError(
        f"{self.path}: {e.strerror}; nothing of the run was changed; free space and run "
        "the same command again"
      ) from None
    self.fd = fd

  def _lock_the_file(self) -> int:
    """An fd of .lock holding its flock. A release unlinks the file while still holding the flock, so
    a flock won on a file that is no longer the one at the path is dropped and tried again."""
    while True:
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      except OSError as e:
        raise StorageError(f"{self.path}: {e.strerror}; nothing of the run was changed") from None
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _holder(_read(fd))
        os.close(fd)
        raise ConfigError(self._in_use(holder)) from None
      try:
        same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if same:
        return fd
      os.close(fd)

  def _in_use(self, holder) -> str:
    who = f"pid {holder[0]} on {holder[1]} since {holder[2]}" if holder else "another process (starting)"
    return (
      f"--workdir: {os.path.dirname(self.path)!r} is not allowed: it is in use by {who} (one run per "
      f"workdir; if that run is gone, delete {self.path})"
    )

  def _unlink_and_close(self, fd: int) -> None:
    try:
      os.remove(self.path)  # while holding the flock: no one can have won it on this file since
    except OSError:
      pass
    os.close(fd)

  def release(self) -> None:
    if self.fd is not None:
      fd, self.fd = self.fd, None
      self._unlink_and_close(fd)


def _read(fd: int) -> str:
  try:
    return os.pread(fd, 256, 0).decode(errors="replace")
  except OSError:
    return ""


def _holder(text: str):
  try:
    pid, host, since = text.split()[:3]
    return int(pid), host, since
  except ValueError:
    return None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True

"""Writes the disk refuses (full, read-only, no permission), told apart from other failures; and
durable writes: a temporary file fsynced, renamed over the target, the directory fsynced, so a crash
or a full disk leaves the old file or the new one, never a torn one (and no temporary behind)."""

import errno
import os
import re

_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))  # the reasons that more space fixes


def tensorstore_os_error(message: str) -> tuple[str | None, int] | None:
  """(path, errno) from a tensorstore/orbax I/O error message (`... [os_error_code='28']`), or None."""
  code = re.search(r"\[os_error_code='?(\d+)'?\]", message)
  if code is None:
    return None
  paths = re.findall(r'(?:Failed writing|Error writing|local file|file): "([^"]+)"', message)
  return (paths[-1] if paths else None), int(code.group(1))


def storage_failure(e: Exception) -> str | None:
  """The reason, when `e` means the disk refused a write (orbax reports ENOSPC as a ValueError)."""
  code = e.errno if isinstance(e, OSError) else (tensorstore_os_error(str(e)) or (None, None))[1]
  return os.strerror(code) if code in _STORAGE_ERRNOS else None


def fsync_dir(path: str) -> None:
  """Makes a rename in `path` durable (POSIX: the directory entry is the directory's data)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def durable_write(path: str, write, mode: str = "wb") -> None:
  """write(f) into path.tmp, fsynced, renamed over `path`, its directory fsynced; on any failure the
  temporary file is removed and the error raised (the old file, if any, untouched)."""
  tmp = f"{path}.tmp"
  try:
    with open(tmp, mode) as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  fsync_dir(os.path.dirname(path) or ".")


def save_array(path: str, array) -> None:
  """np.save, durably (durable_write): a snapshot is whole or absent."""
  import numpy as np

  durable_write(path, lambda f: np.save(f, np.asarray(array)))

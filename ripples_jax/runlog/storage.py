"""Writes the disk refuses (full, read-only, no permission), told apart from other failures."""

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

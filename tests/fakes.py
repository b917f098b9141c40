"""Small stand-ins and process helpers shared by the tests (no jax import: the launcher's stand-in
worker imports this)."""


class FakeKV:
  """The coordination service's key-value store, in memory."""

  def __init__(self):
    self.store = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.store[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


def exited(pid: int) -> bool:
  """The process is gone or a zombie (dead, not yet reaped)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except FileNotFoundError:
    return True

"""Small stand-ins shared by the tests (no jax import: the launcher's stand-in worker uses them)."""


class FakeKV:
  """The coordination service's key-value store, in memory."""

  def __init__(self):
    self.store = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.store[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

"""Small stand-ins and process helpers shared by the tests (no jax import: the launcher's stand-in
worker imports this)."""

import os


class FakeKV:
  """The coordination service's key-value store, in memory, thread-safe, with blocking gets."""

  def __init__(self, processes: int = 1):
    import threading

    self.store = {}
    self.cond = threading.Condition()
    self.processes, self.barriers = processes, {}

  def wait_at_barrier(self, name, timeout_ms):
    """Every one of `processes` threads calls it once per name."""
    import threading

    with self.cond:
      barrier = self.barriers.setdefault(name, threading.Barrier(self.processes))
    barrier.wait(timeout_ms / 1000)

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.cond:
      if key in self.store and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.store[key] = value
      self.cond.notify_all()

  def key_value_increment(self, key, delta):
    with self.cond:
      self.store[key] = str(int(self.store.get(key, "0")) + delta)
      self.cond.notify_all()
      return int(self.store[key])

  def key_value_delete(self, key):
    """The key and, as the coordination service does, every key in its directory (key/...)."""
    with self.cond:
      for k in [k for k in self.store if k == key or k.startswith(f"{key}/")]:
        del self.store[k]

  def key_value_try_get(self, key):
    with self.cond:
      if key not in self.store:
        raise RuntimeError(f"NOT_FOUND: {key}")
      return self.store[key]

  def key_value_dir_get(self, prefix):
    with self.cond:
      return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

  def blocking_key_value_get(self, key, timeout_ms):
    with self.cond:
      if not self.cond.wait_for(lambda: key in self.store, timeout_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.store[key]


def exited(pid: int) -> bool:
  """The process is gone or a zombie (dead, not yet reaped)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except FileNotFoundError:
    return True


def start_directly(n, module, args, coordinator=False):
  """n processes of `module` without the launcher (as on a cluster): nothing stops a hung one. With
  `coordinator` (an executor=async run), n workers and the coordinator first: n + 1 processes."""
  from ripples_jax.distributed.launcher import free_port, start_worker

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  address = f"127.0.0.1:{free_port()}"
  total = n + int(coordinator)
  return [
    start_worker(
      k, total, module, args, address, cwd=root, launched=False, text=True, coordinator=coordinator
    )
    for k in range(total)
  ]

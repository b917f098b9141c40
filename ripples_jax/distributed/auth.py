"""The run's identity in the coordination store: every value the runtime writes carries a MAC.

Anyone who can reach the coordinator's port can read and write jax's key-value store (docs/usage.md,
Security). The launcher makes a run secret (or takes the user's: RIPPLES_RUN_SECRET, or --secret_file
on a cluster) and hands it to its workers in their environment; it is never written to the store.
Every value a process writes through `client()` is stored as `value#mac`, mac = HMAC-SHA256(secret,
run id, key, value) (32 hex digits); every value read back is checked and stripped. A value without
this run's MAC (a stranger's, another run's on the same port, a junk byte) is dropped with one warning
naming its key (wire.bad: once per key family): a directory read leaves it out, a blocking read
looks past it until one of this run's values is there (or times out as the store does), a single
read returns "" (which every wire decoder refuses), and a write that finds its key squatted by such a
value deletes it and writes its own. The run id is the
coordinator's address: two runs with one secret file on two ports refuse each other's values too.

Not covered (docs/usage.md says what to do): the store's counters (key_value_increment holds no MAC:
a stranger can take a join slot, which the authority skips once it stays empty), reads (a stranger
still sees the keys), jax's own task registration and gloo's tensors (a private network or a
firewall rule on the coordinator's and gloo's ports).

Without a secret in the environment (a process not started by the launcher) values are written and
read bare, so a run whose processes all lack it still runs; a bare value is refused by a process that
has one, and the other way round.
"""

import hashlib
import hmac
import os
import secrets
import time

from ripples_jax.distributed import wire

SECRET_ENV = "RIPPLES_RUN_SECRET"
RUN_ID_ENV = "RIPPLES_RUN_ID"
SEP = "#"
MAC_HEX = 32
_POLL_S = 0.05  # a blocking read that found a squatter looks again this often


def new_secret() -> str:
  return secrets.token_hex(32)


def read_secret(path: str) -> str:
  """A run secret from a file (a cluster's nodes share it): its first line, at least 16 characters."""
  try:
    text = open(path).read().strip()
  except OSError as e:
    raise ValueError(f"--secret_file={path}: cannot read it ({e.strerror})") from None
  if len(text) < 16 or "\n" in text:
    raise ValueError(
      f"--secret_file={path}: one line of at least 16 characters (e.g. `openssl rand -hex 32`)"
    )
  return text


def run_secret(nnodes: int = 1, secret_file: str = "", env=None) -> str:
  """The launcher's run secret: RIPPLES_RUN_SECRET, else --secret_file's line, else (one node) a fresh
  one. A job over several nodes needs the same secret on every node: without one, ValueError (one
  line) before anything starts."""
  env = os.environ if env is None else env
  if env.get(SECRET_ENV):
    return env[SECRET_ENV]
  if secret_file:
    return read_secret(secret_file)
  if nnodes > 1:
    raise ValueError(
      f"--nnodes={nnodes} needs one run secret on every node: --secret_file=FILE (one line, e.g. "
      f"`openssl rand -hex 32 > FILE`, copied to every node) or {SECRET_ENV} in each launcher's environment"
    )
  return new_secret()


def mac(secret: str, run_id: str, key: str, value: str) -> str:
  msg = "\0".join((run_id, key, value)).encode()
  return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()[:MAC_HEX]


def _squatted(e: Exception) -> bool:
  return "ALREADY_EXISTS" in str(e) or "already exists" in str(e).lower()


class SignedKV:
  """jax's coordination client with a MAC on every value (module docstring); other calls pass
  through (key_value_increment, key_value_delete, barriers)."""

  def __init__(self, raw, secret: str, run_id: str):
    self.raw, self.secret, self.run_id = raw, secret, run_id

  def __getattr__(self, name):
    return getattr(self.raw, name)

  def sign(self, key: str, value: str) -> str:
    return f"{value}{SEP}{mac(self.secret, self.run_id, key, value)}"

  def open(self, key: str, stored) -> str | None:
    """The value under its MAC, or None (one warning) for a value this run did not write."""
    value, sep, tag = str(stored).rpartition(SEP)
    if sep and len(tag) == MAC_HEX and hmac.compare_digest(tag, mac(self.secret, self.run_id, key, value)):
      return value
    return wire.bad(key, stored, "no valid MAC of this run (a stranger's or another run's value)")

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False):
    signed = self.sign(key, value)
    try:
      return self.raw.key_value_set(key, signed, allow_overwrite=allow_overwrite)
    except Exception as e:  # noqa: BLE001 - only a squatted key is handled; anything else is raised
      if not _squatted(e) or self._holds_own(key):
        raise
    # The key holds a value this run did not write (it would block the real one for good): replace it.
    self.raw.key_value_delete(key)
    return self.raw.key_value_set(key, signed, allow_overwrite=allow_overwrite)

  def _holds_own(self, key: str) -> bool:
    try:
      stored = self.raw.key_value_try_get(key)
    except Exception:  # noqa: BLE001 - gone since: not squatted
      return False
    return self.open(key, stored) is not None

  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
    """The key's value once one of this run's is there: a squatter's is looked past (this run's
    writer replaces it) until the timeout, which raises as the store's own does (DEADLINE_EXCEEDED)."""
    deadline = time.monotonic() + timeout_in_ms / 1000
    got = self.open(key, self.raw.blocking_key_value_get(key, timeout_in_ms))
    while got is None:
      left = deadline - time.monotonic()
      if left <= 0:
        raise TimeoutError(f"DEADLINE_EXCEEDED: {key} holds no value of this run")
      time.sleep(min(_POLL_S, left))
      try:
        got = self.open(key, self.raw.key_value_try_get(key))
      except Exception:  # noqa: BLE001 - deleted meanwhile (being replaced): wait for the new one
        got = self.open(key, self.raw.blocking_key_value_get(key, max(1, int(left * 1000))))
    return got

  def key_value_try_get(self, key: str) -> str:
    got = self.open(key, self.raw.key_value_try_get(key))
    return "" if got is None else got

  def key_value_dir_get(self, key: str) -> list:
    out = []
    for k, stored in self.raw.key_value_dir_get(key):
      value = self.open(k, stored)
      if value is not None:
        out.append((k, value))
    return out


def signed(raw, env=None):
  """`raw` wrapped in SignedKV when the environment holds a run secret; else `raw` itself."""
  env = os.environ if env is None else env
  secret = env.get(SECRET_ENV)
  return SignedKV(raw, secret, env.get(RUN_ID_ENV, "")) if secret else raw

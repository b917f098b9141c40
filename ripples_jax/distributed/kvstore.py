"""The coordination service's key-value store: its client, the agreed step-time estimates, and values
read in order (the runtime's transport), paged so that one delete call removes a page."""

import logging
import threading
import time

PREFIX = "ripples"
WARMUP = "warmup"  # publish_estimate's block of the workers' warm-up step times (the authority's first plan)


_signed: dict = {}  # id(raw client) -> (raw, its SignedKV): one wrapper per client


def client():
  """The coordination-service client jax.distributed set up, every value it writes and reads under
  this run's MAC when the launcher gave the process a secret (distributed/auth.py)."""
  from jax._src import distributed

  from ripples_jax.distributed import auth

  raw = distributed.global_state.client
  if raw is None:
    raise RuntimeError("executor=async needs jax.distributed.initialize() first (--jax_distributed)")
  if id(raw) not in _signed or _signed[id(raw)][0] is not raw:
    _signed.clear()
    _signed[id(raw)] = (raw, auth.signed(Retrying(raw)))
  return _signed[id(raw)][1]


# -- transient store errors ------------------------------------------------------------------------

RETRY_WINDOW_S = 30.0  # how long a call is retried across a store that does not answer (2 x 15 s default)
_TRANSIENT = ("UNAVAILABLE", "Connection reset", "Socket closed", "failed to connect", "Broken pipe")


def transient(e: Exception) -> bool:
  """A store error that a retry can outlast (the service unreachable for a moment); a timeout, a
  missing key or an existing one is an answer, not an outage."""
  return any(t in str(e) for t in _TRANSIENT)


class Retrying:
  """jax's coordination client whose calls are retried with backoff (0.05 s doubling to 2 s) across a
  transient error for up to `window_s` (RETRY_WINDOW_S), one warning per outage and one when it ends;
  past the window the error is raised (the watchdog then names the lost coordinator). A counter's
  increment retried after an outage that did apply it takes one value more: a join slot left empty,
  which the authority skips (values_in_order's skip)."""

  def __init__(self, raw, window_s: float | None = None, sleep=time.sleep):
    self.raw, self.window_s, self.sleep = raw, window_s, sleep

  def __getattr__(self, name):
    attr = getattr(self.raw, name)
    if not callable(attr) or not name.startswith(("key_value", "blocking_key_value", "wait_at_barrier")):
      return attr
    return lambda *a, **kw: self._call(name, attr, a, kw)

  def _call(self, name, fn, args, kwargs):
    window = RETRY_WINDOW_S if self.window_s is None else self.window_s
    start, delay, warned = time.monotonic(), 0.05, False
    while True:
      try:
        out = fn(*args, **kwargs)
      except Exception as e:  # noqa: BLE001 - only a transient error is retried; the rest is raised
        if not transient(e) or time.monotonic() - start + delay > window:
          raise
        if not warned:
          warned = True
          logging.warning(
            "coordination store: %s failed (%s); retrying for up to %.0f s", name, str(e)[:120], window
          )
        self.sleep(delay)
        delay = min(2 * delay, 2.0)
        continue
      if warned:
        logging.warning("coordination store: %s answered again after %.1f s", name, time.monotonic() - start)
      return out


def publish_estimate(kv, block: int, worker: int, seconds: float) -> None:
  # repr round-trips a float exactly, so every process plans with bit-identical numbers.
  kv.key_value_set(f"{PREFIX}/est/{block}/{worker}", repr(float(seconds)), allow_overwrite=True)


def fetch_estimates(kv, block: int, num_workers: int, timeout_s: float) -> list[float]:
  """The workers' published step times (seconds > 0); a malformed one is left out (one warning)."""
  from ripples_jax.distributed import wire

  keys = [f"{PREFIX}/est/{block}/{w}" for w in range(num_workers)]
  got = [wire.seconds(k, kv.blocking_key_value_get(k, int(timeout_s * 1000))) for k in keys]
  return wire.require([s for s in got if s is not None and s > 0] or None, f"{PREFIX}/est/{block}")


# -- values in order through the key-value store (the runtime's transport) ------------------------

_GET_MS = 1000  # blocking gets wake this often to see whether the run is over
PAGE = 8  # queue batches (requests) per store directory: one delete call removes a page


def paged(prefix: str, j: int) -> str:
  """The key of the j-th value under `prefix`, in its page's directory."""
  return f"{prefix}/{j // PAGE}/{j}"


def _is_timeout(e: Exception) -> bool:
  text = str(e)
  return "DEADLINE_EXCEEDED" in text or "NOT_FOUND" in text or "timed out" in text.lower()


class Either:
  """Set when either event is (the run's stop, or one listener's own)."""

  def __init__(self, a: threading.Event, b: threading.Event):
    self.a, self.b = a, b

  def is_set(self) -> bool:
    return self.a.is_set() or self.b.is_set()


def values_in_order(
  kv,
  prefix: str,
  stop: threading.Event | None = None,
  page: bool = False,
  skip: tuple | None = None,
  consume: bool = False,
):
  """The values of <prefix>/0, <prefix>/1, ... (with `page`: paged(prefix, j)) as each is set, until
  `stop` is set: blocking gets that wake every _GET_MS to look at it. Any other error of the service
  (it is gone) is raised. skip = (counter key, bound s): slots taken by incrementing the counter; a
  slot still empty (or holding no value of this run) `bound` s after it was first looked at, while a
  later slot is taken, yields None and the next is read (a slot taken and never written, by a process
  killed between the two or by a stranger, would otherwise block every later one for good).
  consume: the reader is the key's only one: each key is deleted once the caller has taken its value
  (the store then holds O(1) keys per channel, not one per value ever sent)."""
  j, since = 0, None
  while stop is None or not stop.is_set():
    key = paged(prefix, j) if page else f"{prefix}/{j}"
    try:
      value = kv.blocking_key_value_get(key, _GET_MS)
    except Exception as e:  # noqa: BLE001
      if not _is_timeout(e):
        raise
      since = since if since is not None else time.monotonic()
      if (
        skip is None or time.monotonic() - since < skip[1] or int(kv.key_value_increment(skip[0], 0)) <= j + 1
      ):
        continue
      value = None
    yield value
    if consume and value is not None:
      kv.key_value_delete(key)
    j, since = j + 1, None

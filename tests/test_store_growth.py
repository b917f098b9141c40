"""Bounded store state: a channel's reader deletes each value it took, a rejoin leaves no join keys
behind, and the coordinator's growth sample counts the store's keys (benchmarks/bench_growth.py)."""

import itertools
import os
import time

import pytest

from ripples_jax.distributed import coord, kvstore
from ripples_jax.runtime import coordinator, membership
from tests.fakes import FakeKV
from tests.test_elastic import authority_after_a_leave

P = coord.PREFIX


def test_a_consuming_reader_leaves_no_key_behind_and_a_plain_one_leaves_every_key():
  kv = FakeKV()
  for r in range(50):
    kv.key_value_set(f"{P}/ch/0.0-1.0/{r}", "a")
  got = list(itertools.islice(kvstore.values_in_order(kv, f"{P}/ch/0.0-1.0", consume=True), 50))
  assert got == ["a"] * 50
  # Each key deleted once the reader moved past it: the 50th goes when the next value is asked for.
  assert [k for k in kv.store if "/ch/" in k] == [f"{P}/ch/0.0-1.0/49"]
  kv.key_value_set(f"{P}/q/0", "b")
  assert next(kvstore.values_in_order(kv, f"{P}/q")) == "b" and f"{P}/q/0" in kv.store


def test_a_rejoin_leaves_no_join_or_answer_key_and_the_growth_sample_counts_keys():
  kv = FakeKV()
  service, authority = authority_after_a_leave(kv)
  try:
    assert membership.ask_to_join(kv, 1, 5.0)["inc"] == 1
    deadline = time.monotonic() + 5
    while any("/join/" in k for k in kv.store) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert not [k for k in kv.store if "/join/" in k or "/joined/" in k], sorted(kv.store)
  finally:
    authority.stop()
  sample = coordinator.growth_sample(kv, 1.0)
  assert sample["keys"] == len([k for k in kv.store if k.startswith(f"{P}/")]) > 0
  assert sample["rss_mb"] > 1 and abs(sample["fds"] - len(os.listdir("/proc/self/fd"))) <= 2


class _Flaky(FakeKV):
  """A store that is unreachable for its first `down` calls."""

  def __init__(self, down: int):
    super().__init__()
    self.down, self.calls = down, 0

  def key_value_set(self, key, value, allow_overwrite=False):
    self.calls += 1
    if self.calls <= self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
    return super().key_value_set(key, value, allow_overwrite)


def test_a_transient_store_error_is_retried_with_backoff_and_one_past_the_window_is_raised(caplog):
  import logging

  slept = []
  kv = kvstore.Retrying(_Flaky(down=4), window_s=10.0, sleep=slept.append)
  with caplog.at_level(logging.WARNING):
    kv.key_value_set(f"{P}/x", "1")
  assert kv.raw.store[f"{P}/x"] == "1" and slept == [0.05, 0.1, 0.2, 0.4]
  assert [r.getMessage().split(" failed")[0] for r in caplog.records][:1] == [
    "coordination store: key_value_set"
  ]
  assert "answered again" in caplog.records[-1].getMessage() and len(caplog.records) == 2
  with pytest.raises(RuntimeError, match="ALREADY_EXISTS"):  # an answer, not an outage: not retried
    kv.key_value_set(f"{P}/x", "2")
  stuck = kvstore.Retrying(_Flaky(down=10**6), window_s=1.0, sleep=lambda s: None)
  with pytest.raises(RuntimeError, match="UNAVAILABLE"):
    stuck.key_value_set(f"{P}/y", "1")


def test_the_growth_sample_counts_every_key_and_warns_of_none(caplog):
  """Under the run's MAC a counter (no MAC) would read as a stranger's value: the sample counts the
  store's own listing, counters included, with no warning."""
  import logging

  from ripples_jax.distributed import auth

  raw = FakeKV()
  kv = auth.SignedKV(raw, "s" * 32, "127.0.0.1:1")
  kv.key_value_set(f"{P}/hb/0", "1 2 3 0")
  raw.key_value_increment(membership.JOINS, 1)
  with caplog.at_level(logging.WARNING):
    assert coordinator.growth_sample(kv, 0.0)["keys"] == 2
  assert not caplog.records

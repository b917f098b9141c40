"""Red team, in process (a FakeKV store): what a stray or malformed entry in the coordination store
does to a run. Each one is dropped with one warning naming its key and the run goes on: no watchdog
blinded or ended, no listener thread ended, no worker's membership or the run's budget steered."""

import json
import logging
import time

import pytest

from ripples_jax.distributed import coord, kvstore, resume, wire
from ripples_jax.runtime import membership
from ripples_jax.runtime.authority import Authority, Feed
from ripples_jax.schedule.online import encode
from tests.fakes import FakeKV
from tests.test_elastic import authority_after_a_leave, service_for

P = coord.PREFIX


@pytest.fixture(autouse=True)
def _fresh_warnings():
  wire._warned.clear()


def test_junk_heartbeat_keys_and_values_neither_blind_nor_end_the_watchdogs(caplog):
  """hb/x (not a worker), hb/-1 (negative: once Python's last worker), hb/7 (out of range), hb/2.x and
  a 3-field value: the three watchdogs go on for 8 s (past their 5 s timeout) with no exit, then name
  worker 2, silent, as lost; not 'lost contact with the coordination service'."""
  kv, logs, exits = FakeKV(), [], []
  for key, value in (
    ("x", "1 2 3 0"),
    ("-1", "1 2 3 0"),
    ("7", "1 2 3 0"),
    ("2.x", "1 2 3 0"),
    ("1.9", "1 2"),
  ):
    kv.key_value_set(f"{P}/hb/{key}", value)
  dogs = [
    coord.Watchdog(kv, w, 3, lambda w=w: (10 + w, 5, False), 1.0, 5.0, 30.0, logs.append, exits.append)
    for w in range(3)
  ]
  with caplog.at_level(logging.WARNING):
    for t in range(8):
      for d in dogs:
        d.check(100.0 + t)
    assert not exits, logs
    for t in range(8, 16):  # worker 2 stops beating
      for d in dogs[:2]:
        d.check(100.0 + t)
  assert exits == [coord.EXIT_LOST, coord.EXIT_LOST]
  assert "worker(s) [2] lost" in logs[0] and "lost contact" not in logs[0]
  assert any(f"{P}/hb/x:" in r.getMessage() for r in caplog.records)


def test_a_junk_removal_is_no_removal_and_raises_nothing():
  kv, logs, exits = FakeKV(), [], []
  dog = coord.Watchdog(  # an elastic worker of a run with a coordinator (process 0 hosts the service)
    kv,
    0,
    2,
    lambda: (1, 1, False),
    1.0,
    5.0,
    30.0,
    logs.append,
    exits.append,
    incarnation=0,
    hosts_service=False,
  )
  kv.key_value_set(membership.removed_key(0), "junk")
  dog.check(1.0)
  assert not exits
  kv.key_value_set(membership.removed_key(0), "0", allow_overwrite=True)
  dog.check(2.0)
  assert exits == [coord.EXIT_REMOVED]


def _join_slot(kv, value: str) -> None:
  slot = kv.key_value_increment(f"{P}/joins", 1) - 1
  kv.key_value_set(f"{P}/join/{slot}", value)


def test_malformed_join_slots_are_skipped_and_a_real_rejoin_still_lands():
  """join/<slot> = junk, -1 (once: the last worker made to leave and rejoin) and 99 (once: the authority
  stopped): each skipped; worker 2's life untouched; worker 1's real rejoin after them is answered."""
  kv, n = FakeKV(), 3
  service = service_for(n=n)
  authority = Authority(kv, service, poll_s=0.005, elastic=True, now=lambda: 5.0, lives=3).start()
  try:
    for junk in ("junk", "-1", "99"):
      _join_slot(kv, junk)
    authority.leave(1, 0)
    deadline = time.monotonic() + 5
    while not authority.events and time.monotonic() < deadline:
      time.sleep(0.01)
    got = membership.ask_to_join(kv, 1, 5.0)
    assert got["inc"] == 1 and got["refused"] is None and got["incs"] == [0, 1, 0]
    assert authority.error is None and bool(service.view.alive[2]) and authority.incs[2] == 0
    assert [e[1:] for e in authority.events] == [(1, "leave"), (1, "rejoin")]
  finally:
    authority.stop()


def test_a_start_report_past_the_budget_or_under_a_junk_key_steers_nothing():
  """started/0 claiming more steps than the run has (it would end the run: STOP) and started/x: both
  dropped; a real report is applied."""
  kv = FakeKV()
  service = service_for(n=3)
  authority = Authority(kv, service, poll_s=0.005)
  kv.key_value_set(f"{P}/started/0", f"{10**7} 1.0 0.1 -1 0")
  kv.key_value_set(f"{P}/started/x", "5 1.0 0.1 -1 0")
  kv.key_value_set(f"{P}/started/-1", "5 1.0 0.1 -1 0")
  kv.key_value_set(f"{P}/started/1", "4 2.0 0.25 -1 3")
  authority._reports()
  list(service.tick())
  assert not service.stopped and authority._reported == [0, 4, 0] and authority.epochs == [0, 3, 0]


def test_a_malformed_queue_batch_is_skipped_and_the_next_one_delivered():
  kv = FakeKV()
  feed = Feed(kv, 0, lambda: 0.0, ahead=False, n=2)
  try:
    q = membership.queue_prefix(0, 0)
    for j, text in enumerate([encode(("G", 0, (0, 1))), "G 1 0,9", "E join -1 0", encode(("S",))]):
      kv.key_value_set(kvstore.paged(q, j), text)
    assert feed.next(5.0) == ("G", 0, (0, 1))
    assert feed.next(5.0) == ("S",)
  finally:
    feed.close()


def test_a_malformed_resume_point_ends_the_coordinator_in_one_line():
  kv = FakeKV()
  kv.key_value_set(f"{resume.KEY}/point", json.dumps({"mark": -1, "meta": {}}))
  with pytest.raises(wire.Malformed, match=r"ripples/resume/point: a malformed value"):
    resume.await_point(kv, 1.0)
  kv.key_value_set(f"{resume.KEY}/point", "null", allow_overwrite=True)
  assert resume.await_point(kv, 1.0) is None


def test_an_empty_join_slot_is_skipped_past_its_bound_and_the_next_rejoin_lands(monkeypatch):
  """A rejoiner killed between taking slot 0 and writing it: the authority skips the slot once it has
  stayed empty SLOT_WAIT_S with a later slot taken, and worker 1's rejoin in slot 1 is answered
  (before: every later rejoin blocked for good)."""
  monkeypatch.setattr(membership, "SLOT_WAIT_S", 0.5)
  monkeypatch.setattr(kvstore, "_GET_MS", 100)  # the listeners look again every 0.1 s, not 1 s
  kv = FakeKV()
  kv.key_value_increment(membership.JOINS, 1)  # slot 0 taken, never written
  service, authority = authority_after_a_leave(kv)
  try:
    t0 = time.monotonic()
    got = membership.ask_to_join(kv, 1, membership.SLOT_WAIT_S + 5.0)
    assert got["inc"] == 1 and time.monotonic() - t0 >= membership.SLOT_WAIT_S - 0.1
    assert [e[1:] for e in authority.events] == [(1, "leave"), (1, "rejoin")]
  finally:
    authority.stop()

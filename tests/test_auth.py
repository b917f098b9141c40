"""The run's MAC on every store value (distributed/auth.py): a stranger's, another run's or a bare
value is dropped with one line; the run's own pass; a squatter is replaced; the launcher's secret."""

import logging
import threading
import time

import pytest

from ripples_jax.distributed import auth, coord, kvstore, launcher, wire
from ripples_jax.runtime import membership
from tests.fakes import FakeKV
from tests.test_elastic import authority_after_a_leave

P = coord.PREFIX
SECRET = "s" * 32


@pytest.fixture(autouse=True)
def _fresh_warnings():
  wire._warned.clear()


def signed(kv, secret=SECRET, run_id="127.0.0.1:1"):
  return auth.SignedKV(kv, secret, run_id)


def test_the_runs_values_round_trip_and_anyone_elses_are_dropped_in_one_line(caplog):
  """A value written under the run's MAC reads back as written; a bare one, one under another secret
  and one under another run id (the same secret, another port) are left out of a directory read,
  each key family named once."""
  raw = FakeKV()
  kv = signed(raw)
  kv.key_value_set(f"{P}/hb/0", "1 2 3 0")
  raw.key_value_set(f"{P}/hb/1", "1 2 3 0")  # bare: a stranger's
  signed(raw, secret="t" * 32).key_value_set(f"{P}/hb/2", "1 2 3 0")
  signed(raw, run_id="127.0.0.1:2").key_value_set(f"{P}/hb/3", "1 2 3 0")
  assert raw.store[f"{P}/hb/0"] != "1 2 3 0"  # stored with its MAC
  with caplog.at_level(logging.WARNING):
    assert kv.key_value_dir_get(f"{P}/hb/") == [(f"{P}/hb/0", "1 2 3 0")]
  assert [r.getMessage() for r in caplog.records if "MAC" in r.getMessage()] == [
    f"{P}/hb/1: no valid MAC of this run (a stranger's or another run's value) ('1 2 3 0'); ignored"
  ]
  # A value moved to another key fails: the key is under the MAC.
  raw.key_value_set(f"{P}/hb/4", raw.store[f"{P}/hb/0"])
  assert kv.key_value_try_get(f"{P}/hb/4") == "" and kv.key_value_try_get(f"{P}/hb/0") == "1 2 3 0"


def test_a_squatted_key_is_replaced_and_a_blocking_read_waits_for_the_runs_own():
  """A stranger sets ripples/ended first (it would block the coordinator's set for good, and end the
  workers' wait): the workers' blocking read looks past it; the coordinator's set replaces it; the
  read returns the run's value. The other side's own value still makes a second set fail."""
  raw = FakeKV()
  kv = signed(raw)
  raw.key_value_set(membership.ENDED, "1")
  got = []
  reader = threading.Thread(target=lambda: got.append(kv.blocking_key_value_get(membership.ENDED, 5000)))
  reader.start()
  time.sleep(0.2)
  assert not got  # the squatter's value is not taken
  kv.key_value_set(membership.ENDED, "1")
  reader.join(5)
  assert got == ["1"] and kv.open(membership.ENDED, raw.store[membership.ENDED]) == "1"
  with pytest.raises(RuntimeError, match="ALREADY_EXISTS"):
    kv.key_value_set(membership.ENDED, "2")  # the run's own value holds (first writer wins)
  raw.key_value_set(f"{P}/x", "junk")
  with pytest.raises(TimeoutError, match="DEADLINE_EXCEEDED"):
    kv.blocking_key_value_get(f"{P}/x", 200)


def test_a_stranger_cannot_make_a_worker_rejoin_or_leave_through_the_join_slots(monkeypatch):
  """A bare join/<slot> = 2 (well-formed: before the MAC, worker 2 would be made to leave and rejoin)
  is skipped; the run's own rejoin of worker 1 lands; worker 2's life is untouched."""
  monkeypatch.setattr(membership, "SLOT_WAIT_S", 0.3)  # the bound, short: the skip is what is tested
  monkeypatch.setattr(kvstore, "_GET_MS", 100)  # the listeners look again every 0.1 s, not 1 s
  raw = FakeKV()
  kv = signed(raw)
  slot = raw.key_value_increment(f"{P}/joins", 1) - 1
  raw.key_value_set(f"{P}/join/{slot}", "2")
  service, authority = authority_after_a_leave(kv)
  try:
    got = membership.ask_to_join(kv, 1, 5.0)
    assert got["inc"] == 1 and got["refused"] is None and got["incs"] == [0, 1, 0]
    assert authority.error is None and bool(service.view.alive[2]) and authority.incs[2] == 0
    assert [e[1:] for e in authority.events] == [(1, "leave"), (1, "rejoin")]
  finally:
    authority.stop()


def test_the_launcher_hands_its_workers_one_secret_and_a_job_over_nodes_needs_one(tmp_path, monkeypatch):
  monkeypatch.delenv(auth.SECRET_ENV, raising=False)
  a, b = auth.run_secret(1), auth.run_secret(1)
  assert len(a) == 64 and a != b  # a fresh secret per run
  with pytest.raises(ValueError, match=r"^--nnodes=2 needs one run secret on every node: --secret_file"):
    auth.run_secret(2)
  f = tmp_path / "run.secret"
  f.write_text("0123456789abcdef0123\n")
  assert auth.run_secret(2, str(f)) == "0123456789abcdef0123"
  f.write_text("short")
  with pytest.raises(ValueError, match=r"--secret_file=.*one line of at least 16 characters"):
    auth.run_secret(2, str(f))
  monkeypatch.setenv(auth.SECRET_ENV, "e" * 20)
  assert auth.run_secret(2) == "e" * 20
  with pytest.raises(ValueError, match="--nnodes=2 needs one run secret"):  # before anything starts
    monkeypatch.delenv(auth.SECRET_ENV)
    launcher.launch(1, [], node=launcher.Node(2, 1, "127.0.0.1:9"))
  seen = {}
  monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, env, **kw: seen.update(env) or None)
  launcher.start_worker(0, 2, "x", [], "127.0.0.1:5", secret="k" * 20)
  assert seen[auth.SECRET_ENV] == "k" * 20 and seen[auth.RUN_ID_ENV] == "127.0.0.1:5"
  assert auth.signed(FakeKV(), {}).__class__ is FakeKV  # no secret: bare

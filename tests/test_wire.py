"""The store's values decoded in one place (ripples_jax/distributed/wire.py): every writer's format
round-trips, and every malformed value (junk, negative, out of range, huge, a missing field, bad JSON)
is dropped with one warning line naming its key, never raised from a listener or used as an index."""

import logging

import pytest

from ripples_jax.distributed import wire
from ripples_jax.runtime import membership
from ripples_jax.schedule import online

N = 4


def test_each_writers_format_round_trips():
  assert wire.life_key("ripples/hb/3", N) == (3, 0) and wire.life_key("ripples/started/2.5", N) == (2, 5)
  assert wire.beat("ripples/hb/1", "7 12 40 0") == (12, "40", False, 0)
  assert wire.beat("ripples/hb/1.2", "7 12 40 1 2") == (12, "40", True, 2)
  assert wire.life("ripples/removed/1", "3") == 3 and wire.worker_id("ripples/join/0", "2", N) == 2
  assert wire.report("k", "5 1.5 0.25 -1 0", 100) == (5, 1.5, 0.25, -1, 0)
  assert wire.request("k", "3 1.25 0.5", 100) == (3, 1.25, 0.5, None)
  assert wire.request("k", "3 1.25 0.5 5 1.5 0.25 7 1", 100)[3] == (5, 1.5, 0.25, 7, 1)
  queue = [("G", 4, (0, 2)), ("G", 5, (1, 3), (3,)), ("N",), ("M", "eval", 2), ("E", "join", 3, 1), ("S",)]
  assert wire.entries("k", "|".join(map(online.encode, queue)), N) == queue
  version, incs, alive = wire.roster("k", membership.encode_roster(3, [0, 1, 0, 2], [1, 0, 1, 1]), N)
  assert (version, incs, alive) == (3, [0, 1, 0, 2], [True, False, True, True])
  assert wire.seconds("k", repr(0.125)) == 0.125
  assert wire.point("k", "null") == {"mark": None}
  assert wire.point("k", '{"mark": 8, "meta": {"metrics_lines": 3}}')["mark"] == 8


BAD = [
  ("life_key", ("ripples/hb/x", N)),
  ("life_key", ("ripples/hb/-1", N)),
  ("life_key", ("ripples/hb/4", N)),
  ("life_key", ("ripples/started/1.-2", N)),
  ("beat", ("ripples/hb/1", "7 12 40")),
  ("beat", ("ripples/hb/1", "7 x 40 0")),
  ("beat", ("ripples/hb/1", "7 12 40 2")),
  ("beat", ("ripples/hb/1", "7 -12 40 0")),
  ("life", ("ripples/removed/1", "-1")),
  ("life", ("ripples/removed/1", "one")),
  ("worker_id", ("ripples/join/0", "-1", N)),
  ("worker_id", ("ripples/join/0", "99", N)),
  ("worker_id", ("ripples/join/0", "", N)),
  ("report", ("ripples/started/1", "5 1.5 0.25 -1", 100)),
  ("report", ("ripples/started/1", "101 1.5 0.25 -1 0", 100)),  # past the budget: would end the run
  ("report", ("ripples/started/1", "5 nan 0.25 -1 0", 100)),
  ("report", ("ripples/started/1", "5 1.5 -0.25 -1 0", 100)),
  ("report", ("ripples/started/1", "5 1.5 0.25 -2 0", 100)),
  ("request", ("ripples/req/1/0/0", "3 1.25", 100)),
  ("request", ("ripples/req/1/0/0", "-3 1.25 0.5", 100)),
  ("request", ("ripples/req/1/0/0", "3 inf 0.5", 100)),
  ("request", ("ripples/req/1/0/0", "3 1.25 0.5 5 1.5 0.25 7", 100)),
  ("entries", ("ripples/q/1/0/0", "G 4 0,9", N)),
  ("entries", ("ripples/q/1/0/0", "G 4 0,0", N)),
  ("entries", ("ripples/q/1/0/0", "G -4 0,1", N)),
  ("entries", ("ripples/q/1/0/0", "G 4 0,1 3", N)),
  ("entries", ("ripples/q/1/0/0", "M ckpt -1", N)),
  ("entries", ("ripples/q/1/0/0", "M junk 1", N)),
  ("entries", ("ripples/q/1/0/0", "E join -1 1", N)),
  ("entries", ("ripples/q/1/0/0", "N||S", N)),
  ("entries", ("ripples/q/1/0/0", "X", N)),
  ("entries", ("ripples/q/1/0/0", "G x 0,1", N)),
  ("roster", ("ripples/roster/0", "1 0,0,0 1111", N)),
  ("roster", ("ripples/roster/0", "1 0,0,0,0 11x1", N)),
  ("roster", ("ripples/roster/0", "-1 0,0,0,0 1111", N)),
  ("seconds", ("ripples/clock/0/1", "nan")),
  ("seconds", ("ripples/clock/0/1", "soon")),
  ("point", ("ripples/resume/point", "{")),
  ("point", ("ripples/resume/point", '{"mark": -1, "meta": {}}')),
  ("point", ("ripples/resume/point", '{"mark": 3}')),
  ("point", ("ripples/resume/point", "[1, 2]")),
  ("point", ("ripples/resume/point", '{"mark": 3, "meta": {"metrics_lines": -5}}')),
]


@pytest.mark.parametrize("fn,args", BAD, ids=[f"{f}:{a[1] if len(a) > 1 else a[0]}" for f, a in BAD])
def test_a_malformed_value_is_dropped_with_one_line_naming_its_key(fn, args, caplog):
  wire._warned.clear()
  with caplog.at_level(logging.WARNING):
    assert getattr(wire, fn)(*args) is None
  lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(lines) == 1 and lines[0].startswith(args[0] + ":") and lines[0].endswith("ignored"), lines


def test_a_repeated_bad_value_warns_once_per_key_family_and_require_raises_one_line(caplog):
  wire._warned.clear()
  with caplog.at_level(logging.WARNING):
    for w in range(3):
      assert wire.beat(f"ripples/hb/{w}", "junk") is None
  assert len(caplog.records) == 1
  with pytest.raises(wire.Malformed, match="ripples/resume/point: a malformed value"):
    wire.require(wire.point("ripples/resume/point", "{"), "ripples/resume/point", "{")

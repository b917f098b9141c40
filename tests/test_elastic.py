"""Elastic membership (runtime.elastic, runtime/membership.py): the authority's membership entries, the
watchdogs' roles, the replay's merge across deaths and rejoins, refused configs; and real runs where
workers die (inside and outside a P-Reduce, twice), stall, restart and rejoin, and the coordinator dies."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from configs import default as default_config
from ripples_jax import algorithms, timeline
from ripples_jax import config as config_lib
from ripples_jax.distributed import coord
from ripples_jax.distributed import watchdog as watchdog_lib
from ripples_jax.errors import ConfigError
from ripples_jax.runtime import membership
from ripples_jax.runtime.authority import Authority, Feed
from ripples_jax.runtime.replay import merged_events
from ripples_jax.schedule.online import GROUP, MEMBER, STOP, Cadence, Service, decode, encode
from tests.fakes import FakeKV


def service_for(algorithm="ripples_random", n=4, seed=0):
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.schedule.group_size = 3
  gg = algorithms.make_group_generator(config, np.random.default_rng(seed))
  service = Service(n, gg, Cadence(10**6), estimate=1.0)
  service.view.alive = np.ones(n, bool)
  return service


def test_entries_round_trip_through_the_store():
  for entry in [
    (GROUP, 7, (0, 2, 3)),
    (GROUP, 8, (0, 1, 2), (2,)),
    (MEMBER, "leave", 2, 0),
    (MEMBER, "join", 2, 1),
    (STOP,),
  ]:
    assert decode(encode(entry)) == entry


@pytest.mark.parametrize("algorithm", ["ripples_random", "ripples_division", "ripples_smart"])
def test_no_group_after_a_leave_holds_the_dead_worker_and_a_rejoiner_has_weight_0(algorithm):
  n, service = 4, service_for(algorithm)
  for step in range(20):
    for w in range(n):
      service.report(w, float(step), 1.0, step + 1, -1)
      service.request(w, service.appended(w), float(step) + 1.0, 1.0)
  membership.leave(service, 2, 0)
  assert service.buffer.queues[2] == [] and service.entries[2] == []
  for w in (0, 1, 3):
    assert service.entries[w][-1] == (MEMBER, "leave", 2, 0)
  before = service.buffer.count
  for step in range(20, 60):
    for w in (0, 1, 3):
      service.report(w, float(step), 1.0, step + 1, 10**6)
      service.request(w, service.appended(w), float(step) + 1.0, 1.0)
  made = [e for w in (0, 1, 3) for e in service.entries[w] if e[0] == GROUP and e[1] >= before]
  assert made and all(2 not in e[2] for e in made)
  taken = membership.rejoin(service, 2, 1, 60.0)
  assert taken == service.appended(2) and service.joining == {2}
  for w in (0, 1, 3):
    assert service.entries[w][-1] == (MEMBER, "join", 2, 1)
  first = None
  for step in range(60, 100):
    for w in (2, 0, 1, 3):
      if w != 2:  # a joiner takes no step (and reports none) before its first group lands
        service.report(w, float(step), 1.0, step + 1, 10**6)
      service.request(w, service.appended(w), float(step) + 1.0, 1.0)
    first = next((e for e in service.entries[2] if e[0] == GROUP), None)
    if first:
      break
  # Its first group carries it as a joiner (weight 0), and so does every group made with it until it
  # reports a step (its first may fail); its groups made after that report do not.
  assert first is not None and first[3] == (2,) and 2 in service.joining
  service.report(2, 100.0, 1.0, 101, first[1])
  assert 2 not in service.joining


def test_a_step_the_dead_worker_started_and_never_completed_is_made_up_by_the_live():
  kv, n = FakeKV(), 3
  service = service_for(n=n)
  service.cadence = Cadence(30)
  for w in range(n):
    service.report(w, 0.0, 1.0, 10, -1)  # every worker has started its 10th step
  # Worker 1 died inside its 10th step: its last beat (this life's) says 9 completed.
  kv.key_value_set(f"{coord.PREFIX}/hb/1", "7 9 0 0", allow_overwrite=True)
  kv.key_value_set(f"{coord.PREFIX}/hb/2", "7 3 0 0 1", allow_overwrite=True)  # a later life's beat
  assert membership.completed_steps(kv, 1, 0) == 9 and membership.completed_steps(kv, 2, 0) is None
  assert membership.completed_steps(kv, 0, 0) is None  # no beat
  assert membership.leave(service, 1, 0, membership.completed_steps(kv, 1, 0)) == 0  # it will be made up
  assert service.steps.tolist() == [10, 9, 10]
  assert membership.leave(service, 2, 0, 10) == 0  # its beat shows its 10th step completed: all ten count
  assert service.steps.tolist() == [10, 9, 10]
  service.view.alive[2] = True
  service.tick()
  assert not service.stopped  # 10 + 9 + 10 started or completed: one step of the 30 is still owed
  service.report(0, 1.0, 1.0, 11, -1)  # a live worker makes it up
  service.tick()
  assert service.stopped
  # A death noticed once STOP is out: its step is taken off, and the run says it was not made up.
  assert membership.leave(service, 0, 0, 10) == 1 and service.steps.tolist() == [10, 9, 10]


def _devices(counts):
  """Fake jax.devices(): process p has counts[p] CPU devices, ids p * 1024 + k (jax's CPU layout)."""
  from types import SimpleNamespace

  return [SimpleNamespace(process_index=p, id=p * 1024 + k) for p, c in enumerate(counts) for k in range(c)]


def test_each_life_of_a_worker_connects_on_devices_no_earlier_life_used():
  """Life i of worker w runs on its process's local device i: a pair of lives (i, j) has a device list
  of its own, so neither two workers restarted at once nor one restarted again ever meet a device list
  an earlier life connected with (XLA:CPU keeps a failed communicator per ordered device list, and the
  old life's gloo keys stay in the store: docs/design.md 3.12)."""
  devices = _devices([3, 3, 3, 3])  # the coordinator (process 0) and workers 0..2, 3 devices each
  devices_of = {w: [d for d in devices if d.process_index == w + 1] for w in range(3)}
  assert membership.life_device(devices_of[1], 2) is devices_of[1][2]
  with pytest.raises(ValueError, match="life 3 beyond the 3 CPU devices"):
    membership.life_device(devices_of[1], 3)
  assert membership.pair_key((0, 2), [1, 0, 2]) == (1, 2)
  assert membership.pair_devices((0, 2), (1, 2), devices_of) == [[devices_of[0][1]], [devices_of[2][2]]]
  # Workers 0 and 1 die together and both rejoin; then 1 dies and rejoins again.
  history = [[0, 0, 0], [1, 1, 0], [1, 2, 0]]
  used = {}
  for incs in history:
    for pair in [(0, 1), (0, 2), (1, 2)]:
      key = membership.pair_key(pair, incs)
      ids = tuple(d.id for row in membership.pair_devices(pair, key, devices_of) for d in row)
      used.setdefault(ids, set()).add((pair, key))
  assert all(len(lives) == 1 for lives in used.values()), used  # no device list serves two lives
  assert len(used) == 3 + 3 + 2  # every pair with a new life connected anew: (1, 2) of (1, 0) too


def test_the_pair_averager_connects_a_pair_of_lives_on_their_devices():
  import jax
  from jax.sharding import Mesh

  from ripples_jax.distributed.arrays import LOCAL
  from ripples_jax.runtime.preduce import PairAverager

  devs = jax.devices()[:6]
  devices_of = {0: devs[0:3], 1: devs[3:6]}  # two workers' processes, three lives each
  averager = PairAverager(Mesh([devs[1]], (LOCAL,)), devices_of, 0, per_life=True)  # worker 0's life 1
  (_, sharding), _ = averager._program((0, 1), key=(1, 2))
  assert sharding.mesh.devices.tolist() == [[devs[1]], [devs[5]]]
  (_, sharding), _ = averager._program((0, 1))  # before any rejoin: every worker's life 0
  assert sharding.mesh.devices.tolist() == [[devs[0]], [devs[3]]]
  whole = PairAverager(Mesh(devs[0:3], (LOCAL,)), devices_of, 0)  # not elastic: all its devices
  assert whole._program((0, 1))[0][1].mesh.devices.tolist() == [devs[0:3], devs[3:6]]


def test_a_worker_has_as_many_lives_as_its_process_has_devices():
  assert membership.lives_of(_devices([3, 3, 3]), 2) == 3
  assert membership.lives_of(_devices([1, 3, 2]), 2) == 2  # the coordinator's count does not matter
  assert not membership.exhausted(1, [0, 1, 0], 3)  # its life 2 has device 2
  assert membership.exhausted(1, [0, 2, 0], 3)  # life 3 would have none
  assert not membership.exhausted(0, [0, 2, 0], 3)  # the others' lives do not count against it
  assert membership.exhausted(0, [0, 0, 0], 1)  # one device: no rejoin
  assert "--cpu_devices=3" in membership.refusal(1, 3)


def test_the_launcher_gives_an_elastic_run_a_device_per_life():
  from ripples_jax.distributed.launcher import devices_per_process

  assert devices_per_process(1, 2, elastic=True) == 3  # lives 0, 1, 2
  assert devices_per_process(4, 2, elastic=True) == 4  # more asked for: kept
  assert devices_per_process(1, 0, elastic=True) == 1
  assert devices_per_process(1, 2, elastic=False) == 1  # restart-all: every process starts afresh


def test_a_restart_guesses_its_next_life_from_the_runs_answers():
  kv = FakeKV()
  assert membership.next_life(kv, 2) == 1  # no answer yet: its first rejoin
  kv.key_value_set(f"{coord.PREFIX}/join/0", "2")
  kv.key_value_set(f"{coord.PREFIX}/joined/0", "1 0 0.0 0 0 0,0,1 0")
  kv.key_value_set(f"{coord.PREFIX}/join/1", "1")
  kv.key_value_set(f"{coord.PREFIX}/joined/1", "1 0 0.0 0 0 0,1,1 0")
  kv.key_value_set(f"{coord.PREFIX}/join/2", "2")
  kv.key_value_set(f"{coord.PREFIX}/joined/2", "2 0 0.0 0 0 0,1,2 0")
  kv.key_value_set(f"{coord.PREFIX}/join/3", "0")  # asked, not answered yet
  assert [membership.next_life(kv, w) for w in range(3)] == [1, 2, 3]


def authority_after_a_leave(kv, n=3, worker=1):
  """(service, authority): an elastic authority over `kv` (n workers, 3 lives, its clock at 5.0),
  started, `worker`'s life 0 left and the leave recorded; the caller stops it."""
  service = service_for(n=n)
  authority = Authority(kv, service, poll_s=0.005, elastic=True, now=lambda: 5.0, lives=3).start()
  authority.leave(worker, 0)
  deadline = time.monotonic() + 5
  while not authority.events and time.monotonic() < deadline:
    time.sleep(0.01)
  return service, authority


def test_the_authority_removes_and_takes_back_a_worker():
  kv, n = FakeKV(), 3
  service, authority = authority_after_a_leave(kv, n)
  try:
    assert authority.events == [(5.0, 1, "leave")]
    assert dict(kv.key_value_dir_get(f"{coord.PREFIX}/removed/")) == {membership.removed_key(1): "0"}
    got = membership.ask_to_join(kv, 1, 5.0)
    assert got["inc"] == 1 and got["incs"] == [0, 1, 0] and got["refused"] is None
    assert authority.events[-1] == (5.0, 1, "rejoin") and service.joining == {1}
    # Worker 2 rejoins while worker 1's new life is live (each life has a device of its own).
    authority.leave(2, 0)
    got = membership.ask_to_join(kv, 2, 5.0)
    assert got["inc"] == 1 and got["incs"] == [0, 1, 1] and got["refused"] is None
    # Worker 1 dies again and rejoins again: its third life, on its third device.
    authority.leave(1, 1)
    got = membership.ask_to_join(kv, 1, 5.0)
    assert got["inc"] == 2 and got["incs"] == [0, 2, 1] and got["refused"] is None
    # A fourth life has no device: refused with one line.
    authority.leave(1, 2)
    got = membership.ask_to_join(kv, 1, 5.0)
    assert got["refused"] == membership.refusal(1, 3) and authority.events[-1] == (5.0, 1, "refused")
  finally:
    authority.stop()


def test_the_coordinators_watchdog_reports_a_silent_worker_once_and_goes_on():
  kv, lost, exits = FakeKV(), [], []
  progress = lambda: (1, 1, False)
  dogs = [
    coord.Watchdog(kv, w, 3, progress, 1.0, 5.0, 30.0, lambda m: None, exits.append, incarnation=0)
    for w in range(3)
  ]
  on_lost = lambda w, inc: lost.append((w, inc))
  boss = coord.Watchdog(
    kv, None, 3, lambda: (0, 0, False), 1.0, 5.0, 30.0, lambda m: None, exits.append, on_lost=on_lost
  )
  for t in range(3):
    for d in [*dogs, boss]:
      d.check(100.0 + t)
  for t in range(3, 20):  # worker 2 stops beating; the others and the coordinator go on
    for d in [*dogs[:2], boss]:
      d.check(100.0 + t)
  assert lost == [(2, 0)] and exits == [] and boss.gone == {2}
  # Its rejoin (a restarted process, incarnation 1, accepted) makes it a member again for the watchdog.
  boss.watch_life(2, 1)
  dogs[2].incarnation = 1
  dogs[2].check(120.0)
  boss.check(120.0)
  assert boss.gone == set() and boss.incarnations[2] == 1


def test_a_zombie_of_an_earlier_life_neither_keeps_a_worker_alive_nor_brings_it_back():
  """Heartbeat keys are per life: worker 1's life 0, stopped and continued after life 1 was accepted,
  beats on its own key, which the coordinator no longer reads; a life that never beats is lost."""
  kv, lost, exits = FakeKV(), [], []
  beat = lambda w, inc: coord.Watchdog(  # noqa: E731
    kv, w, 2, lambda: (1, 1, False), 1.0, 5.0, 30.0, lambda m: None, exits.append, incarnation=inc
  )
  boss = coord.Watchdog(
    kv, None, 2, lambda: (0, 0, False), 1.0, 5.0, 30.0, lambda m: None, exits.append,
    on_lost=lambda w, inc: lost.append((w, inc)),
  )  # fmt: skip
  w0, zombie = beat(0, 0), beat(1, 0)
  for t in range(3):
    for d in (w0, zombie, boss):
      d.check(100.0 + t)
  for t in range(3, 10):  # life 0 of worker 1 stops (SIGSTOP): removed
    for d in (w0, boss):
      d.check(100.0 + t)
  assert lost == [(1, 0)]
  kv.key_value_set(membership.removed_key(1), "0", allow_overwrite=True)
  boss.watch_life(1, 1)  # life 1 is accepted and beats; the zombie (life 0) is continued and beats too
  life1 = beat(1, 1)

  def zombie_beats(t):  # as its check does before it reads removed/1
    kv.key_value_set(coord.beat_key(1, 0), f"{t} 1 {t} 0", allow_overwrite=True)

  for t in range(10, 20):
    zombie_beats(t)
    for d in (w0, life1, boss):
      d.check(100.0 + t)
  assert lost == [(1, 0)] and boss.gone == set()  # life 1 is watched, on its own key
  for t in range(20, 30):  # life 1 dies; the zombie beats on
    zombie_beats(t)
    for d in (w0, boss):
      d.check(100.0 + t)
  assert lost == [(1, 0), (1, 1)] and boss.gone == {1}  # life 1's silence was seen
  # The zombie reads that a life of its worker at or after its own was removed: it exits.
  kv.key_value_set(membership.removed_key(1), "1", allow_overwrite=True)
  zombie.check(130.0)
  assert exits == [coord.EXIT_REMOVED]
  # Life 2 is accepted and dies before its first beat: lost after the timeout all the same.
  boss.watch_life(1, 2)
  for t in range(30, 40):
    zombie_beats(t)
    for d in (w0, boss):
      d.check(100.0 + t)
  assert lost == [(1, 0), (1, 1), (1, 2)]


def test_the_authority_reads_progress_of_a_workers_current_life_only():
  kv = FakeKV()
  service = service_for(n=3)
  authority = Authority(kv, service, poll_s=0.005, elastic=True)
  authority.incs[1] = 1
  kv.key_value_set(membership.report_key(1, 0), "9 1.0 0.5 -1 0")  # life 0's process, continued
  authority._reports()
  assert service.steps.tolist() == [0, 0, 0]
  kv.key_value_set(membership.report_key(1, 1), "4 1.0 0.5 -1 0")
  authority._reports()
  assert service.steps.tolist() == [0, 4, 0]
  feed = Feed(kv, 1, lambda: 0.0, inc=1)  # where life 1 reports
  feed.close()
  assert feed.reports_at == membership.report_key(1, 1) == f"{coord.PREFIX}/started/1.1"


def test_a_run_every_worker_left_ends_resumable_once_none_rejoins_for_the_stall_timeout():
  kv, lost, exits, logs = FakeKV(), [], [], []
  dogs = [
    coord.Watchdog(
      kv, w, 2, lambda: (1, 1, False), 1.0, 5.0, 30.0, lambda m: None, exits.append, incarnation=0
    )
    for w in range(2)
  ]
  boss = coord.Watchdog(
    kv,
    None,
    2,
    lambda: (0, 0, False),
    1.0,
    5.0,
    30.0,
    logs.append,
    exits.append,
    on_lost=lambda w, inc: lost.append(w),
  )
  for t in range(3):
    for d in [*dogs, boss]:
      d.check(100.0 + t)
  for t in range(3, 10):  # both stop beating: both leave
    boss.check(100.0 + t)
  assert sorted(lost) == [0, 1] and exits == []
  boss.watch_life(1, 1)  # a restart of worker 1 rejoins: a member again, the clock starts over
  dogs[1].incarnation = 1
  dogs[1].check(120.0)
  boss.check(120.0)
  assert boss.gone == {0} and exits == []
  for t in range(121, 170):  # it goes silent too, and nobody comes back
    boss.check(float(t))
    if exits:
      break
  # Removed at 126 (5 s of silence), so every worker has been gone since then: the end 30 s later.
  assert exits == [coord.EXIT_LOST] and t == 157, t
  assert "every worker left the run (workers [0, 1]) and none rejoined for 30 s" in logs[0], logs


def test_a_run_every_worker_left_with_no_life_to_spare_ends_at_once():
  """With no restart left to any worker (lives per worker: membership.lives_of), the run ends at the
  check that removes the last one, not stall_timeout later; with one life left, it waits as before."""

  def run(lives, incs):
    kv, exits, logs = FakeKV(), [], []
    boss = coord.Watchdog(
      kv, None, 2, lambda: (0, 0, False), 1.0, 5.0, 30.0, logs.append, exits.append,
      on_lost=lambda w, inc: None, lives=lives,
    )  # fmt: skip
    for w, inc in enumerate(incs):
      if inc:
        boss.watch_life(w, inc)
      kv.key_value_set(watchdog_lib.beat_key(w, inc), f"1 1 1 0 {inc}")
    for t in range(100, 160):  # nobody beats again: both are removed 5 s after the first check
      boss.check(float(t))
      if exits:
        return t, logs
    return None, logs

  t, logs = run(lives=1, incs=[0, 0])
  assert t == 106, t  # silent for more than 5 s at 106: removed, and nobody can come back
  assert "none has a life left to rejoin with (1 per worker: --max_restarts=0)" in logs[0], logs
  assert run(lives=3, incs=[2, 2])[0] == 106
  t, logs = run(lives=3, incs=[2, 1])  # worker 1 may still come back: stall_timeout after 106
  assert t == 137 and "none rejoined for 30 s" in logs[0], (t, logs)


def test_the_coordinator_does_not_call_a_run_every_worker_left_complete(tmp_path):
  from types import SimpleNamespace

  from ripples_jax.runtime.coordinator import await_workers

  dog = SimpleNamespace(done={0: False, 1: False}, gone={0, 1})
  t = threading.Thread(target=await_workers, args=(dog, None, str(tmp_path), 60.0), daemon=True)
  t.start()
  time.sleep(0.5)
  assert t.is_alive()  # no summary: the watchdog ends this run (or a rejoined worker finishes it)
  dog.gone.discard(1)
  dog.done[1] = True
  t.join(2.0)
  assert not t.is_alive()


def test_silence_counts_from_the_watchdogs_start_not_its_construction():
  """The coordinator builds its watchdog before the start barrier, which can outlast the timeout; a
  worker's first beat comes an interval after its own start. Neither is a silence."""
  kv, lost = FakeKV(), []
  boss = coord.Watchdog(
    kv,
    None,
    2,
    lambda: (0, 0, False),
    0.05,
    0.3,
    30.0,
    lambda m: None,
    lambda code: None,
    on_lost=lambda w, inc: lost.append(w),
  )
  time.sleep(0.5)  # the barrier
  boss.start()
  time.sleep(0.1)
  for w in range(2):
    kv.key_value_set(f"{coord.PREFIX}/hb/{w}", "1 0 0 0", allow_overwrite=True)
  time.sleep(0.1)
  boss.stop()
  assert lost == []


def test_a_worker_exits_once_its_incarnation_is_removed():
  kv, logs, exits = FakeKV(), [], []
  dog = coord.Watchdog(
    kv, 1, 3, lambda: (4, 4, False), 1.0, 5.0, 30.0, logs.append, exits.append, incarnation=1
  )
  kv.key_value_set(membership.removed_key(1), "0")  # its earlier life was removed: not this one
  dog.check(1.0)
  assert exits == []
  kv.key_value_set(membership.removed_key(1), "1", allow_overwrite=True)
  dog.check(2.0)
  assert exits == [coord.EXIT_REMOVED] and "removed from the run" in logs[0]


def _group(g, m, **kw):
  return {"k": "group", "g": g, "m": list(m), "t0": 0.0, "t1": 0.0, "c": 0, **kw}


def _step(s):
  return {"k": "step", "s": s, "t0": 0.0, "t1": 0.0, "c": 0, "loss": 0.0}


def test_merge_keeps_a_failed_members_model_and_uses_a_dead_members_state():
  """Worker 2 died inside group 0 after its exchange with worker 1: worker 1 applied the mean of all
  three (2's state at its death), worker 0 recorded the group as failed. Group 1 failed for everyone
  who recorded it: no average at all."""
  traces = {
    0: [_step(0), _group(0, (0, 1, 2), failed=[2]), _group(1, (0, 2), failed=[2]), _step(1)],
    1: [_step(0), _group(0, (0, 1, 2)), _step(1)],
    2: [_step(0), _step(1)],
  }
  events = merged_events(traces, 3)
  groups = [e for e in events if e[1] != timeline.START and e[1] != timeline.APPLY]
  assert groups == [
    (0.0, timeline.PULL, 3, 0),  # worker 0 set aside
    (0.0, timeline.AVG, (0, 1, 2), None),
    (0.0, timeline.PULL, 0, 3),  # and restored
  ]
  # The average comes after worker 2's last step (its state at its death), not before it.
  order = [(e[1], e[2]) for e in events]
  assert order.index((timeline.APPLY, 2)) < order.index((timeline.AVG, (0, 1, 2)))


def test_merge_joins_a_rejoined_worker_with_weight_0_after_its_earlier_life():
  traces = {
    0: [_step(0), _group(0, (0, 1)), _step(1), _group(5, (0, 1, 2), join=[2]), _step(2)],
    1: [_step(0), _group(0, (0, 1)), _step(1), _group(5, (0, 1, 2), join=[2]), _step(2)],
    2: [
      _step(0),
      {"k": "rejoin", "g0": 5, "inc": 1, "t": 0.0, "s": 1, "c": 0},
      _group(5, (0, 1, 2), join=[2]),
      _step(1),
    ],
  }
  groups = [e for e in merged_events(traces, 3) if e[1] in (timeline.AVG, timeline.JOIN)]
  assert groups == [
    (0.0, timeline.AVG, (0, 1), None),
    (0.0, timeline.AVG, (0, 1), None),
    (0.0, timeline.JOIN, 2, 0),
  ]


def test_the_roster_serves_membership_without_an_authority():
  """AD-PSGD's membership: a leave is published (roster, removed/<w>) once per life; a rejoin takes
  the next incarnation, is published before it is answered, and is refused once the run's step budget
  is spent or its worker's lives exceed its devices. A leave gives the dead life's ticket back."""
  kv, n = FakeKV(), 4
  roster = membership.Roster(kv, n, budget=10, now=lambda: 3.0, lives=2).start()
  view = membership.RosterView(kv, 0.01)
  changes = []
  view.on_change = lambda incs, alive: changes.append((list(incs), alive.tolist()))
  try:
    assert [membership.take_ticket(kv, 10) for _ in range(n)] == [1, 2, 3, 4]  # each is inside a step
    roster.leave(2, 0)
    roster.leave(2, 0)  # the watchdog's second report of the same silence changes nothing
    assert int(kv.key_value_increment(membership.TICKETS, 0)) == 3  # worker 2's step is owed again
    view.poll()
    assert changes == [([0, 0, 0, 0], [True, True, False, True])]
    assert dict(kv.key_value_dir_get(f"{coord.PREFIX}/removed/")) == {membership.removed_key(2): "0"}
    got = membership.ask_to_join(kv, 2, 5.0)
    assert got["inc"] == 1 and got["incs"] == [0, 0, 1, 0] and got["refused"] is None
    view.poll()  # the answer came after the roster had it
    assert changes[-1] == ([0, 0, 1, 0], [True, True, True, True])
    roster.leave(2, 0)  # its earlier life's silence, reported late: not this life's
    assert roster.alive[2] and roster.events == [(3.0, 2, "leave"), (3.0, 2, "rejoin")]
    roster.leave(3, 0)
    got = membership.ask_to_join(kv, 3, 5.0)  # while 2's new life is live: a device of its own
    assert got["inc"] == 1 and got["incs"] == [0, 0, 1, 1] and got["refused"] is None
    # 10 steps in all: 4 taken, two of them given back by the two leaves.
    assert [membership.take_ticket(kv, 10) for _ in range(9)] == [*range(3, 11), None]
    assert roster.unmade == 0
    roster.leave(0, 0)  # after a refusal: the refused has ended, no live worker takes this one back
    assert roster.unmade == 1
    roster.leave(1, 0)
    got = membership.ask_to_join(kv, 1, 5.0)
    assert got["refused"] == "the run has ended" and roster.events[-1] == (3.0, 1, "refused")
  finally:
    roster.stop()
  kv = FakeKV()  # a third life with two devices per worker: refused while steps remain
  roster = membership.Roster(kv, n, budget=10, now=lambda: 3.0, lives=2).start()
  try:
    for life in (0, 1):
      roster.leave(2, life)
      got = membership.ask_to_join(kv, 2, 5.0)
    assert got["refused"] == membership.refusal(2, 2) and roster.incs[2] == 1
  finally:
    roster.stop()


def test_adpsgd_sequences_place_each_life_s_averages_in_it():
  """A passive worker killed inside its step 2: the average it served during that step still landed
  (at its life's end); its next life starts at step 2 again, and an average it served before that
  life's first step comes before it, after its copy."""
  from ripples_jax.runtime.replay import worker_sequence

  events = [
    _step(0),
    _group("1.0.0", (0, 1), during=1),
    _step(1),
    _group("3.0.0", (0, 3), during=2),
    {"k": "rejoin", "g0": 0, "inc": 1, "t": 0.0, "s": 2, "c": 0},
    _group("0.2.0@1.0", (0, 2), join=[0], i=[1, 0]),
    _group("1.0.1@0.1", (0, 1), after=2, i=[1, 0]),
    _step(2),
  ]
  assert worker_sequence(events) == [
    ("start", 0),
    ("apply", 0),
    ("start", 1),
    ("group", "1.0.0"),
    ("apply", 1),
    ("group", "3.0.0"),  # during the step it died in
    ("rejoin", 1),
    ("group", "0.2.0@1.0"),
    ("group", "1.0.1@0.1"),
    ("start", 2),
    ("apply", 2),
  ]


def test_merge_places_an_exchange_by_its_members_lives():
  """Passive worker 0 died after its exchange with active 1 reached 1 (1 applied it, 0 never recorded
  it), then rejoined by copying passive 2. The average uses 0's state at the end of the life the
  exchange names (incarnation 0), before its rejoin, not its new life's."""
  traces = {
    0: [
      _step(0),
      {"k": "rejoin", "g0": 0, "inc": 1, "t": 0.0, "s": 1, "c": 0},
      _group("0.2.0@1.0", (0, 2), join=[0], i=[1, 0]),
      _step(1),
    ],
    1: [_step(0), _group("1.0.0", (0, 1), during=1, own=True, i=[0, 0]), _step(1)],
    2: [_step(0), _group("0.2.0@1.0", (0, 2), join=[0], after=1, i=[1, 0]), _step(1)],
  }
  order = [(e[1], e[2]) for e in merged_events(traces, 3)]
  avg, join = order.index((timeline.AVG, (0, 1))), order.index((timeline.JOIN, 0))
  assert order.index((timeline.APPLY, 0)) < avg < join  # its first life's state, then its copy
  at = lambda kind: [k for k, x in enumerate(order) if x == (kind, 1)]  # noqa: E731
  assert at(timeline.START)[1] < avg < at(timeline.APPLY)[1]  # during worker 1's step 1


def test_adpsgd_evaluation_markers_follow_the_run_when_elastic():
  """Without elastic, eval k after a worker's own step k x eval_every (ids below num_steps); elastic,
  after its first step once the run's tickets passed k x eval_every x num_workers, one id at a time."""
  from types import SimpleNamespace

  from ripples_jax.runtime.adpsgd import eval_due
  from ripples_jax.runtime.process import Loop

  worker = SimpleNamespace(config=SimpleNamespace(eval_every=20, num_steps=50, num_workers=4))

  def markers(loop, points):
    got = []
    for point in points:
      if (k := eval_due(worker, loop, point)) is not None:
        loop.evals = k  # what the loop does
        got.append((point, k))
    return got

  assert markers(Loop({}), range(1, 51)) == [(20, 1), (40, 2)]  # own steps
  got = markers(Loop({}, incs=[0, 0, 0, 0]), (78, 81, 85, 163, 170, 199))  # one worker's tickets
  assert got == [(81, 1), (163, 2)]  # 200 = 50 x 4 is the run's end: no marker there


@pytest.mark.parametrize(
  "algorithm,extra,message",
  [
    ("allreduce", {}, "every step averages over all workers"),
    ("ripples_static", {}, "fixed in advance"),
    ("ripples_random", {"runtime.preduce": "group"}, "a group's first use waits 30 s"),
  ],
)
def test_elastic_refuses_what_cannot_exclude_a_member(algorithm, extra, message):
  config = default_config.get_config(f"algorithm={algorithm},executor=async,num_workers=4")
  config.runtime.elastic = True
  config.update_from_flattened_dict(extra)
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.validate_train_config(config, num_devices=5, num_processes=5)
  assert "\n" not in str(e.value)


def test_elastic_refuses_a_stall_timeout_within_the_collective_timeout():
  """heartbeat_timeout=25 makes the collective timeout 50 s: with stall_timeout=40 the survivors would
  sit in their exchanges with a stalled worker until the coordinator ends the run as stuck."""
  config = default_config.get_config("algorithm=ripples_random,executor=async,num_workers=4")
  config.runtime.heartbeat_timeout = 25.0
  config_lib.validate_train_config(config, num_devices=5, num_processes=5)  # not elastic: no such timeout
  config.runtime.elastic = True
  with pytest.raises(ConfigError) as e:
    config_lib.validate_train_config(config, num_devices=5, num_processes=5)
  assert str(e.value) == (
    "config.runtime.stall_timeout: 40.0 is not allowed: seconds > 2 x runtime.heartbeat_timeout=25.0 with "
    "runtime.elastic (the collective timeout: the survivors wait that long in an exchange with a stalled "
    "worker)"
  )
  config.runtime.stall_timeout = 50.5
  config_lib.validate_train_config(config, num_devices=5, num_processes=5)


def test_a_collective_timeout_within_twice_the_slowest_step_is_refused_declared_or_measured():
  """Elastic, a 10x straggler of 2 s padded steps: its 20 s step against the default 30 s collective
  timeout would break its live partners' exchanges; refused in one line naming heartbeat_timeout.
  The same check on the measured warm-up steps (unpadded runs) ends the coordinator before any
  exchange."""
  from ripples_jax.runtime import coordinator

  config = default_config.get_config("algorithm=ripples_smart,executor=async,num_workers=4")
  config.runtime.update(elastic=True, step_time=2.0)
  config.hetero.update(slow_workers=(3,), slowdown=10.0)
  with pytest.raises(ConfigError) as e:
    config_lib.validate_train_config(config, num_devices=5, num_processes=5)
  assert str(e.value).startswith(
    "config.runtime.heartbeat_timeout: 15.0 is not allowed: seconds > 20 with runtime.elastic: its collective "
    "timeout (2 x it) must exceed twice the slowest worker's step (runtime.step_time=2 x hetero.slowdown=10)"
  )
  config.runtime.update(heartbeat_timeout=40.5, stall_timeout=90.0)  # 81 s > 2 x 20 s
  config_lib.validate_train_config(config, num_devices=5, num_processes=5)
  config.hetero.update(slow_workers=(), slowdown=1.0)
  coordinator.check_timeout_fits(config.runtime, 40.0)
  with pytest.raises(ConfigError, match=r"measured warm-up step \(40.6 s\)"):
    coordinator.check_timeout_fits(config.runtime, 40.6)


def test_elastic_is_refused_on_a_gpu_platform():
  """NCCL does not cancel a collective with a dead member here: elastic has run on the CPU only."""
  config = default_config.get_config("algorithm=ripples_random,executor=async,num_workers=4")
  config.runtime.elastic = True
  config_lib.validate_train_config(config, num_devices=5, num_processes=5, platform="cpu")
  with pytest.raises(ConfigError) as e:
    config_lib.validate_train_config(config, num_devices=5, num_processes=5, platform="gpu")
  assert str(e.value).startswith("config.runtime.elastic: True is not allowed: False on platform gpu: ")
  assert "NCCL does not" in str(e.value) and "\n" not in str(e.value)
  config.runtime.elastic = False  # the runtime without elastic is the GPU's
  config_lib.validate_train_config(config, num_devices=5, num_processes=5, platform="gpu")


def test_elastic_belongs_to_the_runtime_and_fail_where_preduce_to_elastic():
  config = default_config.get_config("algorithm=ripples_random,executor=sim,num_workers=4")
  config.runtime.elastic = True
  with pytest.raises(ConfigError, match="runtime.elastic.*executor=sim"):
    config_lib.validate_train_config(config, num_devices=4)
  config = default_config.get_config("algorithm=ripples_random,executor=async,num_workers=4")
  config.runtime.fail_where = "preduce"
  with pytest.raises(ConfigError, match="runtime.fail_where"):
    config_lib.validate_train_config(config, num_devices=5, num_processes=5)


def test_the_launcher_reads_elastic_from_the_command_line():
  from experiments.config_args import runs_elastic

  base = ["--config=configs/default.py:executor=async,num_workers=4,algorithm=ripples_random"]
  assert runs_elastic("experiments.train", base + ["--config.runtime.elastic=True"])
  assert not runs_elastic("experiments.train", base)
  assert not runs_elastic("experiments.train_dsp", base + ["--config.runtime.elastic=True"])


# -- real runs: 4 workers and the coordinator ---------------------------------------------------------

from tests.test_runtime import MODEL, launch_bounded, make_config, replay_error, run_args  # noqa: E402

ELASTIC = [
  "--config.runtime.elastic=True",
  "--config.runtime.step_time=0.05",
  "--config.runtime.heartbeat_s=0.5",
  "--config.runtime.heartbeat_timeout=5",
]


def elastic_run(tmp_path, steps, extra=(), max_restarts=0, on_pids=None, algorithm="ripples_random"):
  workdir = str(tmp_path / "run")
  args = run_args(workdir, algorithm, 4, steps, [*ELASTIC, *extra])
  code, out = launch_bounded(4, args, timeout_s=300, on_pids=on_pids, max_restarts=max_restarts)
  with open(tmp_path / "launch.out", "w") as f:  # the whole output, for a failure's diagnosis
    f.write(out)
  summary = json.load(open(os.path.join(workdir, "summary.json"))) if code == 0 else None
  return code, out, workdir, summary


def traces_of(workdir):
  from ripples_jax.runtime import trace as trace_lib

  return trace_lib.load_traces(workdir)


def assert_replayed(workdir, steps, algorithm="ripples_random"):
  """The survivors' (and rejoined workers') final models are what the engine computes from the traces."""
  config = make_config(algorithm, 4, steps, MODEL)
  config.runtime.elastic = True
  live = [w for w in range(4) if os.path.exists(os.path.join(workdir, "snapshots", f"final-{w}.npy"))]
  err = replay_error(config, workdir, workers=live)
  assert max(err) < 1e-5, err


def when_steps(workdir, worker, steps, action):
  """on_pids for launch_bounded: action(pids) once `worker` has recorded `steps` local steps (elastic
  traces are written through), from a thread."""

  def watch(pids):
    def wait():
      path, deadline = os.path.join(workdir, f"trace-{worker}.jsonl"), time.monotonic() + 200
      while time.monotonic() < deadline:
        if os.path.exists(path) and sum('"k": "step"' in l for l in open(path)) >= steps:
          return action(pids)
        time.sleep(0.05)

    threading.Thread(target=wait, daemon=True).start()

  return watch


def groups_after_leave(traces, worker):
  """Groups holding `worker` that the others executed after its leave entry reached them."""
  bad = []
  for w, events in traces.items():
    left = False
    for e in events:
      if e["k"] == "member" and e["w"] == worker:
        left = e["kind"] == "leave"
      elif e["k"] == "group" and left and worker in e["m"]:
        bad.append((w, e["g"]))
  return bad


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("where,step", [("preduce", 20), ("preduce", 1)])
def test_a_killed_worker_leaves_and_the_others_finish(tmp_path, where, step):
  """Killed inside a P-Reduce (after its first exchange), and during its first group: the others go
  on, end with exit 0 at the step budget, and their models are the replay's. (Killed before a local
  step: test_two_deaths' worker 2.)"""
  steps = 120
  fail = [
    "--config.runtime.fail_worker=2",
    f"--config.runtime.fail_step={step}",
    f"--config.runtime.fail_where={where}",
  ]
  code, out, workdir, summary = elastic_run(tmp_path, steps, fail)
  assert code == 0, out[-3000:]
  assert "worker 2 exited with -9 (SIGKILL); the run goes on without it" in out
  assert [e[1:] for e in summary["membership"]] == [[2, "leave"]], summary["membership"]
  # The live make up the dead one's steps, the one it died inside too (they may take more: steps start
  # until STOP reaches each worker's queue).
  done = sum(summary["worker_steps"]) + summary["unmade_steps"]
  assert done >= 4 * steps and summary["worker_steps"][2] == step
  traces = traces_of(workdir)
  assert not groups_after_leave(traces, 2)
  failed = [e for w in (0, 1, 3) for e in traces[w] if e["k"] == "group" and e.get("failed") == [2]]
  assert failed  # the groups in flight with it failed for the survivors, who went on
  if where == "preduce":  # it died after one exchange: that partner applied the mean with its state
    own = {e["g"] for e in traces[2] if e["k"] == "group"}
    applied = [
      e for w in (0, 1, 3) for e in traces[w] if e["k"] == "group" and 2 in e["m"] and not e.get("failed")
    ]
    assert any(e["g"] not in own for e in applied), applied
  assert_replayed(workdir, steps)
  # Every evaluation marker kept its record (metrics.jsonl), the ones before the kill included.
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert len([r for r in records if "test_accuracy" in r]) >= steps // 8


def test_failed_exchanges_are_counted_by_cause():
  from ripples_jax.runtime.preduce import failure_cause
  from ripples_jax.runtime.summary import failed_groups

  assert failure_cause(RuntimeError("DEADLINE_EXCEEDED: Gloo collective timed out after 30s")) == "timeout"
  assert (
    failure_cause(RuntimeError("UNAVAILABLE: Connection closed by peer [127.0.0.1]:4411")) == "connection"
  )
  assert failure_cause(ValueError("something else")) == "ValueError"
  traces = {
    0: [{"k": "group", "g": 1, "failed": [2], "cause": ["connection"]}, {"k": "group", "g": 2}],
    2: [{"k": "group", "g": 1, "failed": [0], "cause": ["connection"]}],
    1: [{"k": "group", "g": 3, "failed": [2, 3], "cause": ["broken_before", "timeout"]}],
    3: [{"k": "step"}, {"k": "group", "g": 4, "failed": [2]}],  # a trace from before causes: "unknown"
  }
  got = failed_groups(traces)
  assert got == {"broken_before": 1, "connection": 2, "timeout": 1, "unknown": 1}
  assert failed_groups({0: [{"k": "group", "g": 1}]}) == {}


def test_a_new_pair_of_lives_meets_before_it_connects_and_both_sides_agree():
  """membership.handshake: both there -> None on both; the other life removed -> "left" (not gloo's
  30 s wait); nobody within the timeout -> "timeout", and the side that comes later reads that
  decision at once instead of connecting alone."""
  kv, pair = FakeKV(), (1, 3)
  got = {}
  both = [
    threading.Thread(target=lambda m=m: got.update({m: membership.handshake(kv, m, pair, (2, 0), 5.0)}))
    for m in pair
  ]
  [t.start() for t in both]
  [t.join() for t in both]
  assert got == {1: None, 3: None}
  # Worker 3's life 1 is dead: removed/3 names it (or a later life), and worker 1's life 2 stops waiting.
  kv.key_value_set(membership.removed_key(3), "1", allow_overwrite=True)
  t0 = time.monotonic()
  assert membership.handshake(kv, 1, pair, (2, 1), 5.0) == "left" and time.monotonic() - t0 < 1.0
  assert membership.handshake(kv, 1, pair, (2, 2), 0.2) == "timeout"  # life 2 of 3 is not removed
  assert membership.handshake(kv, 3, pair, (2, 2), 5.0) == "timeout"  # came late: the pair's decision
  # A hello that never beats again is a life that died while it waited (or stalled): no "go" on it,
  # so the side that came later never enters gloo's 30 s rendezvous with a dead life.
  kv.key_value_set(f"{membership.PREFIX}/hello/1.3-3.3/a7/3", "5", allow_overwrite=True)
  assert membership.handshake(kv, 1, pair, (3, 3), 0.3, attempt=7) == "timeout"
  # Each group meets afresh: attempt 8 of the same pair of lives, both there, goes.
  both = [
    threading.Thread(
      target=lambda m=m: got.update({m: membership.handshake(kv, m, pair, (3, 3), 5.0, attempt=8)})
    )
    for m in pair
  ]
  [t.start() for t in both]
  [t.join() for t in both]
  assert got == {1: None, 3: None}


def test_a_timeout_retries_the_pair_once_on_a_fresh_connection_and_other_failures_break_it():
  """Slow is not dead: an exchange that failed (timed out, or closed by the side that timed out) is
  retried at the pair's next group on its second connection (generation 1); a failure there, or a
  partner known gone (the handshake's "left"), breaks the pair of lives for good (later groups skip
  it: broken_before). Every failure keeps the model."""
  import jax.numpy as jnp

  from ripples_jax.runtime.preduce import PairAverager, Unmet

  avg = PairAverager(None, {0: [], 1: [], 2: []}, me=0, per_life=True)
  calls, outcomes = [], {}

  def exchange(pair, key, gen, pieces, size, attempt=None):
    calls.append((pair[1], gen))
    got = outcomes[pair[1]].pop(0)
    if isinstance(got, Exception):
      raise got
    return jnp.full(size, got, jnp.float32)

  avg._exchange = exchange
  flat, incs = jnp.zeros(4, jnp.float32), [0, 0, 0]
  timeout = RuntimeError("DEADLINE_EXCEEDED: Gloo collective timed out after 10s")
  outcomes[1] = [timeout, 3.0, timeout, timeout]
  outcomes[2] = [RuntimeError("UNAVAILABLE: Connection closed by peer"), Unmet("left")]
  out, failed = avg.average_elastic((0, 1, 2), flat, (), incs)
  assert failed == [1, 2] and avg.causes == {1: "timeout", 2: "connection"} and out is flat
  out, failed = avg.average_elastic((0, 1), flat, (), incs)  # retried on generation 1: it lands
  assert failed == [] and float(out[0]) == 1.5 and calls[-1] == (1, 1)
  out, failed = avg.average_elastic((0, 2), flat, (), incs)  # its fresh connection: 2 is gone
  assert failed == [2] and avg.causes == {2: "left"} and calls[-1] == (2, 1)
  out, failed = avg.average_elastic((0, 2), flat, (), incs)  # never tried again
  assert failed == [2] and avg.causes == {2: "broken_before"} and calls[-1] == (2, 1)
  avg.average_elastic((0, 1), flat, (), incs)  # a timeout on generation 1: no third connection
  out, failed = avg.average_elastic((0, 1), flat, (), incs)
  assert failed == [1] and avg.causes == {1: "broken_before"} and out is flat
  assert calls == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 1)]
  outcomes[1] = [Unmet("left")]  # a rejoined life of 1 (another key) that left before it met
  out, failed = avg.average_elastic((0, 1), flat, (), [0, 1, 0])
  assert avg.causes == {1: "left"} and ((0, 1), (0, 1)) in avg.broken
  # A meeting that timed out (a stalled life of 2) tried no connection: same generation next group.
  outcomes[2] = [Unmet("timeout"), Unmet("timeout"), 5.0]
  for _ in range(2):
    out, failed = avg.average_elastic((0, 2), flat, (), [0, 0, 1])
    assert failed == [2] and avg.causes == {2: "unmet"} and calls[-1] == (2, 0)
  out, failed = avg.average_elastic((0, 2), flat, (), [0, 0, 1])
  assert failed == [] and float(out[0]) == 2.5 and calls[-1] == (2, 0)


def when_traced(workdir, worker, condition, timeout_s=200.0) -> bool:
  """Waits until `worker`'s trace (written through) satisfies condition(events); False on timeout."""
  from ripples_jax.runtime import trace as trace_lib

  path, deadline = os.path.join(workdir, f"trace-{worker}.jsonl"), time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if os.path.exists(path):
      try:
        if condition(trace_lib.read_trace(path)):
          return True
      except ValueError:  # a line being written
        pass
    time.sleep(0.05)
  return False


def averaged_as(events, inc):
  """Whether life `inc` of a worker (its trace) has landed a group after its rejoin."""
  at = next((i for i, e in enumerate(events) if e["k"] == "rejoin" and e["inc"] == inc), None)
  return at is not None and any(e["k"] == "group" and not e.get("failed") for e in events[at:])


def process_of(workdir, worker, besides=()):
  """The pid of the live process of `worker` in the run at `workdir` (a restart: not in `besides`)."""
  for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
      args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
      continue
    if f"--workdir={workdir}".encode() in args and f"--process_id={worker + 1}".encode() in args:
      if pid not in besides:
        return pid
  return None


# Nightly for the README command's 15 minutes (119 s): rejoins stay in its tier through the permanent-loss
# resume and the AD-PSGD rejoin; this one adds two at once and a second death (WORKSPACE.md section 41).
@pytest.mark.slow
@pytest.mark.nightly
def test_restarted_workers_rejoin_at_once_and_again_with_weight_0_and_train(tmp_path):
  """Workers 0 and 1 SIGKILLed at once, both restarted: both rejoin (a life runs on a CPU device of its
  own, so no pair runs out of connections) with weight 0 and train; worker 1, killed again once its
  second life has averaged, rejoins again as its third (--max_restarts=2: 3 CPU devices a process).
  The run ends at its budget with summary.json and every worker's exit 0, replayed exactly.
  Slow is not dead: worker 3 then sleeps, alive, past the collective timeout inside a P-Reduce
  (fail_where=slow); the exchanges that failed against it are retried on a fresh connection and land."""
  # The churn (two restarts at once, a third, the third life's first group) is over by run time 17 s,
  # about step 150 at this run's 0.12 s a step on 2 busy cores (measured); worker 3's sleep (11 s, at
  # its step 300, after the churn) leaves 250 steps of groups to retry in.
  steps = 550
  slow = [
    "--config.runtime.fail_worker=3",
    "--config.runtime.fail_step=300",
    "--config.runtime.fail_where=slow",
  ]
  workdir, log = str(tmp_path / "run"), []

  def churn(pids):
    def go():
      if not when_traced(workdir, 2, lambda ev: sum(e["k"] == "step" for e in ev) >= 20):
        return log.append("worker 2 never reached step 20")
      os.kill(pids[1], signal.SIGKILL)
      os.kill(pids[2], signal.SIGKILL)
      log.append("killed 0 and 1")
      if not when_traced(workdir, 1, lambda ev: averaged_as(ev, 1)):
        return log.append("worker 1's second life never averaged")
      pid = process_of(workdir, 1, besides=pids)
      if pid is None:
        return log.append("no process of worker 1's second life")
      os.kill(pid, signal.SIGKILL)
      log.append("killed 1 again")

    threading.Thread(target=go, daemon=True).start()

  t0 = time.monotonic()
  code, out, workdir, summary = elastic_run(tmp_path, steps, slow, max_restarts=2, on_pids=churn)
  print(f"elastic churn run: {time.monotonic() - t0:.1f} s; {log}; {summary and summary['membership']}")
  print(f"failed groups by cause: {summary and summary['failed_groups']}")
  assert code == 0, out[-3000:]
  assert log == ["killed 0 and 1", "killed 1 again"], (log, out[-3000:])
  for w, k in [(0, 1), (1, 1), (1, 2)]:
    assert f"worker {w} exited with -9 (SIGKILL); restarting it ({k} of 2): it rejoins the run" in out
  assert "cannot rejoin" not in out and "connection keys" not in out
  kinds = {w: [e[2] for e in summary["membership"] if e[1] == w] for w in range(4)}
  assert kinds[0] == ["leave", "rejoin", "first_group"], summary["membership"]
  assert kinds[1] == ["leave", "rejoin", "first_group"] * 2, summary["membership"]
  assert kinds[2] == kinds[3] == []
  traces = traces_of(workdir)
  for w, lives in [(0, [1]), (1, [1, 2])]:
    rejoins = [i for i, e in enumerate(traces[w]) if e["k"] == "rejoin"]
    assert [traces[w][i]["inc"] for i in rejoins] == lives
    for i in rejoins:  # its data continue where its record ends; its first group carries it (weight 0)
      assert traces[w][i]["s"] == sum(e["k"] == "step" for e in traces[w][:i])
      first = next(e for e in traces[w][i:] if e["k"] == "group" and not e.get("failed"))
      # Workers 0 and 1 rejoin at once: one group may carry both, beside a member that trains.
      assert w in first["join"] and len(first["join"]) < len(first["m"]), first
      assert first["g"] >= traces[w][i]["g0"]
    after = traces[w][rejoins[-1] :]
    assert sum(e["k"] == "step" for e in after) > 10  # its last life trained after its first group
  assert not groups_after_leave(traces, 0) and not groups_after_leave(traces, 1)
  assert sum(summary["worker_steps"]) + summary["unmade_steps"] >= 4 * steps
  assert "exit codes: coordinator 0, workers [0, 0, 0, 0]" in out
  assert "inside a P-Reduce, alive (fail_where=slow)" in out
  assert_retried_after_slow(traces, 3, 300)
  assert_failures_counted(traces, summary)
  assert_replayed(workdir, steps)
  # Every evaluation marker kept its record (metrics.jsonl), the ones before the kills included.
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert len([r for r in records if "test_accuracy" in r]) >= steps // 8


def assert_failures_counted(traces, summary):
  """Every failed exchange is counted in summary.json by cause, none silent: a partner died (gloo saw
  its connection close), the pair's fresh connection found it removed ("left"), a later group skipped
  a pair of lives broken before, or an exchange timed out."""
  every = [c for t in traces.values() for e in t if e["k"] == "group" for c in e.get("cause", [])]
  assert len(every) == sum(len(e["failed"]) for t in traces.values() for e in t if e.get("failed"))
  assert summary["failed_groups"] == {c: every.count(c) for c in sorted(set(every))}
  assert set(summary["failed_groups"]) <= {"connection", "broken_before", "timeout", "left", "unmet"}, (
    summary["failed_groups"]
  )


def assert_retried_after_slow(traces, slow, at_step):
  """From the group in which the slow worker slept (its first after `at_step` steps) on, every member
  whose exchange with it failed, or it with them, averaged with it again later (the pair's fresh
  connection), and none of them skipped it as broken_before. (The churn is over by then.)"""
  done, asleep = 0, None
  for e in traces[slow]:
    done += e["k"] == "step"
    if e["k"] == "group" and done == at_step:
      asleep = e["t0"]
      break
  failed = {
    (w, m, e["g"])
    for w, events in traces.items()
    for e in events
    if e["k"] == "group" and e["t1"] >= asleep
    for m in e.get("failed", ())
    if slow in (w, m)
  }
  assert failed, "no exchange with the slow worker failed: its sleep did not outlast the timeout"
  for w, m, g in sorted(failed):
    later = [e for e in traces[w] if e["k"] == "group" and e["g"] > g and m in e["m"]]
    assert any(m not in e.get("failed", ()) for e in later), (w, m, g, later[:3])
    skipped = [c for e in later for f, c in zip(e.get("failed", ()), e.get("cause", ())) if f == m]
    assert "broken_before" not in skipped, (w, m, g, skipped)


@pytest.mark.slow
@pytest.mark.nightly  # the full tier's elastic deaths are the churn run's (its failures counted the same)
def test_two_deaths(tmp_path):
  """Worker 2 kills itself before its local step 15; worker 0 is killed from outside once worker 2's
  leave has happened. The others go on, end with exit 0 at the step budget (the live make up the dead
  ones' steps, the ones they died inside too), and their models are the replay's."""
  steps = 80
  fail = ["--config.runtime.fail_worker=2", "--config.runtime.fail_step=15"]

  kill_0 = when_steps(str(tmp_path / "run"), 0, 40, lambda pids: os.kill(pids[1], signal.SIGKILL))
  code, out, workdir, summary = elastic_run(tmp_path, steps, fail, on_pids=kill_0)
  assert code == 0, out[-3000:]
  assert "worker 2 exited with -9 (SIGKILL); the run goes on without it" in out
  assert sorted(e[1:] for e in summary["membership"]) == [[0, "leave"], [2, "leave"]], summary["membership"]
  assert sum(summary["worker_steps"]) + summary["unmade_steps"] >= 4 * steps
  assert summary["worker_steps"][2] == 15
  traces = traces_of(workdir)
  assert not groups_after_leave(traces, 2) and not groups_after_leave(traces, 0)
  failed = [e for w in (0, 1, 3) for e in traces[w] if e["k"] == "group" and e.get("failed") == [2]]
  assert failed  # the groups in flight with worker 2 failed for the others, who went on
  assert_failures_counted(traces, summary)
  assert_replayed(workdir, steps)
  # Every evaluation marker kept its record (metrics.jsonl), the ones before the kills included.
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert len([r for r in records if "test_accuracy" in r]) >= steps // 8


@pytest.mark.slow
@pytest.mark.nightly
def test_a_stalled_worker_is_removed_and_rejoins_after_it_continues(tmp_path):
  steps = 300  # the stall (8 s) and the restart (5-10 s) end well before the run does

  def stall(pids):
    os.kill(pids[2], signal.SIGSTOP)
    time.sleep(8)  # longer than heartbeat_timeout: the coordinator removes it
    os.kill(pids[2], signal.SIGCONT)

  stall_1 = when_steps(str(tmp_path / "run"), 1, 20, stall)
  code, out, workdir, summary = elastic_run(tmp_path, steps, max_restarts=1, on_pids=stall_1)
  assert code == 0, out[-3000:]
  assert "worker 1: removed from the run" in out, out[-3000:]
  assert "worker 1 exited with 76 (it was removed from the run after a stall); restarting it" in out
  kinds = [e[2] for e in summary["membership"] if e[1] == 1]
  assert kinds == ["leave", "rejoin", "first_group"], summary["membership"]
  traces = traces_of(workdir)
  assert not [e for e in groups_after_leave(traces, 1)]
  assert_replayed(workdir, steps)


@pytest.mark.slow
@pytest.mark.nightly
def test_the_coordinators_death_restarts_every_process_and_the_run_resumes(tmp_path):
  """The coordinator SIGKILLed once (--max_restarts=1): the launcher restarts every process, which
  resume from the newest marker (launcher.coordinator_died); the run ends complete and replays."""
  steps = 120

  workdir = str(tmp_path / "run")
  killed = []

  def kill_once(pids):  # on_pids runs at every start of the job: the restarted one is left alone
    if not killed:
      killed.append(os.kill(pids[0], signal.SIGKILL))

  args = run_args(workdir, "ripples_random", 4, steps, ELASTIC)
  code, out = launch_bounded(
    4, args, timeout_s=400, on_pids=when_steps(workdir, 0, 40, kill_once), max_restarts=1
  )
  assert code == 0, out[-3000:]
  assert "[launch] coordinator exited with -9 (SIGKILL)" in out, out[-3000:]
  assert "[launch] the coordinator died: restarting every process (1 of 1)" in out, out[-3000:]
  assert "resuming at checkpoint marker" in out
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert sum(summary["worker_steps"]) >= 4 * steps and summary["membership"] == []
  assert_replayed(workdir, steps)


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("algorithm", ["ripples_random", "adpsgd"])
def test_every_worker_killed_ends_the_run_resumable_and_the_rerun_finishes_it(tmp_path, algorithm):
  """Every worker SIGKILLed, no restarts: the coordinator removes them and, since none has a life left
  to rejoin with, ends at once (heartbeat_timeout after the kill) with one line and exit 75, no summary;
  the same command finishes the run (Ripples resumes from its newest marker; AD-PSGD, which
  checkpoints only its final state, starts over). Prints the time from the kill to the launcher's end."""
  steps = 200
  workdir = str(tmp_path / "run")
  killed = []

  def kill(pids):
    killed.append(time.monotonic())
    [os.kill(p, signal.SIGKILL) for p in pids[1:]]

  args = run_args(workdir, algorithm, 4, steps, ELASTIC)
  code, out = launch_bounded(4, args, timeout_s=300, on_pids=when_steps(workdir, 0, 20, kill))
  print(f"every worker killed: the run ended {time.monotonic() - killed[0]:.1f} s after the kill")
  line = "every worker left the run (workers [0, 1, 2, 3]) and none has a life left to rejoin with"
  assert code != 0 and line in out, out[-3000:]
  assert "[launch] coordinator exited with 75" in out, out[-3000:]
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  code, out = launch_bounded(4, args, timeout_s=300)
  assert code == 0, out[-3000:]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert sum(summary["worker_steps"]) >= 4 * steps


@pytest.mark.slow
@pytest.mark.nightly
def test_restart_all_resumes_every_process_from_the_newest_checkpoint(tmp_path):
  """All-Reduce's elastic form (torchrun's): --max_restarts without runtime.elastic restarts the whole
  job, which resumes from the newest marker; the fault injection stays off in the restarted job."""
  workdir, steps = str(tmp_path / "run"), 80
  fail = [
    "--config.runtime.fail_worker=2",
    "--config.runtime.fail_step=50",
    "--config.runtime.step_time=0.05",
  ]
  code, out = launch_bounded(4, run_args(workdir, "allreduce", 4, steps, fail), timeout_s=300, max_restarts=1)
  assert code == 0, out[-3000:]
  assert "[launch] restarting every process (1 of 1): they resume from the newest checkpoint" in out
  assert out.count("kills itself") == 1 and "resuming at checkpoint marker" in out
  starts = [json.loads(line) for line in open(os.path.join(workdir, "clock.jsonl"))]
  assert len(starts) == 2 and starts[1]["run"] > 0 and starts[1]["wall"] > starts[0]["wall"]
  config = make_config("allreduce", 4, steps, MODEL)
  assert max(replay_error(config, workdir)) < 1e-5


# -- AD-PSGD: membership without an authority (membership.Roster) -------------------------------------


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("worker,where", [(2, "preduce")])
def test_adpsgd_goes_on_without_a_killed_worker(tmp_path, worker, where):
  """(An active worker killed before a step: test_adpsgd_rejoin_copies_a_live_passive_worker_and_trains
  until its restart.) A passive one killed inside an exchange it serves: the others end
  at the run's step budget (the live make up the dead one's steps, the one it died inside too: its
  ticket is given back), the exchanges with it fail and keep the survivors' models, and the
  models are the replay's."""
  steps = 60
  fail = [
    f"--config.runtime.fail_worker={worker}",
    "--config.runtime.fail_step=20",
    f"--config.runtime.fail_where={where}",
  ]
  code, out, workdir, summary = elastic_run(tmp_path, steps, fail, algorithm="adpsgd")
  assert code == 0, out[-3000:]
  assert [e[1:] for e in summary["membership"]] == [[worker, "leave"]], summary["membership"]
  assert summary["worker_steps"][worker] == 20
  # The live make up the dead one's steps, the one it died inside too, unless its leave came after the
  # budget was handed out (60 steps end within a few heartbeat timeouts of the kill).
  assert sum(summary["worker_steps"]) + summary["unmade_steps"] == 4 * steps
  traces = traces_of(workdir)
  failed = [e for w in range(4) if w != worker for e in traces[w] if e["k"] == "group" and e.get("failed")]
  assert all(e["failed"] == [worker] for e in failed)
  if worker % 2 == 0:  # the active workers that picked it until its removal went on without the average
    assert failed
  assert_replayed(workdir, steps, "adpsgd")


@pytest.mark.slow
@pytest.mark.parametrize("worker", [1, pytest.param(2, marks=pytest.mark.nightly)])
def test_adpsgd_rejoin_copies_a_live_passive_worker_and_trains(tmp_path, worker):
  """A restarted active (1) or passive (2) worker: it copies a live passive worker other than itself
  (weight 0), then trains; the run ends at its budget with every worker's exit 0, replayed exactly.
  Until its restart the others go on without it: the exchanges that fail name it alone, and the live
  make up the step it died inside (its ticket is given back)."""
  # AD-PSGD steps never wait: a slow restart (5-10 s on 2 busy cores, after the death at step 20)
  # still finds the others near step 200 of 300.
  steps = 300
  fail = [f"--config.runtime.fail_worker={worker}", "--config.runtime.fail_step=20"]
  code, out, workdir, summary = elastic_run(tmp_path, steps, fail, max_restarts=1, algorithm="adpsgd")
  assert code == 0, out[-3000:]
  assert [e[1:] for e in summary["membership"]] == [
    [worker, "leave"],
    [worker, "rejoin"],
    [worker, "first_group"],
  ]
  traces = traces_of(workdir)
  rejoin = next(i for i, e in enumerate(traces[worker]) if e["k"] == "rejoin")
  assert traces[worker][rejoin]["inc"] == 1 and traces[worker][rejoin]["s"] == 20
  copy = next(e for e in traces[worker][rejoin:] if e["k"] == "group" and not e.get("failed"))
  source = next(m for m in copy["m"] if m != worker)
  assert copy["join"] == [worker] and source % 2 == 0 and copy["i"][copy["m"].index(worker)] == 1
  assert summary["worker_steps"][worker] > 20  # it trained again after its copy
  assert sum(summary["worker_steps"]) == 4 * steps and summary["unmade_steps"] == 0  # all made up
  failed = [e for w in range(4) for e in traces[w] if e["k"] == "group" and e.get("failed")]
  assert all(e["failed"] == [worker] for e in failed), failed
  assert "exit codes: coordinator 0, workers [0, 0, 0, 0]" in out
  assert_replayed(workdir, steps, "adpsgd")


@pytest.mark.slow
@pytest.mark.nightly
def test_adpsgd_a_stalled_passive_worker_is_removed_and_rejoins(tmp_path):
  """Passive worker 2 stopped for 8 s: removed after the timeout; the exchanges the active workers had
  asked of it fail (at the collective timeout: once it continues it reads the roster before serving,
  and serves nothing across its removal); it exits 76, is restarted, copies a live passive worker and
  trains; replayed exactly."""
  steps = 600  # the stall (8 s), the removal and the restart end well before the run does

  def stall(pids):
    os.kill(pids[3], signal.SIGSTOP)
    time.sleep(8)
    os.kill(pids[3], signal.SIGCONT)

  stall_2 = when_steps(str(tmp_path / "run"), 2, 20, stall)
  code, out, workdir, summary = elastic_run(
    tmp_path, steps, max_restarts=1, on_pids=stall_2, algorithm="adpsgd"
  )
  assert code == 0, out[-3000:]
  assert "worker 2 exited with 76 (it was removed from the run after a stall); restarting it" in out
  assert [e[2] for e in summary["membership"] if e[1] == 2] == ["leave", "rejoin", "first_group"]
  traces = traces_of(workdir)
  leave = next(e[0] for e in summary["membership"] if e[2] == "leave")
  rejoin = next(i for i, e in enumerate(traces[2]) if e["k"] == "rejoin")
  # No exchange it served began after its removal (it served none once it knew).
  assert not [e for e in traces[2][:rejoin] if e["k"] == "group" and e["t0"] > leave]
  assert_replayed(workdir, steps, "adpsgd")


def start_node(rank, port, args, max_restarts, log_path):
  """One node launcher of a 2-node job on this machine: node r's workers' gloo listeners on loopback
  address 127.0.0.(r + 1), the coordinator on node 0 at 127.0.0.1:port."""
  import subprocess
  import sys

  from tests.test_runtime import ROOT

  secret = os.path.join(os.path.dirname(log_path), "run.secret")  # the nodes' one run secret
  if not os.path.exists(secret):
    with open(secret, "w") as f:
      f.write("0123456789abcdef" * 4)
  cmd = [
    sys.executable,
    "-m",
    "experiments.launch",
    "--nnodes=2",
    f"--secret_file={secret}",
    f"--node_rank={rank}",
    f"--coordinator_address=127.0.0.1:{port}",
    f"--node_address=127.0.0.{rank + 1}",
    "--num_processes=2",
    f"--max_restarts={max_restarts}",
    "--grace_s=10",
    "--",
    *args,
  ]
  log = open(log_path, "w")
  return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


@pytest.mark.slow
@pytest.mark.nightly
def test_a_node_launcher_restarts_its_workers_across_nodes_and_a_lost_node_is_survived(tmp_path):
  """Two node launchers on this machine (loopback addresses 127.0.0.1 and .2), 2 workers each, node 0
  also the coordinator. Worker 3 (node 1) kills itself; node 1's launcher restarts it and it rejoins
  the run, averaging with node 0's workers. Then node 1 vanishes (its launcher and both workers
  SIGKILLed: a host loss): node 0's workers finish the budget, the run ends with exit 0, replayed."""
  from ripples_jax.distributed.launcher import free_port

  steps, port, workdir = 250, free_port(), str(tmp_path / "run")
  args = run_args(workdir, "ripples_random", 4, steps, [*ELASTIC, "--config.runtime.fail_worker=3"])
  args.append("--config.runtime.fail_step=20")
  nodes = [start_node(r, port, args, 1, tmp_path / f"node{r}.out") for r in (0, 1)]
  log = []
  try:
    rejoined = when_traced(workdir, 3, lambda ev: averaged_as(ev, 1), timeout_s=150)
    log.append("rejoined" if rejoined else "worker 3 never averaged as its second life")
    if rejoined:
      victims = [process_of(workdir, w) for w in (2, 3)]
      os.kill(nodes[1][0].pid, signal.SIGKILL)  # the launcher first: nothing restarts its workers
      for pid in victims:
        if pid is not None:
          os.kill(pid, signal.SIGKILL)
      log.append(f"node 1 lost: {victims}")
    code = nodes[0][0].wait(timeout=150)
  finally:
    for p, f in nodes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      f.close()
  out = [open(tmp_path / f"node{r}.out").read() for r in (0, 1)]
  assert log[0] == "rejoined" and None not in eval(log[1].split(": ")[1]), (log, out[1][-3000:])
  assert code == 0, out[0][-3000:]
  assert "2 workers and a coordinator (workers 0..1; node 0 of 2) on 127.0.0.1" in out[0]
  assert "2 workers (workers 2..3; node 1 of 2) on 127.0.0.1" in out[1]
  assert "worker 3 exited with -9 (SIGKILL); restarting it (1 of 1): it rejoins the run" in out[1]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  kinds = {w: [e[2] for e in summary["membership"] if e[1] == w] for w in range(4)}
  assert kinds[3] == ["leave", "rejoin", "first_group", "leave"] and kinds[2] == ["leave"], summary
  assert kinds[0] == kinds[1] == []
  traces = traces_of(workdir)
  first = next(e for e in traces[3] if e["k"] == "group" and e.get("join") and not e.get("failed"))
  assert 3 in first["join"] and {0, 1} & set(first["m"]), first  # across nodes: with node 0's workers
  assert not groups_after_leave(traces, 2)
  assert sum(summary["worker_steps"]) + summary["unmade_steps"] >= 4 * steps
  assert "exit codes: coordinator 0, workers [0, 0]" in out[0]
  assert_failures_counted(traces, summary)
  assert_replayed(workdir, steps)


@pytest.mark.slow
def test_a_run_that_lost_a_worker_for_good_resumes_from_its_newest_marker_and_the_worker_rejoins(tmp_path):
  """Worker 2 dies for good (no restarts), the others go on past five more checkpoint markers, then the
  coordinator is SIGKILLed: the run ends. The same command (with --max_restarts=1: a second life per
  process) resumes from the newest marker workers 0 and 1 hold, at which worker 2 was out (before:
  only from a marker every worker held, one before the death); worker 2 rejoins as a new life, and
  the run ends at its budget, its membership whole, replayed exactly. The authority kept no snapshot
  for worker 2's old markers (bounded after a permanent death)."""
  steps, workdir = 160, str(tmp_path / "run")
  args = run_args(workdir, "ripples_random", 3, steps, [*ELASTIC, "--config.runtime.fail_worker=2"])
  args.append("--config.runtime.fail_step=10")
  killed = []

  def kill_coordinator(pids):
    def go():
      def past_leave(ev):  # five checkpoint markers after worker 2's leave reached worker 0
        left = next((i for i, e in enumerate(ev) if e["k"] == "member" and e["w"] == 2), None)
        return left is not None and sum(e["k"] == "mark" and e["kind"] == "ckpt" for e in ev[left:]) >= 5

      if when_traced(workdir, 0, past_leave, timeout_s=150):
        killed.append(os.kill(pids[0], signal.SIGKILL))

    threading.Thread(target=go, daemon=True).start()

  code, out = launch_bounded(3, args, timeout_s=300, on_pids=kill_coordinator)
  assert killed and code != 0, out[-3000:]
  assert "worker 2 exited with -9 (SIGKILL); the run goes on without it" in out
  held = {
    w: {int(s) for s in os.listdir(os.path.join(workdir, "ckpt", str(w))) if s.isdigit()} for w in range(3)
  }
  newest = max(held[0] & held[1])
  assert newest > max(held[2], default=0), held  # the newest common marker predates nothing of worker 2
  authority = {int(f.split(".")[0]) for f in os.listdir(os.path.join(workdir, "authority"))}
  assert min(authority) > max(held[2], default=0), (authority, held)  # none kept for worker 2's markers
  code, out = launch_bounded(3, args, timeout_s=300, max_restarts=1)
  assert code == 0, out[-3000:]
  assert f"resuming at checkpoint marker {newest} " in out, out[-3000:]
  assert f"worker 2: out at checkpoint marker {newest}, which the run resumes from: rejoining" in out
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  kinds = [e[2] for e in summary["membership"] if e[1] == 2]
  assert kinds == ["leave", "rejoin", "first_group"], summary["membership"]
  traces = traces_of(workdir)
  assert [e["inc"] for e in traces[2] if e["k"] == "rejoin"] == [1]
  assert sum(e["k"] == "step" for e in traces[2][[e["k"] for e in traces[2]].index("rejoin") :]) > 5
  assert sum(summary["worker_steps"]) + summary["unmade_steps"] >= 3 * steps
  config = make_config("ripples_random", 3, steps, MODEL)
  config.runtime.elastic = True
  assert max(replay_error(config, workdir)) < 1e-5

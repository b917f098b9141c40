"""The online Group Generator protocol: the authority and the workers' queues, in-process, under random
speeds and arrival orders (real threads on the runtime's code, the coordination service faked)."""

import json
import random
import threading
import time

import numpy as np
import pytest

from configs import default as default_config
from ripples_jax import algorithms, sim, timeline
from ripples_jax import schedule as schedule_lib
from ripples_jax.runtime.authority import Authority, Durations, Feed, LocalFeed, percentiles
from ripples_jax.schedule import group_gen
from ripples_jax.schedule.online import GROUP, MARK, MEMBER, NONE, STOP, Cadence, Service, fixed_entry
from tests.fakes import FakeKV

DYNAMIC = ("ripples_random", "ripples_division", "ripples_smart")
# Generators a config key chooses under one algorithm: name -> (algorithm, keys)
VARIANTS = {"moshpit_window": ("moshpit", {"moshpit.window": 1e-3})}


def config_for(algorithm, n, group_size=3):
  algorithm, keys = VARIANTS.get(algorithm, (algorithm, {}))
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.schedule.group_size = group_size
  config.update_from_flattened_dict(keys)
  return config


def run_threads(algorithm, n, steps, seed, group_size=3):
  """n worker threads against one authority: random step times, random delays before each request;
  a group is a barrier of its members (a collective). Returns (service, executed gids, steps)."""
  kv, rng = FakeKV(), random.Random(seed)
  gg = algorithms.make_group_generator(config_for(algorithm, n, group_size), np.random.default_rng(seed))
  t0 = time.perf_counter()
  service = Service(n, gg, Cadence(steps * n, eval_every=3 * n, checkpoint_every=5 * n), estimate=1e-3)
  made, append = [], service.buffer.append  # every group, though the authority trims its list

  def recording(members, now):
    g = append(members, now)
    if g is not None:
      made.append(g)
    return g

  service.buffer.append = recording
  authority = Authority(kv, service, poll_s=0.005).start()
  barriers, lock = {}, threading.Lock()
  executed, done_steps, errors = {w: [] for w in range(n)}, [0] * n, []
  taken = {w: [] for w in range(n)}  # every entry each worker's queue gave it
  speed = [rng.choice([0.5e-3, 1e-3, 3e-3]) for _ in range(n)]

  def worker(w):
    try:
      feed = Feed(kv, w, lambda: time.perf_counter() - t0, ahead=seed % 2 == 0)
      last_gid, my_rng = -1, random.Random(seed * 100 + w)
      while True:
        feed.report(done_steps[w] + 1, time.perf_counter() - t0, speed[w], last_gid)
        time.sleep(speed[w] * my_rng.uniform(0.2, 3.0))
        done_steps[w] += 1
        entry = feed.next(10.0)
        taken[w].append(entry)
        while entry[0] == MARK:
          entry = feed.next(10.0)
          taken[w].append(entry)
        if entry[0] == STOP:
          break
        if entry[0] == GROUP:
          _, gid, members = entry
          with lock:
            b = barriers.setdefault(gid, threading.Barrier(len(members)))
          b.wait(timeout=10.0)  # a member that never comes is a deadlock: BrokenBarrierError
          executed[w].append(gid)
          last_gid = gid
      feed.close()
    except Exception as e:  # noqa: BLE001
      errors.append((w, e))

  threads = [threading.Thread(target=worker, args=(w,)) for w in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  authority.stop()
  assert not any(t.is_alive() for t in threads), "a worker never finished: deadlock"
  assert not errors, errors
  return service, executed, done_steps, taken, made, kv


@pytest.mark.parametrize("algorithm", DYNAMIC + ("moshpit",) + tuple(VARIANTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_online_protocol_under_random_speeds_and_arrivals(algorithm, seed):
  n, steps = (8 if algorithm.startswith("moshpit") else 7), 30  # Moshpit: the grid (2, 4)
  service, executed, done, taken, made, kv = run_threads(algorithm, n, steps, seed)
  assert sum(done) >= steps * n  # STOP came only once the steps were done
  for w in range(n):
    queue = taken[w]
    mine = [e[1] for e in queue if e[0] == GROUP]
    assert executed[w] == mine[: len(executed[w])]  # a prefix of its part of the global order
    assert len(executed[w]) <= done[w]  # one group per local step, at most
    assert queue[-1] == (STOP,)
    # every worker's queue holds the markers, in the same order
    assert [e for e in queue if e[0] == MARK] == [e for e in taken[0] if e[0] == MARK]
  gids = [e[1] for q in taken.values() for e in q if e[0] == GROUP]
  assert sorted(set(gids)) == list(range(service.buffer.count)) == [g.gid for g in made]  # one sequence
  # Bounded: the service kept no posted entry nor dispatched group, and the store holds only the
  # start reports and each queue's last batch (STOP, never deleted): no request, no read batch.
  assert all(not e for e in service.entries) and not service.buffer.groups
  keys = sorted(kv.store)
  assert len(keys) <= 2 * n and not [k for k in keys if "/req/" in k], keys
  if algorithm == "ripples_division":  # each request's division covers every worker, no singleton
    by_request = {}
    for g in made:
      by_request.setdefault(g.request, []).extend(g.members)
    assert all(sorted(m) == list(range(n)) for m in by_request.values())
    assert {len(g.members) for g in made} == {2, 3}  # 7 into 3s: 3, 2, 2
  if algorithm == "moshpit":  # every worker's j-th group is its group of round j, along dimension j mod 2
    layouts = schedule_lib.grid_layouts((2, 4))
    for w in range(n):
      groups = [sorted(e[2]) for e in taken[w] if e[0] == GROUP]
      assert groups == [sorted(next(g for g in layouts[j % 2] if w in g)) for j in range(len(groups))]
  if algorithm == "moshpit_window":  # every group is 2 or more of one grid line
    lines = [set(g) for layout in schedule_lib.grid_layouts((2, 4)) for g in layout]
    assert made and all(len(g.members) >= 2 and any(set(g.members) <= x for x in lines) for g in made)


def test_a_request_is_answered_and_a_pending_group_is_taken_first():
  service = Service(4, group_gen.random_gg(4, 2, np.random.default_rng(0)))
  assert service.request(0, 0, 0.0)  # empty queue: a group with one partner
  ((kind, gid, members),) = service.entries[0]
  partner = [m for m in members if m != 0][0]
  assert not service.request(partner, 0, 0.1)  # its queue already has that group: nothing generated
  assert service.entries[partner] == [(GROUP, gid, members)]
  smart = Service(3, group_gen.smart_gg(3, 2, tolerance=0.1, max_gap=1), estimate=1.0)
  smart.report(1, 0.0, 1.0, 1, -1)
  smart.report(2, 0.0, 1.0, 1, -1)
  smart.request(0, 0, 0.0)  # nobody is near: skip once, answered with NONE
  assert smart.entries[0] == [(NONE,)]


def random_service(n, seed):
  service = Service(n, group_gen.random_gg(n, 3, np.random.default_rng(seed)))
  service.view.alive = np.ones(n, bool)
  return service


def ask(service, workers, rounds, t0):
  """Each worker asks for the entry after its queue's end, `rounds` times (nobody takes any)."""
  for r in range(rounds):
    for v in workers:
      service.request(v, service.appended(v), t0 + r)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_service_leave_and_rejoin_apply_the_membership_rules(seed):
  """Service.leave / rejoin as the runtime calls them (docs/design.md 3.10): after a leave the worker
  is in no group made afterwards, its pending groups left the Group Buffer, its queue is closed and
  every live queue ends with ("E", "leave", w, inc); after a rejoin every live queue ends with the
  join, the worker's fresh queue starts where its old one ended, and every group made with it carries
  it as the joiner (weight 0) until it reports a step (its first group may fail: the next must carry
  it too); a group made after its report does not."""
  n, w = 6, 2
  service, live = random_service(n, seed), [v for v in range(n) if v != w]
  ask(service, range(n), 3, 0.0)
  assert service.buffer.queues[w] and service.entries[w]
  appended = service.appended(w)
  service.leave(w, 0)
  assert service.buffer.queues[w] == [] and service.buffer.npending[w] == 0
  assert service.entries[w] == [] and service.appended(w) == appended
  assert all(service.entries[v][-1] == (MEMBER, "leave", w, 0) for v in live)
  before = service.buffer.count
  ask(service, live, 10, 3.0)
  made = service.buffer.groups[before:]
  assert made and all(w not in g.members for g in made)
  assert service.rejoin(w, 20.0, 1) == appended == service.appended(w) and service.entries[w] == []
  assert all(service.entries[v][-1] == (MEMBER, "join", w, 1) for v in live)
  assert service.joining == {w} and service.started_at[w] == 20.0 - service.estimates[w]
  ask(service, [w], 2, 20.0)
  first, second = [e for e in service.entries[w] if e[0] == GROUP][:2]
  assert first[3] == second[3] == (w,) and service.joining == {w}
  assert all(first in service.entries[m] for m in first[2])  # every member's copy carries the joiner
  service.report(w, 22.0, 1.0, int(service.steps[w]) + 1, first[1])  # a step: a model of the run's
  assert service.joining == set()
  ask(service, [w], 2, 22.0)
  later = [e for e in service.entries[w] if e[0] == GROUP][2:]
  assert later and all(len(e) == 3 for e in later)


def test_service_fail_group_and_a_simulated_leave():
  """The simulator's side (timeline/group_buffer.py): fail_group turns the group's entries that a member
  has not taken into NONE and keeps the one a member took; the group leaves every member's Group
  Buffer queue. leave without inc and drop_pending posts no membership entry and leaves the Group
  Buffer to fail_group."""
  n = 6
  service = random_service(n, 0)
  ask(service, range(n), 3, 0.0)
  _, gid, members = service.entries[0][0]
  took = members[0]  # has taken the group already: its entry stays
  taken = [0] * n
  taken[took] = service.entries[took].index((GROUP, gid, members)) + 1
  before = [list(q) for q in service.entries]
  service.fail_group(gid, members, taken)
  for m in range(n):
    want = [(NONE,) if e == (GROUP, gid, members) and m in members and m != took else e for e in before[m]]
    assert service.entries[m] == want
    assert gid not in [g.gid for g in service.buffer.queues[m]]
    assert service.buffer.npending[m] == len(service.buffer.queues[m])
  w = members[1]
  pending, lengths = list(service.buffer.queues[w]), [len(q) for q in service.entries]
  service.leave(w, drop_pending=False)
  assert not service.view.alive[w] and service.buffer.queues[w] == pending
  assert [len(q) for q in service.entries] == [0 if v == w else k for v, k in enumerate(lengths)]


def test_service_state_resumes_the_same_generation():
  def fresh():
    return Service(6, group_gen.division_gg(6, 3, np.random.default_rng(5)), Cadence(100, 0, 10))

  a = fresh()
  for w in (0, 3, 1):
    a.request(w, len(a.entries[w]), 0.0)
  saved = a.state()
  b = fresh()
  b.load(saved)
  for s in (a, b):
    for w in (2, 5):
      s.request(w, len(s.entries[w]), 1.0)
  new_a = [g.members for g in a.buffer.groups[-4:]]
  new_b = [g.members for g in b.buffer.groups]
  assert new_a == new_b and b.state()["gid"] == a.state()["gid"]


def test_local_feed_follows_the_fixed_schedule_and_resumes_after_its_marker():
  layouts = schedule_lib.static.static_gg_layouts(8, 4)
  feed = LocalFeed(layouts, 8, 5, num_steps=10, eval_every=4, checkpoint_every=3)
  got = [feed.next(1) for _ in range(9 + 5 + 1)]  # 9 syncs, markers at points 3,4,6,8,9, STOP
  syncs = [e for e in got if e[0] in (GROUP, NONE)]
  assert syncs == [fixed_entry(layouts, 8, 5, k) for k in range(9)]
  assert got[-1] == (STOP,)
  marks = [(e[1], e[2]) for e in got if e[0] == MARK]
  assert marks == [("ckpt", 1), ("eval", 1), ("ckpt", 2), ("eval", 2), ("ckpt", 3)]
  # resumed at the point of ckpt 2 (6 syncs): the next entry is layout 6's group, no marker again
  resumed = LocalFeed(layouts, 8, 5, num_steps=10, eval_every=4, checkpoint_every=3, resume_point=6)
  assert resumed.next(1) == fixed_entry(layouts, 8, 5, 6)


def test_division_sizes_are_balanced():
  assert group_gen.division_sizes(16, 3) == [3, 3, 3, 3, 2, 2]
  assert group_gen.division_sizes(8, 3) == [3, 3, 2]
  assert group_gen.division_sizes(15, 3) == [3] * 5
  assert group_gen.division_sizes(16, 4) == [4] * 4


def window_rates(trace, n, width, end):
  """Worker steps finished per second in consecutive windows of `width` seconds."""
  applied = np.array([t for t, kind, *_ in trace.events if kind == timeline.APPLY])
  edges = np.arange(0.0, end + 1e-12, width)
  return np.histogram(applied, edges)[0] / width


def test_smart_gg_follows_a_moving_straggler_in_every_window():
  rates = {}
  for algorithm in ("allreduce", "ripples_smart"):
    config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers=8")
    config.hetero.slow_workers, config.hetero.slowdown, config.hetero.jitter = (0,), 5.0, 0.05
    config.hetero.rotate_every = 0.3  # 6 slow steps of 0.05 s between moves
    speed, net = sim.build_clock(config, model_bytes=4e5, base_time=0.01)
    gg = algorithms.make_group_generator(config, np.random.default_rng(0))
    trace = timeline.simulate(timeline.ClockSpec(algorithm, speed, net, 3000, time_budget=3.0, gg=gg))
    rates[algorithm] = window_rates(trace, 8, 0.3, 3.0)
  # Every window of one straggler position: Smart GG within 15% of the limit (5 x 7 + 1) / 8 = 4.5,
  # so it recovered after each move (with estimates that ignore the reported step times: 3.1-3.8x).
  ratio = rates["ripples_smart"] / rates["allreduce"]
  assert (ratio > 0.85 * 4.5).all(), ratio


def test_the_slow_worker_moves_on_the_clock():
  assert timeline.slow_at((3,), 8, 0.0, 100.0) == (3,)
  assert [timeline.slow_at((3,), 8, 2.0, t) for t in (0.0, 1.9, 2.0, 15.9, 16.0)] == [
    (3,),
    (3,),
    (4,),
    (2,),
    (3,),
  ]


def test_a_request_carries_the_step_time_the_generator_plans_with():
  """The start report travels from a thread and may arrive after the request it precedes: the
  request itself carries the worker's newest step time, and the authority plans with it."""
  kv, n = FakeKV(), 3
  service = Service(n, group_gen.smart_gg(n, 2, tolerance=0.5, max_gap=1), estimate=1.0)
  authority = Authority(kv, service, poll_s=0.005).start()
  try:
    feed = Feed(kv, 1, lambda: 0.0, ahead=False)
    feed.step_time = 0.25  # as report() sets it; its report is not sent at all here
    feed._request(0.0)
    entry = feed.next(10.0)
    assert entry[0] in (GROUP, NONE) and service.estimates[1] == 0.25
    assert service.estimates[0] == service.estimates[2] == 1.0
  finally:
    authority.stop()
  assert not [k for k in kv.store if "/req/" in k]  # read, then deleted (its page, at the latest at stop)


def test_durations_keep_bounded_state_and_the_figures_they_feed():
  """Per-request seconds (Authority.handled, Feed.rtts and .blocked) in bounded memory: every value
  while few (the figures exactly the list's), then a histogram whose size depends on the values' range,
  not their number (percentiles within Durations.BIN)."""
  rng = np.random.default_rng(0)
  few = list(rng.lognormal(-5, 1, Durations.EXACT))
  d = Durations(few)
  assert percentiles(d) == percentiles(few) and d.as_record() == few
  merged = Durations.merged([few, few[:10], None])  # the summary joins the workers' end lines
  assert percentiles(merged) == percentiles(few + few[:10])
  values = np.clip(rng.lognormal(-5, 1.5, 200_000), 1e-5, 1.0)
  d = Durations(values[:100_000])
  bins = len(d.bins)
  d.extend(values[100_000:])
  bound = np.log(1e5) / np.log1p(Durations.BIN) + 2  # bins between 10 us and 1 s
  assert d.values == [] and bins <= len(d.bins) <= bound and len(d.recent) == Durations.RECENT
  assert len(d) == 200_000 and np.isclose(d.total, values.sum(), rtol=1e-12)
  for q in (50, 90, 99):
    assert abs(d.percentile(q) / np.percentile(values, q) - 1) < Durations.BIN, q
  record = d.as_record()  # what the trace's end line holds
  again = Durations.merged([record, list(values[:5])])
  assert len(again) == 200_005 and np.isclose(again.total, values.sum() + values[:5].sum())
  assert abs(percentiles(again)["p99_ms"] / (np.percentile(values, 99) * 1e3) - 1) < Durations.BIN


def test_the_authority_and_feeds_keep_no_list_per_request(monkeypatch):
  monkeypatch.setattr(Durations, "EXACT", 16)
  kv, n, steps = FakeKV(), 3, 60
  gg = algorithms.make_group_generator(config_for("ripples_random", n, 2), np.random.default_rng(0))
  service = Service(n, gg, Cadence(steps * n), estimate=1e-3)
  authority = Authority(kv, service, poll_s=0.005).start()
  feeds = [Feed(kv, w, lambda: 0.0, ahead=False) for w in range(n)]

  def worker(w):
    for s in range(1, 10 * steps):
      feeds[w].report(s, 0.0, 1e-3, -1)
      if feeds[w].next(10.0)[0] == STOP:
        return

  threads = [threading.Thread(target=worker, args=(w,)) for w in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert authority.join(10)  # its last round counts its requests after posting STOP
  authority.stop()
  requests = sum(f.requests for f in feeds)
  # Every request was served, but the last of each worker's that STOP answered before it arrived.
  assert requests > 3 * Durations.EXACT and requests - n <= len(authority.handled) <= requests
  for d in [authority.handled, *(f.rtts for f in feeds), *(f.blocked for f in feeds)]:
    assert d.values == [] or len(d) <= Durations.EXACT  # past the cap: only the histogram
  for f in feeds:
    f.close()


def test_a_smart_gg_feed_asks_one_round_trip_before_its_step_ends():
  """Smart GG plans with who is ready when, so it is asked at the end of a step; with `lead` the
  request leaves one measured round trip (p90 + 2 ms) before that, and says when the step will end."""
  for lead in (True, False):
    kv = FakeKV()
    feed = Feed(kv, 0, lambda: 0.0, ahead=False, lead=lead)
    feed.rtts.extend([0.010] * 5)  # measured round trips: the lead is 12 ms
    t0 = time.perf_counter()
    feed.report(1, 5.0, 0.2, -1)  # a step started at run time 5.0; the last one took 0.2 s
    deadline = t0 + 0.5
    while "ripples/req/0/0/0" not in kv.store and time.perf_counter() < deadline:
      time.sleep(0.002)
    sent = time.perf_counter() - t0
    if lead:
      assert 0.17 < sent < 0.25, sent
      assert kv.store["ripples/req/0/0/0"].split()[:2] == ["0", "5.2"]
    else:
      assert "ripples/req/0/0/0" not in kv.store  # no lead: asked only when the step has ended
    feed.close()
  # A step that ends before its lead request went asks at once, once.
  kv = FakeKV()
  feed = Feed(kv, 0, lambda: 1.0, ahead=False, lead=True)
  feed.rtts.extend([0.010] * 5)
  feed.report(1, 0.0, 0.3, -1)
  kv.key_value_set("ripples/q/0/0/0", "N")  # an answer is there already (someone else's request)
  time.sleep(0.05)  # fetched into the local queue
  assert feed.next(1.0) == (NONE,)
  time.sleep(0.35)
  assert not [k for k in kv.store if "/req/" in k]  # the timer was cancelled: no stray request
  feed.close()


def simulated(algorithm, n=8, steps=2000, cost=None, budget=0.0):
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.schedule.workers_per_node = n  # Static GG: one group of every worker
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=0.01)
  gg = algorithms.make_group_generator(config, np.random.default_rng(0))
  return timeline.simulate(
    timeline.ClockSpec(algorithm, speed, net, steps, time_budget=budget, gg=gg, server=cost)
  )


def test_the_simulated_authority_is_one_fifo_server():
  """With a service time per request the authority serves at most 1 / service requests a second, and
  answers late once requests queue; at zero it costs nothing (the run is the same one)."""
  free = simulated("ripples_random")
  same = simulated("ripples_random", cost=timeline.AuthorityCost())
  assert free.end_time == same.end_time and np.array_equal(free.worker_steps, same.worker_steps)
  busy = simulated("ripples_random", cost=timeline.AuthorityCost(service=0.02))
  assert busy.requests <= busy.end_time / 0.02 + 1  # one server
  assert busy.end_time > 1.2 * free.end_time  # ~125 requests a second asked, 50 served: it saturates
  light = simulated("ripples_random", cost=timeline.AuthorityCost(service=1e-5))
  assert light.end_time < 1.01 * free.end_time


def test_group_set_up_is_paid_once_per_member_set_or_pair():
  """Static GG with one group of all 4 workers meets one member set: 1 s of set-up once; counted by
  pairs, 6 of them."""
  base = simulated("ripples_static", n=4, steps=400)
  once = simulated("ripples_static", n=4, steps=400, cost=timeline.AuthorityCost(setup=1.0))
  by_pair = timeline.AuthorityCost(setup=1.0, setup_unit="pair")
  pairs = simulated("ripples_static", n=4, steps=400, cost=by_pair)
  assert once.end_time - base.end_time == pytest.approx(1.0)
  assert pairs.end_time - base.end_time == pytest.approx(6.0)


def test_a_request_sent_as_a_step_starts_carries_that_steps_report():
  """Request-ahead (Random GG, Group Division): the request sent as a step starts carries its start
  report, which is then not sent on its own (one store call, not two); an older report found in the
  store afterwards does not undo it."""
  kv, n = FakeKV(), 2
  service = Service(n, group_gen.random_gg(n, 2, np.random.default_rng(0)), estimate=1.0)
  authority = Authority(kv, service, poll_s=0.005).start()
  feed = Feed(kv, 0, lambda: 0.0, ahead=True)
  try:
    feed.report(3, 7.5, 0.2, -1, 2)
    assert feed.next(10.0)[0] in (GROUP, NONE)
    time.sleep(0.05)
    assert "ripples/started/0" not in kv.store  # no report of its own
    assert service.steps[0] == 3 and service.started_at[0] == 7.5 and authority.epochs[0] == 2
    kv.key_value_set("ripples/started/0", "2 1.0 0.2 -1 1", allow_overwrite=True)  # step 2's, late
    time.sleep(0.1)  # rounds have read it
    assert service.steps[0] == 3 and service.started_at[0] == 7.5 and authority.epochs[0] == 2
  finally:
    feed.close()
    authority.stop()


def test_fresh_smart_gg_ranks_its_last_group_after_the_others_ready_in_time():
  """schedule.smart_fresh: the asker's last group's members rank after the other workers expected
  within the tolerance (that is what breaks the lock of 15 live workers in groups of 3:
  results/baselines/README.md), never after the workers outside it; the default picks the soonest
  again. The last groups are the generator's state (a resumed authority picks the same)."""

  def pick(gen, ready, asker=0):
    buffer = group_gen.GroupBuffer(6)  # expected ready at `ready`: started at ready - 1, 1 s steps
    view = group_gen.GGView(0.0, buffer, np.asarray(ready, np.float64) - 1, np.ones(6), lambda w: 0)
    gen(asker, view)
    return buffer.groups[0].members

  near = [0.0, 0.1, 0.2, 0.3, 0.4, 0.45]  # everyone within 0.5 of worker 0's step
  base, fresh = group_gen.smart_gg(6, 3), group_gen.smart_gg(6, 3, fresh=True)
  assert pick(base, near) == pick(fresh, near) == (0, 1, 2)
  assert pick(base, near) == (0, 1, 2)  # the default: the soonest again
  resumed = group_gen.smart_gg(6, 3, fresh=True)
  resumed.load(json.loads(json.dumps(fresh.state())))
  assert pick(fresh, near) == (0, 3, 4) and pick(resumed, near) == (0, 3, 4)
  assert pick(fresh, near) == (0, 1, 2)  # (0, 3, 4) is now the last group
  # Only 1 and 2 within the tolerance: fresh takes them rather than someone outside it.
  fresh2 = group_gen.smart_gg(6, 3, fresh=True)
  far = [0.0, 0.1, 0.2, 0.9, 1.0, 1.1]
  assert pick(fresh2, far) == pick(fresh2, far) == (0, 1, 2)
  # A group is the last group of each of its members: worker 1 now ranks 0 and 2 after 3 and 4.
  assert pick(fresh2, [0.0, 0.0, 0.1, 0.2, 0.25, 0.4], asker=1) == (1, 3, 4)
  assert pick(base, [0.0, 0.0, 0.1, 0.2, 0.25, 0.4], asker=1) == (0, 1, 2)
  # Ranks are exact: 4 is ready 3e-5 s before 3, both outside the tolerance (nobody near, no skip
  # left), and fresh takes 4 as the default does (a sum of tier x 1e12 and the time rounded them equal).
  times = [0.0, 5.0, 5.0, 2.00003, 2.0, 5.0]
  assert (
    pick(group_gen.smart_gg(6, 2, max_gap=0, fresh=True), times)
    == pick(group_gen.smart_gg(6, 2, max_gap=0), times)
    == (0, 4)
  )


def _window_view(n, ready, pending=(), alive=None):
  """A view where worker w is expected ready at ready[w] (started a 1 s step before) and the workers
  in `pending` have a group queued; now is 0."""
  buffer = group_gen.GroupBuffer(n)
  buffer.npending[list(pending)] = 1
  alive = None if alive is None else np.asarray(alive, bool)
  return group_gen.GGView(0.0, buffer, np.asarray(ready, np.float64) - 1, np.ones(n), lambda w: 0, alive)


def test_windowed_moshpit_matches_its_line_within_the_window_and_bounds_its_skips():
  """Grid (2, 4): lines along dimension 0 are the pairs (w, w + 4), along 1 the fours. The asker's line
  of its own dimension, those free and ready within the window; members move past that dimension; a
  worker alone skips and moves on, at most max_gap times in a row; a line without a live peer is
  passed over."""
  layouts = schedule_lib.grid_layouts((2, 4))
  gen = group_gen.moshpit_window_gg(layouts, window=0.1, max_gap=1)
  view = _window_view(8, [0.0, 0.05, 0.0, 0.0, 0.09, 0.0, 0.0, 0.0])
  gen(0, view)  # dimension 0: its pair (0, 4), 4 ready within 0.1
  assert [g.members for g in view.buffer.groups] == [(0, 4)] and gen.dims.tolist()[:5] == [1, 0, 0, 0, 1]
  view = _window_view(8, [0.0, 0.05, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0], pending=[3])
  gen(0, view)  # dimension 1: 1 within the window, 2 too late, 3 not free
  assert [g.members for g in view.buffer.groups] == [(0, 1)] and gen.dims[[0, 1]].tolist() == [0, 0]
  view = _window_view(8, [0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0])
  gen(0, view)  # alone (4 is 0.5 s away): no group, its next dimension, one skip
  assert not view.buffer.groups and gen.dims[0] == 1 and gen.skipped[0] == 1
  view = _window_view(8, [0.0, 0.28, 0.4, 0.2, 0.25, 0.0, 0.0, 0.0])
  gen(0, view)  # max_gap reached: the soonest peer of any line (4 at 0.25 > 3 at 0.2: dimension 1's 3)
  assert [g.members for g in view.buffer.groups] == [(0, 1, 3)] and gen.skipped[0] == 0  # 1 within 0.1 of 3
  # A dead pair partner: dimension 0 is passed over, the asker averages along dimension 1.
  gen = group_gen.moshpit_window_gg(layouts, window=0.1)
  view = _window_view(8, [0.0] * 8, alive=[1, 1, 1, 1, 0, 1, 1, 1])
  gen(0, view)
  assert [g.members for g in view.buffer.groups] == [(0, 1, 2, 3)] and gen.dims[0] == 0


def test_windowed_moshpit_resumes_the_same_groups():
  """Its state (JSON) taken mid-run and loaded into a fresh generator, with the Group Buffer's, gives the
  same future groups under the same requests."""
  n, rng = 8, np.random.default_rng(0)
  layouts = schedule_lib.grid_layouts((2, 4))
  events = [
    (int(rng.integers(3)), int(rng.integers(n)), float(rng.choice([0.01, 0.01, 0.05]))) for _ in range(600)
  ]

  def play(gen, view, events, t0):
    made = []
    for i, (kind, w, step) in enumerate(events):
      now = t0 + 0.003 * i
      if kind == 0:  # w asks, ready now
        before = view.buffer.count
        view.now = now
        gen(w, view)
        made += [g.members for g in view.buffer.groups[before - view.buffer.first :]]
      elif kind == 1:  # w starts a step
        view.started_at[w], view.estimates[w] = now, step
      elif view.buffer.pending(w):  # w ran its next group
        view.buffer.done(w, view.buffer.queues[w][0].gid)
    return made

  def fresh():
    buffer = group_gen.GroupBuffer(n)
    view = group_gen.GGView(0.0, buffer, np.zeros(n), np.full(n, 0.01), lambda w: 0, np.ones(n, bool))
    return group_gen.moshpit_window_gg(layouts, window=0.004, max_gap=2), view

  a, view_a = fresh()
  first = play(a, view_a, events[:300], 0.0)
  b, view_b = fresh()
  b.load(json.loads(json.dumps(a.state())))
  view_b.buffer.load(json.loads(json.dumps(view_a.buffer.state())))
  view_b.started_at[:], view_b.estimates[:] = view_a.started_at, view_a.estimates
  rest_a, rest_b = play(a, view_a, events[300:], 0.9), play(b, view_b, events[300:], 0.9)
  assert len(first) > 20 and len(rest_a) > 20 and rest_a == rest_b
  assert a.state() == b.state() and {len(m) for m in rest_a} == {2, 3}

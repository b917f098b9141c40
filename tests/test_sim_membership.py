"""Workers leaving and rejoining as clock events of the simulator (hetero.leave, docs/design.md 3.10)."""

import hashlib
import json

import jax
import numpy as np
import pytest

from configs import default as default_config
from ripples_jax import algorithms, engine, optim, run, sim, timeline
from ripples_jax import collectives as C
from ripples_jax.config import ConfigError, validate_train_config
from ripples_jax.data import batch_indices, load_dataset, shard_indices
from ripples_jax.models import build_model
from ripples_jax.optim import make_optimizer
from tests.test_sim import _small_config

# Worker 2 (AD-PSGD: a passive one) away for 0.1 s, worker 5 (an active one) gone for good.
LEAVE = ((2, 0.05, 0.15), (5, 0.1, -1))
ELASTIC = ("ripples_smart", "ripples_random", "ripples_division", "adpsgd", "ps_async", "moshpit")


def config_of(algorithm, n=8, leave=(), group_size=3, jitter=0.2, slow=()):
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.schedule.group_size = group_size
  config.hetero.slow_workers, config.hetero.slowdown, config.hetero.jitter = slow, 3.0, jitter
  config.hetero.leave = leave
  return config


def clock(config, steps=40, rtt=0.0):
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=0.01)
  gg = algorithms.make_group_generator(config, np.random.default_rng([4, config.seed]))
  total = steps * config.num_workers
  return timeline.simulate(
    timeline.ClockSpec(config.algorithm, speed, net, total, gg=gg, rtt=rtt, leave=sim.leave_plan(config))
  )


def workers_of(kind, a, b):
  """The workers an event touches (a parameter server's slot too)."""
  if kind == timeline.AVG:
    return set(a)
  if kind in (timeline.JOIN, timeline.PULL, timeline.APPLY):
    return {a, b}
  return {a} if kind == timeline.START else set()


@pytest.mark.parametrize("rtt", [0.0, 0.003])
@pytest.mark.parametrize("algorithm", ELASTIC)
def test_a_left_worker_is_in_no_group_and_takes_no_step_until_its_first_group(algorithm, rtt):
  trace = clock(config_of(algorithm, leave=LEAVE), rtt=rtt)
  first = {w: t for t, w, e in trace.membership if e == "first_group"}
  assert [(w, e) for _, w, e in trace.membership] == [
    (2, "leave"),
    (5, "leave"),
    (2, "rejoin"),
    (2, "first_group"),
  ]
  away = {2: (0.05, first[2]), 5: (0.1, np.inf)}
  for t, kind, a, b in trace.events:
    for w, (t0, t1) in away.items():
      if w in workers_of(kind, a, b):
        # Nothing from its leave to its first group, which is a JOIN, then its next START.
        assert not t0 < t < t1 and (t != t1 or kind in (timeline.JOIN, timeline.START)), (w, t, kind, a, b)
  join = [e for e in trace.events if e[1] == timeline.JOIN]
  assert [(t, a) for t, _, a, _ in join] == [(first[2], 2)] and join[0][3] != 2  # from someone else
  assert any(kind == timeline.APPLY and b == 2 and t > first[2] for t, kind, a, b in trace.events)
  # The run still ends at its step budget: the live workers make up the dead ones' steps.
  assert trace.worker_steps.sum() == 40 * 8
  assert trace.worker_steps[5] < trace.worker_steps[2] < trace.worker_steps[[0, 1, 3, 4, 6, 7]].mean()


@pytest.mark.parametrize("algorithm", ELASTIC)
def test_a_leave_after_the_run_changes_nothing(algorithm):
  """The generators' live-worker path makes the very draws of their plain path when all are live."""
  plain = clock(config_of(algorithm, slow=(1,)), steps=15)
  late = clock(config_of(algorithm, slow=(1,), leave=((2, 1e6, -1),)), steps=15)
  assert late.events == plain.events and late.membership == []


# Without hetero.leave the clock is what it was before leave/join existed: the events of a small run
# (times to 1e-9, kinds, workers) hashed, as computed by the code before it (commit 5c85bb5).
GOLDEN_EVENTS = {
  "ripples_random": ("911c48e890f3f07c", 0.2863745693997278),
  "ripples_division": ("0880bd8eeda25c26", 0.2552804559004655),
  "ripples_smart": ("f8a49cfc05239696", 0.14317884795322425),
  "adpsgd": ("74bc6ad5aaf3cb07", 0.11286306869621182),
  "ps_async": ("63d5076827b58b2b", 0.12247797271360304),
}


@pytest.mark.parametrize("algorithm", list(GOLDEN_EVENTS))
def test_golden_clock_without_leave_is_unchanged(algorithm):
  trace = clock(config_of(algorithm, slow=(1,)), steps=10, rtt=0.002)
  events = [[round(t, 9), k, list(a) if isinstance(a, tuple) else a, b] for t, k, a, b in trace.events]
  digest = hashlib.sha256(json.dumps(events).encode()).hexdigest()[:16]
  assert (digest, trace.end_time) == (GOLDEN_EVENTS[algorithm][0], pytest.approx(GOLDEN_EVENTS[algorithm][1]))


def _engine_setup(config, steps):
  """The clock trace of `config` and what the engine needs to replay it (an optimizer with a step
  count in its state: the cosine schedule)."""
  n = config.num_workers
  trace = clock(config, steps=steps)
  data = load_dataset("synthetic", seed=0)
  shards = shard_indices(data["y_train"], n, "iid", seed=0)
  model = build_model("mlp", data["num_classes"], hidden=(8,))
  opt = make_optimizer(config.optimizer, steps)
  mesh = C.make_worker_mesh(n, jax.devices()[:1])
  init = lambda: engine.init_sim_state(model, opt, jax.random.key(0), data["x_train"][:1], n, mesh)  # noqa: E731

  def batch(starts):
    idx = batch_indices(shards, 4, 0, starts)
    return data["x_train"][idx], data["y_train"][idx]

  return trace, model, opt, mesh, init, batch


def test_a_rejoined_worker_starts_from_the_others_mean_with_fresh_optimizer_state():
  """Event by event: at its JOIN the rejoined worker holds the mean of its group's other members
  (numpy, before their average; its own weight 0), and its optimizer state is optimizer.init's
  (momentum zero) where before it was not, with its schedule at its own step count."""
  config = config_of("ripples_random", leave=((3, 0.03, 0.08),))
  trace, model, opt, mesh, init, batch = _engine_setup(config, steps=12)
  fn = engine.make_sim_round_fn(model, opt, mesh, 8, 8, pull=True)
  state, starts = init(), np.zeros(8, np.int64)
  flat = lambda tree: np.concatenate([np.asarray(a).reshape(8, -1) for a in jax.tree.leaves(tree)], 1)  # noqa: E731
  before = []  # the params before each event
  joins = 0
  for i, event in enumerate(trace.events):
    before.append(flat(state["params"]))
    opt_before = [np.array(a) for a in jax.tree.leaves(state["opt_state"])]  # copies: the state is donated
    opt_before_tree = jax.tree.map(np.array, state["opt_state"])
    r = next(timeline.pack_rounds([event], 8, 8))
    x, y = batch(starts)
    reset = r.get("reset", np.zeros(8, bool))
    state, _ = fn(state, x, y, r["apply_src"], r["gid"], r["ring"], r["pull_src"], r["start"], reset)
    starts += r["start"]
    if event[1] != timeline.JOIN:
      continue
    joins += 1
    w, src = event[2], event[3]
    prev = trace.events[i - 1]
    group_avg = prev[1] == timeline.AVG and src in prev[2] and w not in prev[2]
    others = list(prev[2]) if group_avg else [src]
    assert len(others) == 2  # Random GG, groups of 3: the others averaged first
    ref = before[i - 1 if group_avg else i]
    now = flat(state["params"])
    np.testing.assert_allclose(now[w], ref[others].mean(0), rtol=1e-6, atol=1e-7)
    assert not np.allclose(now[w], ref[others + [w]].mean(0), rtol=1e-4)  # its own weight is 0
    counts = lambda s: [
      np.asarray(x.count)[w] for x in jax.tree.leaves(s, is_leaf=optim._is_schedule) if optim._is_schedule(x)
    ]  # noqa: E731
    momentum = [
      np.asarray(a)[w]
      for a in jax.tree.leaves(optim.at_schedule_step(state["opt_state"], np.zeros(8, np.int32)))
    ]
    assert all((a == 0).all() for a in momentum)  # optimizer.init: zero momentum
    assert (
      counts(state["opt_state"]) == counts(opt_before_tree) and counts(opt_before_tree)[0] > 0
    )  # its schedule goes on
    assert all((a[w] != 0).any() for a in opt_before)  # what it had before its leave
  assert joins == 1


@pytest.mark.slow  # in process, too long for the fast tier
def test_compact_rounds_equal_full_rounds_with_leave_and_join():
  """The executor's two round programs agree to the bit on a trace with a JOIN (a pull that resets)."""
  config = config_of("ripples_division", leave=((3, 0.03, 0.08), (6, 0.05, -1)))
  trace, model, opt, mesh, init, batch = _engine_setup(config, steps=10)
  full = engine.make_sim_round_fn(model, opt, mesh, 8, 8, pull=True)
  compact = engine.make_compact_round_fn(model, opt, mesh, 8)
  a, b, starts, resets = init(), init(), np.zeros(8, np.int64), 0
  for r in timeline.pack_rounds(trace.events, 8, 8):
    x, y = batch(starts)
    reset = r.get("reset", np.zeros(8, bool))
    resets += reset.sum()
    a, loss_a = full(a, x, y, r["apply_src"], r["gid"], r["ring"], r["pull_src"], r["start"], reset)
    c = sim.compact_round(r, 8)
    rows = np.minimum(c["idx"], 7)
    cr = c.get("reset", np.zeros(len(c["idx"]), bool))
    b, loss_b = compact(
      b, c["idx"], x[rows], y[rows], c["apply_src"], c["gid"], c["pull_src"], c["start"], cr
    )
    np.testing.assert_array_equal(np.asarray(loss_a), np.asarray(loss_b))
    starts += r["start"]
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))
  assert resets == 1


@pytest.mark.slow  # in process, too long for the fast tier
def test_a_run_with_leave_and_join_reports_its_membership(tmp_path):
  leave = ((2, 0.01, 0.03), (5, 0.02, -1))
  summary, trace = sim.simulate_and_train(
    _small_config("ripples_division", **{"hetero.leave": leave}), str(tmp_path)
  )
  stored = json.loads((tmp_path / "summary.json").read_text())
  assert stored["membership"] == summary["membership"] == [list(m) for m in trace.membership]
  assert [(w, e) for _, w, e in trace.membership] == [
    (2, "leave"),
    (5, "leave"),
    (2, "rejoin"),
    (2, "first_group"),
  ]
  assert sum(summary["worker_steps"]) == 6 * 8 and summary["worker_steps"][5] < 6
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert records[-1]["step"] == 6 and np.isfinite(records[-1]["test_accuracy"])


def test_live_at_counts_a_rejoined_worker_from_its_first_group():
  m = [(0.1, 2, "leave"), (0.2, 5, "leave"), (0.3, 2, "rejoin"), (0.4, 2, "first_group")]
  assert np.flatnonzero(~sim.live_at(m, 8, 0.05)).tolist() == []
  assert np.flatnonzero(~sim.live_at(m, 8, 0.2)).tolist() == [2, 5]
  assert np.flatnonzero(~sim.live_at(m, 8, 0.35)).tolist() == [2, 5]
  assert np.flatnonzero(~sim.live_at(m, 8, 0.4)).tolist() == [5]


@pytest.mark.parametrize(
  "algorithm, why",
  [
    ("allreduce", "its every-worker collective cannot go on without a member"),
    ("ps_sync", "its synchronous step waits for every worker"),
    ("dpsgd", "its fixed ring cannot exclude a member"),
    ("ripples_static", "Static GG's fixed groups cannot exclude a member"),
  ],
)
def test_leave_is_refused_in_one_line_before_any_compile(algorithm, why, tmp_path, compile_counter):
  config = _small_config(algorithm, **{"hetero.leave": ((3, 0.1, -1),)})
  with pytest.raises(ConfigError) as refused:
    run.train_and_evaluate(config, str(tmp_path))
  assert str(refused.value) == (
    f"config.hetero.leave: ((3, 0.1, -1),) is not allowed: () with algorithm={algorithm}: {why}"
  )
  assert compile_counter == []


@pytest.mark.parametrize(
  "leave",
  [
    ((8, 0.1, -1),),  # no such worker
    ((3, 0.2, 0.1),),  # rejoins before it leaves
    ((3, -0.1, -1),),
    ((3, 0.1),),  # not a triple
    ((3, 0.1, 0.3), (3, 0.2, -1)),  # leaves again before it rejoined
    ((3, 0.1, -1), (3, 0.5, 0.6)),  # ... or after it never rejoins
  ],
)
def test_bad_leave_values_are_refused_naming_the_key(leave):
  config = config_of("ripples_smart", leave=leave)
  with pytest.raises(
    ConfigError, match=r"^config\.hetero\.leave: .* is not allowed: \(\) or \(worker, t_leave"
  ):
    validate_train_config(config, 8)
  config.hetero.leave = ((3, 0.1, 0.3), (3, 0.4, float("inf")), (2, 0.0, -1))
  validate_train_config(config, 8)  # in order and apart: fine


@pytest.mark.parametrize("executor, algorithm", [("spmd", "ripples_static"), ("async", "ripples_random")])
def test_leave_needs_the_simulator(executor, algorithm):
  config = default_config.get_config(f"algorithm={algorithm},executor={executor},num_workers=8")
  config.hetero.leave = ((3, 0.1, -1),)
  with pytest.raises(ConfigError) as refused:
    validate_train_config(config, 8, num_processes=9 if executor == "async" else 1)
  assert str(refused.value).startswith(
    f"config.hetero.leave: ((3, 0.1, -1),) is not allowed: () with executor={executor}"
  )


def test_a_pair_that_failed_once_waits_for_the_removal():
  """Moshpit on a 4x4 grid, worker 5 dead at 0.1 s and removed at 0.2 s (detect): its row (4, 6, 7) and
  column (1, 9, 13) meet it in alternate rounds. The first group after the death fails at once and its
  members step on; the next one holding the same dead peer waits until the removal (the runtime's
  handshake on the pair's fresh connection: runtime/preduce.py, runtime/membership.py)."""
  d = 0.1
  config = config_of("moshpit", n=16, leave=((5, 0.1, -1),), jitter=0.0)
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=0.01)
  gg = algorithms.make_group_generator(config, np.random.default_rng([4, config.seed]))
  trace = timeline.simulate(
    timeline.ClockSpec("moshpit", speed, net, 40 * 16, gg=gg, leave=sim.leave_plan(config), detect=d)
  )
  until_removal = {w: t0 for w, kind, t0, t1 in trace.intervals if kind == timeline.WAIT and t1 == 0.1 + d}
  assert sorted(until_removal) == [1, 4, 6, 7, 9, 13]
  for w, t0 in until_removal.items():  # it stepped after the first failure, before its wait began
    assert any(k == timeline.APPLY and a == w and 0.1 < t < t0 for t, k, a, _ in trace.events), w


def test_a_held_member_holds_those_it_reaches_after_its_wait():
  """The runtime's members exchange in rank order: 4, whose pair with the dead 15 failed before, waits
  at 15 in the handshake, after its exchange with 10; 10 reaches 15 once (a first failure: at once)."""
  from ripples_jax.timeline.group_buffer import held_members

  assert held_members([4, 10], [15], {(4, 15)}) == {4}
  # 3 waits at the dead 5 before its exchange with 9, so 9 waits for 3; 9 then reaches 12 late.
  assert held_members([3, 9, 12], [5], {(3, 5)}) == {3, 9, 12}
  # 3 reaches 4 before its wait, but 4 then waits for 9, held at 3.
  assert held_members([3, 4, 9], [5], {(3, 5)}) == {3, 4, 9}
  assert held_members([3, 4], [5], {(3, 5)}) == {3}
  assert held_members([3, 9], [5], {(9, 5)}) == {9}  # 9 reaches 3 before 5
  assert held_members([3, 9], [5], set()) == set()  # first meetings: everyone fails at once


def test_only_the_held_members_of_a_group_wait_for_the_removal():
  """Random GG, 8 workers, worker 7 dead at 0.1 s and removed at 0.2 s: its group (4, 5, 7) comes after
  4 met 7 once already, so 4 waits in the handshake until the removal, while 5 (its first meeting,
  and 4 reached it before 7) fails at once and steps on."""
  config = config_of("ripples_random", n=8, leave=((7, 0.1, -1),), jitter=0.0)
  config.seed = 2
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=0.01)
  gg = algorithms.make_group_generator(config, np.random.default_rng([4, config.seed]))
  trace = timeline.simulate(
    timeline.ClockSpec("ripples_random", speed, net, 40 * 8, gg=gg, leave=sim.leave_plan(config), detect=0.1)
  )
  group = [g for g in trace.buffer.groups if g.members == (4, 5, 7) and g.created > 0.1][-1]
  until_removal = {w: t0 for w, kind, t0, t1 in trace.intervals if kind == timeline.WAIT and t1 == 0.2}
  assert 5 not in until_removal and until_removal[4] >= group.created - 0.01
  steps = lambda w: [t for t, k, a, _ in trace.events if k == timeline.APPLY and a == w]  # noqa: E731
  assert not [t for t in steps(4) if until_removal[4] < t < 0.2]
  assert [t for t in steps(5) if until_removal[4] < t < 0.2]


@pytest.mark.parametrize("algorithm", ["ripples_random", "ripples_division", "ripples_smart"])
def test_a_death_noticed_late_fails_its_groups_until_it_is_removed(algorithm):
  """timeline.ClockSpec(detect=d), the runtime's heartbeat timeout: worker 5 dies at 0.1 s and is removed
  at 0.1 + d. In between it takes no step and no average holds it, while the generators still draw
  it; its groups fail for the live members; the membership says when it was removed; and the rejoin
  (of worker 2, dying at 0.05, planned at 0.07) waits for the removal."""
  d, config = 0.1, config_of(algorithm, leave=((2, 0.05, 0.07), (5, 0.1, -1)))
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=0.01)
  make_gg = lambda: algorithms.make_group_generator(config, np.random.default_rng([4, config.seed]))  # noqa: E731
  trace = timeline.simulate(
    timeline.ClockSpec(algorithm, speed, net, 40 * 8, gg=make_gg(), leave=sim.leave_plan(config), detect=d)
  )
  assert [(round(t, 6), w, e) for t, w, e in trace.membership if e != "first_group"] == [
    (round(0.05 + d, 6), 2, "leave"),
    (round(0.05 + d, 6), 2, "rejoin"),  # planned at 0.07: a worker is taken back once removed
    (round(0.1 + d, 6), 5, "leave"),
  ]
  made = [(g.created, g.members) for g in trace.buffer.groups]  # the simulator keeps every group
  for w, t_death, t_back in ((2, 0.05, 0.05 + d), (5, 0.1, np.inf)):
    applies = [
      t for t, kind, a, b in trace.events if kind == timeline.APPLY and a == w and t_death < t < t_back
    ]
    averages = [
      t for t, kind, a, b in trace.events if kind == timeline.AVG and w in a and t_death < t < t_back
    ]
    assert applies == [] and averages == [], (w, applies, averages)
  # A group's `created` is when its requester expects to be ready (a request sent ahead: up to a step
  # after it was made). Random GG and Group Division still drew worker 5 while its death was unnoticed
  # (Smart GG waits for its report, which never comes); no generator did after its removal.
  step = 0.02
  assert any(0.1 < t < 0.1 + d + step and 5 in m for t, m in made) or algorithm == "ripples_smart"
  assert not any(t > 0.1 + d + step and 5 in m for t, m in made)
  # detect=0 is the earlier clock, event for event.
  same = clock(config_of(algorithm, leave=((2, 0.05, 0.07), (5, 0.1, -1))))
  again = timeline.simulate(
    timeline.ClockSpec(
      algorithm,
      speed,
      net,
      40 * 8,
      gg=algorithms.make_group_generator(config, np.random.default_rng([4, config.seed])),
      leave=sim.leave_plan(config),
      detect=0.0,
    )
  )
  assert again.events == same.events

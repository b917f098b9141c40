"""The event-driven simulator: clock, Group Generators, baselines, packing, determinism."""

import json

import jax
import numpy as np
import optax
import pytest

from configs import default as default_config
from ripples_jax import algorithms, engine, sim, timeline
from ripples_jax import collectives as C
from ripples_jax.data import batch_indices, load_dataset, shard_indices
from ripples_jax.models import build_model
from ripples_jax.schedule.static import static_gg_layouts

GGS = ("ripples_static", "ripples_random", "ripples_division", "ripples_smart")


def clock(algorithm, n=16, steps=40, slow=(3,), s=4.0, jitter=0.05, group_size=3, seed=0):
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.schedule.group_size = group_size
  config.hetero.slow_workers, config.hetero.slowdown, config.hetero.jitter = slow, s, jitter
  config.seed = seed
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=0.01)
  gg = algorithms.make_group_generator(config, np.random.default_rng(seed))
  return timeline.simulate(timeline.ClockSpec(algorithm, speed, net, steps * n, gg=gg, seed=seed)), speed, net


@pytest.mark.parametrize("algorithm", GGS + ("adpsgd", "dpsgd", "allreduce", "moshpit"))
def test_every_emitted_mixing_matrix_is_doubly_stochastic_and_keeps_the_mean(algorithm):
  trace, _, _ = clock(algorithm)
  n = 16
  x = np.random.default_rng(0).normal(size=(n, 5))
  rounds = list(timeline.pack_rounds(trace.events, n, n))
  assert sum(len(r["applied"]) for r in rounds) == trace.worker_steps.sum() == 40 * n
  for r in rounds:
    w = C.mixing_matrix([np.flatnonzero(r["gid"] == g) for g in np.unique(r["gid"])], n)
    if r["ring"]:
      w = (np.eye(n) + np.roll(np.eye(n), 1, 0) + np.roll(np.eye(n), -1, 0)) / 3 @ w
    np.testing.assert_allclose(w.sum(0), 1)
    np.testing.assert_allclose(w.sum(1), 1)
    np.testing.assert_allclose((w @ x).mean(0), x.mean(0))


def test_group_division_and_smart_never_conflict():
  trace, _, _ = clock("ripples_division", group_size=3)
  divisions = {}
  for g in trace.buffer.groups:
    divisions.setdefault(g.request, []).extend(g.members)
  for members in divisions.values():  # 16 in threes: sizes 3,3,3,3,2,2, every worker, none alone
    assert sorted(members) == list(range(16))  # disjoint: no conflict inside a division
  assert sorted({len(g.members) for g in trace.buffer.groups}) == [2, 3]
  smart, _, _ = clock("ripples_smart")
  assert smart.conflicts.sum() == 0
  random, _, _ = clock("ripples_random")
  assert random.conflicts.sum() > 0  # the counter does count


@pytest.mark.parametrize("s", [2.0, 5.0])
def test_allreduce_time_with_one_slow_worker_is_exact(s):
  trace, speed, net = clock("allreduce", steps=25, s=s, jitter=0.0)
  # 25 slow steps and 24 all-reduces: the run ends when the last gradient lands
  assert trace.end_time == pytest.approx(25 * s * 0.01 + 24 * net.allreduce(16), rel=1e-12)
  wait = trace.time_split()["wait"]
  assert wait[3] == 0 and wait[0] == pytest.approx(25 * (s - 1) * 0.01)


def test_ps_sync_pays_the_server_link():
  trace, _, net = clock("ps_sync", steps=10, slow=(), jitter=0.0)
  assert trace.end_time == pytest.approx(10 * 0.01 + 9 * (2 * net.alpha + 2 * 16 * 4e5 / net.ps_bandwidth))


def test_adpsgd_finishes_and_its_pairs_are_bipartite():
  trace, _, _ = clock("adpsgd", n=16, steps=300, s=5.0, jitter=0.3, seed=7)
  assert trace.worker_steps.sum() == 300 * 16  # a long randomized run finishes: no deadlock
  assert trace.pairs and all(a % 2 == 1 and p % 2 == 0 for a, p in trace.pairs)
  split = trace.time_split()
  assert split["wait"][::2].sum() == 0  # the passive side never waits


def test_adpsgd_averages_inside_the_active_step_in_lians_order():
  """Lian et al.'s order: an active worker's one average of each step lands between that step's
  START (the gradient's parameters are read) and its APPLY (the gradient goes to the averaged model),
  and overlaps the compute: with an exchange far shorter than a step, an active step is no longer
  than a passive one."""
  trace, _, _ = clock("adpsgd", n=8, steps=50, slow=(), jitter=0.0)
  inside = {w: [] for w in range(1, 8, 2)}  # per active worker: averages between each START and APPLY
  open_step = {}
  for _, kind, a, _ in trace.events:
    if kind == timeline.START and a % 2 == 1:
      open_step[a] = 0
    elif kind == timeline.AVG:
      active = [w for w in a if w % 2 == 1]
      assert len(active) == 1 and active[0] in open_step, (a, open_step)  # never between two steps
      open_step[active[0]] += 1
    elif kind == timeline.APPLY and a % 2 == 1:
      inside[a].append(open_step.pop(a))
  assert all(counts == [1] * len(counts) and counts for counts in inside.values()), inside
  steps = trace.worker_steps
  assert abs(steps[1::2].sum() - steps[::2].sum()) <= 4  # the average costs the active side nothing here


def test_smart_gg_approaches_the_throughput_limit():
  ar, _, _ = clock("allreduce", steps=60, s=5.0, jitter=0.0)
  smart, _, _ = clock("ripples_smart", steps=60, s=5.0, jitter=0.0)
  ratio = (smart.worker_steps.sum() / smart.end_time) / (ar.worker_steps.sum() / ar.end_time)
  assert ratio >= 0.9 * (5 * 15 + 1) / 16


@pytest.mark.parametrize("algorithm", ["ripples_random", "ripples_division", "ripples_smart"])
def test_each_worker_executes_a_prefix_of_its_global_order(algorithm):
  trace, _, _ = clock(algorithm, jitter=0.3)
  # Which group each AVG event is: the buffer's groups by member set, consumed in buffer order.
  pending = {}
  for g in trace.buffer.groups:
    pending.setdefault(g.members, []).append(g.gid)
  executed = {w: [] for w in range(16)}
  for e in trace.events:
    if e[1] == timeline.AVG:
      gid = pending[tuple(e[2])].pop(0)
      for m in e[2]:
        executed[m].append(gid)
  for w in range(16):
    mine = [g.gid for g in trace.buffer.groups if w in g.members]
    assert executed[w] == mine[: len(executed[w])]  # in global order, none skipped
    assert len(executed[w]) <= trace.worker_steps[w]  # one group per local step, at most


def _small_config(algorithm, **kw):
  config = default_config.get_config(
    f"algorithm={algorithm},executor=sim,num_workers=8,dataset=synthetic,model=mlp,steps=6"
  )
  config.log_every = config.eval_every = 2
  config.optimizer.warmup_steps = 0
  config.update_from_flattened_dict(kw)
  return config


@pytest.mark.parametrize("algorithm", [GGS[0]] + [pytest.param(a, marks=pytest.mark.slow) for a in GGS[1:]])
def test_ripples_with_one_group_of_all_equals_allreduce(tmp_path, algorithm):
  kw = {"schedule.group_size": 8, "schedule.workers_per_node": 8}
  ref, _ = sim.simulate_and_train(_small_config("allreduce", **kw), str(tmp_path / "ar"))
  got, _ = sim.simulate_and_train(_small_config(algorithm, **kw), str(tmp_path / algorithm))
  # Every number equal but the deployable model's time: All-Reduce's workers hold it, a Group
  # Generator's are charged the All-Reduce that builds it (even when its one group is all of them).
  strip = lambda d: [{k: v for k, v in json.loads(l).items() if k != "consensus_time"} for l in open(d)]  # noqa: E731
  assert strip(tmp_path / "ar" / "metrics.jsonl") == strip(tmp_path / algorithm / "metrics.jsonl")
  assert got["time"] == ref["time"] and got["worker_steps"] == ref["worker_steps"]


@pytest.mark.slow  # in process, too long for the fast tier
def test_same_seed_gives_byte_identical_metrics(tmp_path):
  kw = {"hetero.slow_workers": (1,), "hetero.slowdown": 3.0, "hetero.jitter": 0.2}
  for d in ("a", "b"):
    sim.simulate_and_train(_small_config("ripples_random", **kw), str(tmp_path / d))
  a = (tmp_path / "a" / "metrics.jsonl").read_text()
  assert a == (tmp_path / "b" / "metrics.jsonl").read_text() and len(a.splitlines()) >= 3
  sim.simulate_and_train(_small_config("ripples_random", seed=1, **kw), str(tmp_path / "c"))
  assert a != (tmp_path / "c" / "metrics.jsonl").read_text()


def _round_setup(algorithm, n):
  """A clock trace of n heterogeneous workers and what the engine's rounds need to replay it."""
  trace, _, _ = clock(algorithm, n=n, steps=4, slow=(1,), s=3.0, jitter=0.3)
  data = load_dataset("synthetic", seed=0)
  shards = shard_indices(data["y_train"], n, "iid", seed=0)
  model = build_model("mlp", data["num_classes"], hidden=(8,))
  slots = n + (algorithm == "ps_async")
  mesh = C.make_worker_mesh(slots, jax.devices()[:1])
  return trace, data, shards, model, optax.sgd(0.05, momentum=0.9), slots, mesh


@pytest.mark.parametrize(
  "algorithm",
  ["ripples_random"] + [pytest.param(a, marks=pytest.mark.slow) for a in ("adpsgd", "ps_async", "dpsgd")],
)
def test_packed_rounds_equal_one_event_at_a_time(algorithm):
  """Packing many events into one round must compute exactly what executing them in order does."""
  n = 8
  trace, data, shards, model, opt, slots, mesh = _round_setup(algorithm, n)
  fn = engine.make_sim_round_fn(
    model,
    opt,
    mesh,
    n,
    slots,
    cross_apply=algorithm == "ps_async",
    ring=algorithm == "dpsgd",
    pull=algorithm == "ps_async",
  )

  def execute(rounds):
    state = engine.init_sim_state(model, opt, jax.random.key(0), data["x_train"][:1], slots, mesh)
    starts = np.zeros(n, np.int64)
    for r in rounds:
      idx = batch_indices(shards, 4, 0, starts)
      x = np.zeros((slots, 4) + data["x_train"].shape[1:], np.float32)
      y = np.zeros((slots, 4), np.int32)
      x[:n], y[:n] = data["x_train"][idx], data["y_train"][idx]
      state, _ = fn(state, x, y, r["apply_src"], r["gid"], r["ring"], r["pull_src"], r["start"])
      starts += r["start"][:n]
    return jax.tree.map(np.asarray, state["params"])

  packed = list(timeline.pack_rounds(trace.events, n, slots))
  single = [r for e in trace.events for r in timeline.pack_rounds([e], n, slots)]
  assert len(packed) < len(single)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), execute(packed), execute(single)
  )


@pytest.mark.parametrize(
  "algorithm",
  ["adpsgd"]
  + [
    pytest.param(a, marks=pytest.mark.slow)
    for a in ("ripples_random", "ripples_smart", "ps_async", "allreduce")
  ],
)
def test_compact_rounds_equal_full_rounds_bit_for_bit(algorithm):
  """The executor's compact rounds (only the slots a round touches, gathered and scattered back)
  compute exactly the full round's values, to the last bit, for every slot: they run the same per-slot
  programs, and a group's sum adds its members in the same order."""
  n = 16
  trace, data, shards, model, opt, slots, mesh = _round_setup(algorithm, n)
  ps = algorithm == "ps_async"
  full = engine.make_sim_round_fn(model, opt, mesh, n, slots, cross_apply=ps, pull=ps)
  compact = engine.make_compact_round_fn(model, opt, mesh, slots)
  init = lambda: engine.init_sim_state(model, opt, jax.random.key(0), data["x_train"][:1], slots, mesh)
  a, b = init(), init()
  starts = np.zeros(n, np.int64)
  sizes = set()
  for r in timeline.pack_rounds(trace.events, n, slots):
    idx = batch_indices(shards, 4, 0, starts)
    x = np.zeros((slots, 4) + data["x_train"].shape[1:], np.float32)
    y = np.zeros((slots, 4), np.int32)
    x[:n], y[:n] = data["x_train"][idx], data["y_train"][idx]
    a, loss_a = full(a, x, y, r["apply_src"], r["gid"], r["ring"], r["pull_src"], r["start"])
    c = sim.compact_round(r, slots)
    sizes.add(len(c["idx"]))
    rows = np.minimum(c["idx"], slots - 1)
    b, loss_b = compact(b, c["idx"], x[rows], y[rows], c["apply_src"], c["gid"], c["pull_src"], c["start"])
    np.testing.assert_array_equal(np.asarray(loss_a), np.asarray(loss_b))
    starts += r["start"][:n]
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))
  assert all(c & (c - 1) == 0 or c == slots for c in sizes)  # powers of two: few programs
  if algorithm != "allreduce":
    assert min(sizes) < slots  # some rounds touched fewer than all slots


def test_compact_round_positions():
  S = 6
  r = {
    "apply_src": np.array([-1, 1, -1, -1, -1, -1]),
    "gid": np.array([0, 1, 2, 2, 4, 2]),  # slots 2, 3, 5 average
    "pull_src": np.arange(S),
    "start": np.array([False, False, False, False, True, False]),
  }
  c = sim.compact_round(r, S)
  np.testing.assert_array_equal(c["idx"], [1, 2, 3, 4, 5, 6, 6, 6][: len(c["idx"])])
  assert len(c["idx"]) == 6  # five touched slots, a power of two would be 8 > S: capped at S
  np.testing.assert_array_equal(c["gid"], [0, 1, 1, 3, 1, 5])
  np.testing.assert_array_equal(c["apply_src"], [1, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(c["start"], [False, False, False, True, False, False])


@pytest.mark.slow  # in process, too long for the fast tier
def test_stop_at_target_ends_at_the_first_evaluation_that_reaches_it(tmp_path):
  full, _ = sim.simulate_and_train(_small_config("ripples_random", steps=40), str(tmp_path / "full"))
  records = [json.loads(l) for l in open(tmp_path / "full" / "metrics.jsonl")]
  accs = [r["test_accuracy"] for r in records if "test_accuracy" in r]
  target = sorted(accs)[len(accs) // 2]  # reached at some evaluation before the end
  first = next(r for r in records if r.get("test_accuracy", -1) >= target)
  got, _ = sim.simulate_and_train(
    _small_config("ripples_random", steps=40, target_accuracy=target, stop_at_target=True),
    str(tmp_path / "stop"),
  )
  stopped = [json.loads(l) for l in open(tmp_path / "stop" / "metrics.jsonl")]
  assert stopped[-1]["step"] == first["step"] < records[-1]["step"]
  assert stopped == records[: len(stopped)]  # the same run, cut at the target
  assert got["time_to_target"] == first["time"]


@pytest.mark.slow  # 4-7 s: the fast tier's 2 minutes (WORKSPACE.md section 41)
def test_eval_workers_off_drops_only_the_workers_own_accuracy(tmp_path):
  """The ledger's tuning runs skip the workers' own evaluation (its cost): every other field of every
  record is the same, and validation accuracy is the averaged model's in both."""
  kw = {"validation_examples": 50}
  sim.simulate_and_train(_small_config("ripples_random", **kw), str(tmp_path / "on"))
  sim.simulate_and_train(_small_config("ripples_random", eval_workers=False, **kw), str(tmp_path / "off"))
  on = [json.loads(l) for l in open(tmp_path / "on" / "metrics.jsonl")]
  off = [json.loads(l) for l in open(tmp_path / "off" / "metrics.jsonl")]
  assert sum("worker_test_accuracy" in r for r in on) > 1 and not any(
    "worker_test_accuracy" in r for r in off
  )
  assert all("val_accuracy" in r for r in off if "test_accuracy" in r)
  assert [{k: v for k, v in r.items() if not k.startswith("worker_")} for r in on] == off


@pytest.mark.slow  # 4-7 s: the fast tier's 2 minutes (WORKSPACE.md section 41)
def test_schedule_steps_makes_a_short_run_the_start_of_a_longer_ones_schedule(tmp_path):
  """optimizer.schedule_steps: a 4-step run on an 8-step schedule is the 8-step run's first 4 steps,
  record for record (the ledger's runtime rows are the start of its simulated runs); on its own
  4-step schedule it is not (the cosine decays sooner)."""
  kw = {"optimizer.warmup_steps": 2, "log_every": 2, "eval_every": 2}
  sim.simulate_and_train(_small_config("allreduce", num_steps=8, **kw), str(tmp_path / "long"))
  sim.simulate_and_train(
    _small_config("allreduce", num_steps=4, **{"optimizer.schedule_steps": 8}, **kw), str(tmp_path / "start")
  )
  sim.simulate_and_train(_small_config("allreduce", num_steps=4, **kw), str(tmp_path / "own"))
  read = lambda d: [json.loads(l) for l in open(tmp_path / d / "metrics.jsonl")]  # noqa: E731
  long, start, own = read("long"), read("start"), read("own")
  assert [r for r in long if r["step"] < 4] == start[:-1]
  # Step 4 ends the short runs before its average (the run ends at its last gradient): the averaged
  # model is the same, so its test loss is, to float order; on its own schedule it is another model.
  at4 = lambda rs: next(r["test_loss"] for r in rs if r["step"] == 4)  # noqa: E731
  assert at4(start) == pytest.approx(at4(long), rel=1e-5) and at4(own) != pytest.approx(at4(long), rel=1e-3)


def test_static_gg_in_the_clock_follows_the_layouts():
  trace, _, _ = clock("ripples_static", slow=(), jitter=0.0, steps=8)
  layouts = static_gg_layouts(16, 4)
  runs = [e[2] for e in trace.events if e[1] == timeline.AVG]
  # the run ends at the 8th step's last gradient, before that step's sync
  expect = [g for k in range(7) for g in layouts[k % 4] if len(g) > 1]
  assert sorted(runs) == sorted(expect)


@pytest.mark.parametrize("algorithm", ["allreduce", "ripples_smart", "adpsgd"])
def test_time_budget_ends_the_run(algorithm):
  full, speed, net = clock(algorithm, steps=40)
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers=16")
  gg = algorithms.make_group_generator(config, np.random.default_rng(0))
  budget = full.end_time / 2
  cut = timeline.simulate(timeline.ClockSpec(algorithm, speed, net, 40 * 16, time_budget=budget, gg=gg))
  assert cut.end_time <= budget
  assert 0 < cut.worker_steps.sum() < full.worker_steps.sum()
  assert max(e[0] for e in cut.events) <= budget


@pytest.mark.slow  # in process, too long for the fast tier
def test_a_time_budget_run_ends_with_an_evaluation(tmp_path):
  config = _small_config("ripples_smart", time_budget=0.035)
  summary, trace = sim.simulate_and_train(config, str(tmp_path))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert trace.end_time <= 0.035 and sum(summary["worker_steps"]) < 6 * 8
  assert "test_accuracy" in records[-1] and records[-1]["time"] == trace.end_time
  assert summary["final_test_accuracy"] == records[-1]["test_accuracy"]


def test_adpsgd_cost_parts_each_slow_it_down_and_pause_the_passive_side():
  from experiments import ledger_throughput

  base, tr = ledger_throughput.throughput("adpsgd", "heavy", steps=40)
  assert tr.time_split()["comm"][::2].sum() == 0  # as published: the passive side never pauses
  blocks, tb = ledger_throughput.throughput(
    "adpsgd", "heavy", steps=40, cost=timeline.AdpsgdCost(passive_blocks=True)
  )
  assert tb.time_split()["comm"][::2].sum() > 0 and blocks < base
  fixed, tf = ledger_throughput.throughput("adpsgd", "heavy", steps=40, cost=timeline.AdpsgdCost(fixed=0.3))
  assert fixed < base
  # Averages that outlast the compute queue at a passive worker only when serialised: switched off,
  # nobody waits for one (what shows is the exchange itself).
  _, free = ledger_throughput.throughput(
    "adpsgd", "heavy", steps=40, cost=timeline.AdpsgdCost(fixed=0.3, serial=False)
  )
  assert free.time_split()["wait"].sum() == 0 < tf.time_split()["wait"].sum()
  assert free.time_split()["comm"][1::2].sum() > 0


def test_adpsgd_unhidden_share_runs_before_the_compute():
  """AdpsgdCost.hidden: 1 is Lian et al.'s order (the published clock, event for event); 0 puts each
  active worker's whole average before its compute, so its communication is every average's length
  exactly (not serialised: no queue) and nothing outlasts the compute; a share between costs between."""
  from experiments import ledger_claims, ledger_throughput

  def run(**kw):
    cost = timeline.AdpsgdCost(serial=False, **kw)
    return ledger_throughput.throughput("adpsgd", "heavy", steps=20, cost=cost)

  base, tb = run()
  same, ts = run(hidden=1.0)
  assert ts.events == tb.events and same == base
  none, t0 = run(hidden=0.0, fixed=0.2)
  half, th = run(hidden=0.5, fixed=0.2)
  full, tf = run(fixed=0.2)
  config = default_config.get_config("algorithm=adpsgd,executor=sim,num_workers=16")
  nbytes, step = ledger_claims.set_clock(config, ledger_claims.SETTINGS["heavy"])
  d = 0.2 + sim.build_clock(config, model_bytes=nbytes, base_time=step)[1].allreduce(2, hide=False)
  active = np.arange(1, 16, 2)
  averages = np.array([sum(a == w for a, _ in t0.pairs) for w in active])
  np.testing.assert_allclose(t0.time_split()["comm"][active], averages * d, rtol=1e-9)
  assert t0.time_split()["wait"][active].sum() == 0
  assert none < half < full


@pytest.mark.parametrize("setting", ["light", "heavy"])
def test_ledger_outcomes_who_is_faster(setting):
  """The ledger's qualitative outcomes, small and deterministic (no timing: virtual time)."""
  from experiments import ledger_throughput

  t = {
    a: ledger_throughput.throughput(a, setting, 5.0, steps=60)[0]
    for a in ("allreduce", "ripples_smart", "adpsgd")
  }
  assert t["ripples_smart"] > 3 * t["allreduce"]  # a 5x straggler: Smart GG far ahead of All-Reduce
  assert t["adpsgd"] > t["ripples_smart"]  # and AD-PSGD as published ahead of Smart GG, unlike the paper
  h = {
    a: ledger_throughput.throughput(a, setting, 1.0, steps=60)[0]
    for a in ("allreduce", "ripples_smart", "ps_sync")
  }
  assert h["ripples_smart"] > h["allreduce"] and h["ripples_smart"] > h["ps_sync"]
  # One worker 2x slower: Smart GG ahead of All-Reduce and of the synchronous PS.
  two = {
    a: ledger_throughput.throughput(a, setting, 2.0, steps=60)[0]
    for a in ("allreduce", "ripples_smart", "ps_sync")
  }
  assert two["ripples_smart"] > 1.3 * two["allreduce"] and two["ripples_smart"] > two["ps_sync"]


def test_ledger_verdict_rule():
  from experiments import ledger_claims, ledger_tta, ledger_verdicts

  # den's time over num's, over the seeds where both reached the target
  tta = {
    "scenarios": {"s": {"allreduce": {"time": [4.0, 6.0, None]}, "ripples_smart": {"time": [1.0, 2.0, 1.0]}}}
  }
  assert ledger_tta.tta_ratio(tta, "s", "ripples_smart", "allreduce") == pytest.approx(3.5)
  # A claim's estimate: paired by seed, a miss censored at its own run's end, every figure judged.
  scen = "5x straggler, VGG-16 clock"
  times = {"allreduce": [10.0, 10.0, 12.0, None, 10.0], "ripples_smart": [2.0, 2.0, 2.5, 2.0, 2.0]}
  ends = {"allreduce": [20.0] * 5, "ripples_smart": [5.0] * 5}
  got = {"scenarios": {scen: {a: {"time": times[a], "end": ends[a]} for a in times}}}
  e = ledger_verdicts.claim_estimate(got, "one worker 5x slower vs All-Reduce")
  assert e.mean == pytest.approx(np.exp(np.mean(np.log([5.0, 5.0, 4.8, 10.0, 5.0]))))
  assert (e.seeds, e.baseline_reached, e.censored) == (5, 4, 1)
  led = {
    "claims": [{"throughput_heavy": [1.0, 0.0], "throughput_light": [1.0, 0.0]} for _ in ledger_claims.CLAIMS]
  }
  rows = {r[0]: r for r in ledger_verdicts.verdict_table(led, got, 0.55).rows}
  row = rows["one worker 5x slower vs All-Reduce"]
  assert row[1:4] == ["-", "-", "5.01x"] and row[4] == str(e)
  assert row[7] == ledger_verdicts.verdict.judge(e, 5.01) and row[5] == row[6] == "-"
  assert rows["homogeneous vs AD-PSGD"][5] == "not judged: no time-to-accuracy runs"


def test_ledger_tta_table_pairs_seeds_and_censors_misses():
  from experiments import ledger_tta, ledger_verdicts

  rec = lambda time, end: {
    "time": time,
    "steps": [5 if t else None for t in time],
    "end": end,
    "final": [0.6, 0.62, 0.64],
    "throughput": [1.0, 1.0, 1.0],
  }
  scen = {
    "s": {"allreduce": rec([4.0, 6.0, None], [9.0] * 3), "ripples_smart": rec([1.0, 2.0, 1.0], [3.0] * 3)}
  }
  rows = {r[1]: r for r in ledger_tta.tta_table(scen, 0.55).rows}
  e = ledger_verdicts.verdict.paired([1.0, 2.0, 1.0], [4.0, 6.0, None], ([3.0] * 3, [9.0] * 3))
  assert rows["ripples_smart"][5] == str(e) and "baseline reached 2/3" in str(e)
  assert e.mean == pytest.approx((4.0 * 3.0 * 9.0) ** (1 / 3))  # seed 2: All-Reduce censored at 9
  assert rows["allreduce"][2] == "2/3" and rows["allreduce"][7] == "62.0 ± 2.0"  # sample std
  del scen["s"]["allreduce"]["end"]  # a first-edition record: the seeds both reached, unpaired
  assert ledger_tta.tta_table(scen, 0.55).rows[1][5] == "3.50x ± 0.50 (no ends recorded)"


def test_ledger_judges_the_ps_and_2x_claims_on_time_to_accuracy():
  """Every claim the training runs can compare is judged on them: its scenario runs its algorithms, the
  scenario's slow worker exists, and the verdict table takes the time-to-accuracy ratio, not throughput."""
  from experiments import ledger_claims, ledger_tables, ledger_tta, ledger_verdicts

  for claim, (scenario, pair) in ledger_verdicts.TTA_OF_CLAIM.items():
    assert set(pair) <= set(ledger_tta.TTA_ALGORITHMS_OF.get(scenario, ledger_tta.TTA_ALGORITHMS)), claim
  for claim in (
    "homogeneous vs Parameter Server (sync)",
    "homogeneous vs Parameter Server (async)",
    "one worker 2x slower vs All-Reduce",
    "one worker 2x slower vs Parameter Server",
  ):
    assert ledger_verdicts.TTA_OF_CLAIM[claim][0].endswith("VGG-16 clock"), claim
  for name, (_, ov) in ledger_tta.TTA_SCENARIOS.items():
    assert all(0 <= w < ledger_tta.scenario_workers(name) for w in ov.get("hetero.slow_workers", ())), name
  assert ledger_tta.scenario_workers("5x straggler, 256 workers") == 256
  # A fake run of every scenario: algorithm a reaches the target at time t[a] in both seeds.
  t = {
    "allreduce": 10.0,
    "ripples_smart": 2.0,
    "ripples_division": 5.0,
    "adpsgd": 4.0,
    "ps_sync": 12.0,
    "ps_async": 16.0,
  }
  scen = {
    name: {a: {"time": [t[a]] * 2} for a in ledger_tta.TTA_ALGORITHMS_OF.get(name, ledger_tta.TTA_ALGORITHMS)}
    for name in ledger_tta.TTA_SCENARIOS
  }
  zero = [1.0, 0.0]
  led = {
    "claims": [{"throughput_heavy": zero, "throughput_light": zero} for _ in ledger_claims.CLAIMS],
    "scale": [{"n": n, "smart_vs_allreduce": zero, "limit": 5.0} for n in (16, 64, 256)],
  }
  rows = {r[0]: r for r in ledger_verdicts.verdict_table(led, {"scenarios": scen}, 0.55).rows}
  assert rows["homogeneous vs Parameter Server (sync)"][4] == "6.00x [6.00, 6.00]"
  assert rows["homogeneous vs Parameter Server (async)"][4] == "8.00x [8.00, 8.00]"
  assert rows["one worker 2x slower vs All-Reduce"][4] == "5.00x [5.00, 5.00]"
  assert rows["one worker 2x slower vs Parameter Server"][4] == "6.00x [6.00, 6.00]"
  verdicts = [v for r in rows.values() for v in r[5:] if v != "-"]  # "-": no figure from that source
  assert len(verdicts) == 16 and set(verdicts) == {"too few seeds (2 < 5)"}  # two seeds judge nothing
  assert [r[2] for r in ledger_tables.scale_table(led, {"scenarios": scen}, 0.55).rows] == [
    "5.00x ± 0.00 (2 seeds)"
  ] * 3
  # An algorithm a scenario has not run yet: no ratio, so the claim falls back to throughput.
  scen["5x straggler, 256 workers"]["ripples_smart"]["time"] = [None, None]
  assert (
    ledger_tables.scale_table(led, {"scenarios": scen}, 0.55).rows[-1][2]
    == "not reached: Smart GG 0/2, All-Reduce 2/2"
  )
  del scen["2x straggler, VGG-16 clock"]["ps_sync"]
  assert (
    ledger_tta.tta_ratio({"scenarios": scen}, "2x straggler, VGG-16 clock", "ripples_smart", "ps_sync")
    is None
  )


@pytest.mark.slow
def test_ledger_tta_merges_into_the_stored_results(tmp_path):
  """Running some scenarios alone keeps what tta.json held for the others and for the algorithms not run."""
  from experiments import ledger_tta

  held = {
    "x": {"allreduce": {"time": [1.0], "steps": [1], "final": [0.5], "throughput": [1.0]}},
    "homogeneous": {"adpsgd": {"time": [1.0], "steps": [1], "final": [0.5], "throughput": [1.0]}},
  }
  (tmp_path / "tta.json").write_text(json.dumps({"target": 0.0, "scenarios": held}))
  got = ledger_tta.tta(
    str(tmp_path),
    seeds=1,
    steps=2,
    target=0.0,
    scenarios=("homogeneous",),
    algorithms=("allreduce",),
    merge=True,
    grid=(0.1,),  # one step size: the merge is what is tested, not the tuning
  )
  stored = json.loads((tmp_path / "tta.json").read_text())["scenarios"]
  assert stored == got and stored["x"] == held["x"]
  assert list(stored["homogeneous"]) == ["allreduce", "adpsgd"]  # the table's order, the baseline first
  assert stored["homogeneous"]["adpsgd"] == held["homogeneous"]["adpsgd"]
  assert stored["homogeneous"]["allreduce"]["steps"] == [1]
  curves = json.loads((tmp_path / "tta_curves.json").read_text())
  assert list(curves) == ["homogeneous"] and len(curves["homogeneous"]["allreduce"]) == 2
  assert "| x | allreduce | 1/1 |" in (tmp_path / "tta.md").read_text()
  with pytest.raises(ValueError, match="merge refused"):  # another target: not mixed in
    ledger_tta.tta(
      str(tmp_path), seeds=1, steps=2, target=0.5, scenarios=("homogeneous",), algorithms=(), merge=True
    )


def test_evaluations_come_at_eval_every_whatever_log_every(tmp_path):
  """eval_every=2 with log_every=4: an evaluation at every second step, not only at log records."""
  config = _small_config("allreduce", log_every=4, eval_every=2, num_steps=8)
  sim.simulate_and_train(config, str(tmp_path))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if "test_accuracy" in r] == [2, 4, 6, 8]
  assert all("train_loss" in r for r in records)


def test_overlap_hides_at_most_its_share_of_a_step_from_every_algorithm():
  """timeline.overlap: each step's transfers less at most overlap x compute_time, for every cost the
  clock charges, never below zero; in lockstep All-Reduce without jitter the run's end is exact: S
  compute + (S - 1) charged collectives. Asynchronous PS's push starts up to `hidden` early on the
  server's link but books it for its whole length (below)."""
  net = timeline.Network(1e8, 0.0, 1e9, 1e9, hidden=0.05)
  plain = timeline.Network(1e8, 0.0, 1e9, 1e9)
  assert net.allreduce(4) == pytest.approx(plain.allreduce(4) - 0.05)
  assert net.ps_sync_step(4) == pytest.approx(plain.ps_sync_step(4) - 0.05)
  assert net.ps_transfer() == plain.ps_transfer()  # the link's time; the push starts early instead
  assert net.allreduce(2, hide=False) == plain.allreduce(2)  # AD-PSGD's average already beside compute
  assert net.ring_gossip() == pytest.approx(plain.ring_gossip() - 0.05)
  assert timeline.Network(1e6, 0.0, 1e9, 1e9, hidden=1.0).allreduce(16) == 0.0
  for f in (0.0, 0.5, 1.0):
    config = default_config.get_config("algorithm=allreduce,executor=sim,num_workers=8")
    config.timeline.overlap = f
    speed, net = sim.build_clock(config, model_bytes=1e8, base_time=0.1)
    trace = timeline.simulate(timeline.ClockSpec("allreduce", speed, net, 10 * 8))
    comm = max(0.0, C.ring_allreduce_time(8, 1e8, config.timeline.alpha, config.timeline.bandwidth) - f * 0.1)
    assert trace.end_time == pytest.approx(10 * 0.1 + 9 * comm)


@pytest.mark.slow  # in process, too long for the fast tier
def test_validation_examples_are_held_out_of_every_shard_and_scored(tmp_path):
  """validation_examples moves a fixed set of training examples out of the workers' shards; every
  evaluation record scores the averaged model on them (val_accuracy) beside the test set."""
  from ripples_jax import workload

  config = default_config.get_config("algorithm=ripples_smart,executor=sim,num_workers=4,model=mlp,steps=3")
  full = workload.build(config)
  config.validation_examples = 200
  s = workload.build(config)
  assert len(s.data["y_val"]) == 200 and len(s.data["y_train"]) == len(full.data["y_train"]) - 200
  assert sum(len(sh) for sh in s.shards) == len(s.data["y_train"])
  held = {x.tobytes() for x in s.data["x_val"]}
  assert not held & {x.tobytes() for x in s.data["x_train"]}
  # The evaluation scores the held-out examples, not the test set: against the averaged model by hand.
  state = engine.init_sim_state(
    s.model,
    s.optimizer,
    jax.random.key(0),
    s.data["x_train"][:1],
    4,
    C.make_worker_mesh(4, jax.devices()[:1]),
  )
  got = sim.make_evaluate(s, slice(0, 4))(state, 0.0)
  mean = jax.tree.map(lambda a: a.mean(0), state["params"])
  ms = jax.tree.map(lambda a: a[0], state["model_state"])
  logits, _ = engine.apply_model(s.model, mean, ms, s.data["x_val"], train=False)
  assert got["val_accuracy"] == pytest.approx(
    float(np.mean(np.argmax(logits, -1) == s.data["y_val"])), abs=1e-6
  )
  config.eval_every = config.log_every = 1
  config.checkpoint_every = 0
  sim.simulate_and_train(config, str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  evals = [r for r in records if "test_accuracy" in r]
  assert len(evals) == 3 and all(0 <= r["val_accuracy"] <= 1 for r in evals)


def test_async_ps_pushes_start_early_but_hold_the_shared_link_for_their_whole_length():
  """Two workers, 1 s steps, 0.1 s transfers, 0.05 s hidden. Pulls: w0 [0, 0.1], w1 [0.1, 0.2]. w0's
  compute ends at 1.1, its push starts 0.05 early: [1.05, 1.15]; its next pull [1.15, 1.25]. w1's
  compute ends at 1.2, but the link is booked until 1.25: its push [1.25, 1.35]. Without hiding: w0
  pushes [1.1, 1.2], w1 [1.2, 1.3]."""
  speed = timeline.SpeedModel(1.0, 2)
  for hidden, applied in ((0.05, [1.15, 1.35]), (0.0, [1.2, 1.3])):
    net = timeline.Network(1e8, 0.0, 1e9, 1e9, hidden=hidden)
    trace = timeline.simulate(timeline.ClockSpec("ps_async", speed, net, 2))
    got = [t for t, kind, target, _ in trace.events if kind == timeline.APPLY and target == 2]
    assert got == pytest.approx(applied)


def test_async_ps_request_latency_delays_the_push_without_holding_the_link():
  """ps_latency 0.3 s (a request's delivery, fed from runtime runs): pulls w0 [0, 0.1], w1 [0.1, 0.2];
  w0's compute ends at 1.1, its request reaches the server at 1.4, push [1.4, 1.5]; w1's at 1.5, push
  [1.5, 1.6]: each push 0.3 s later than without the latency ([1.1, 1.2], [1.2, 1.3])."""
  speed = timeline.SpeedModel(1.0, 2)
  net = timeline.Network(1e8, 0.0, 1e9, 1e9, ps_latency=0.3)
  trace = timeline.simulate(timeline.ClockSpec("ps_async", speed, net, 2))
  got = [t for t, kind, target, _ in trace.events if kind == timeline.APPLY and target == 2]
  assert got == pytest.approx([1.5, 1.6])


@pytest.mark.slow  # 4-5 s in process: the fast tier's 2 minutes
def test_the_deployable_model_is_charged_its_all_reduce(tmp_path):
  """A Group Generator's deployable model is the workers' mean, which one All-Reduce builds: every
  evaluation's consensus_time is its virtual time plus that All-Reduce (the network model's, for the
  run's model bytes), and its time to target is charged the same; All-Reduce's workers hold theirs
  (no charge). The workers' own models: the median worker and the worst, never above the best."""
  got, _ = sim.simulate_and_train(_small_config("ripples_random", target_accuracy=0.3), str(tmp_path / "r"))
  config = _small_config("ripples_random")
  _, net = sim.build_clock(config, got["model_bytes"], got["base_step_time"])
  assert got["consensus_charge"] == net.allreduce(8) > 0
  evals = [json.loads(l) for l in open(tmp_path / "r" / "metrics.jsonl") if "test_accuracy" in l]
  assert len(evals) >= 3
  for r in evals:
    assert r["consensus_time"] == r["time"] + got["consensus_charge"]
    assert r["consensus_accuracy"] == r["test_accuracy"]
    assert r["worker_min_test_accuracy"] <= r["worker_median_test_accuracy"] <= 1.0
    assert r["worker_min_test_accuracy"] <= r["worker_test_accuracy"]
  if got["time_to_target"] is not None:
    assert got["consensus_time_to_target"] == got["time_to_target"] + got["consensus_charge"]
  ar, _ = sim.simulate_and_train(_small_config("allreduce"), str(tmp_path / "ar"))
  assert ar["consensus_charge"] == 0.0
  assert all(
    json.loads(l)["consensus_time"] == json.loads(l)["time"]
    for l in open(tmp_path / "ar" / "metrics.jsonl")
    if "test_accuracy" in l
  )


@pytest.mark.slow  # one short DiLoCo run in process
def test_dilocos_deployable_model_is_its_global_model_between_outer_steps(tmp_path):
  """DiLoCo's consensus model is its global model: right after an outer step every worker holds it
  (the workers' mean's accuracy, on test and validation); mid-round it is the last outer step's model,
  unchanged while the inner models move."""
  config = _small_config(
    "diloco", **{"diloco.inner_steps": 4, "num_steps": 8, "validation_examples": 200, "dataset": "mnist1d"}
  )
  sim.simulate_and_train(config, str(tmp_path))
  ev = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "test_accuracy" in r}
  assert {4, 6, 8} <= set(ev)
  after, mid = ev[4], ev[6]
  assert after["consensus_accuracy"] == after["test_accuracy"]
  assert after["consensus_val_accuracy"] == after["val_accuracy"]
  assert mid["consensus_accuracy"] == after["consensus_accuracy"]
  assert mid["consensus_val_accuracy"] == after["consensus_val_accuracy"]
  # the inner models moved: the workers' mean is not the global model mid-round
  assert mid["val_accuracy"] != after["val_accuracy"] and mid["test_accuracy"] != after["test_accuracy"]

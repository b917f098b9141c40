"""Today's baselines in the simulator (executor=sim): DiLoCo and Moshpit SGD, against references."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default as default_config
from ripples_jax import collectives as C
from ripples_jax import engine, sim, timeline
from ripples_jax import schedule as schedule_lib
from ripples_jax.config import ConfigError, validate_train_config
from ripples_jax.data import batch_indices, load_dataset, shard_indices
from ripples_jax.models import build_model
from ripples_jax.optim import make_optimizer
from ripples_jax.schedule import group_gen
from tests.test_sim import _small_config

BASE = 0.01  # virtual seconds of a base step


def sim_config(algorithm, n=8, slow=(3,), s=3.0, jitter=0.0, **kw):
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.hetero.slow_workers, config.hetero.slowdown, config.hetero.jitter = slow, s, jitter
  config.update_from_flattened_dict(kw)
  return config


def clock(config, steps):
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=BASE)
  gg = sim.make_group_generator(config, np.random.default_rng([4, config.seed]))
  h = config.diloco.inner_steps if config.algorithm == "diloco" else 1
  spec = timeline.ClockSpec(
    config.algorithm,
    speed,
    net,
    steps * config.num_workers,
    gg=gg,
    inner_steps=h,
    leave=sim.leave_plan(config),
  )
  return timeline.simulate(spec), net


# -- DiLoCo -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,steps", [(4, 20), (16, 20)])
def test_diloco_round_is_h_slowest_steps_plus_one_allreduce(H, steps):
  """Without jitter, one worker 3x slower: each outer round lasts h x its step + one All-Reduce of the
  model (h = H, the last round the steps left: 16 then 4); OUTER lands at each round's end and the run
  ends with the last one."""
  config = sim_config("diloco", **{"diloco.inner_steps": H})
  trace, net = clock(config, steps)
  rounds = [H] * (steps // H) + ([steps % H] if steps % H else [])
  ends = np.cumsum([h * 3.0 * BASE + net.allreduce(8) for h in rounds])
  outer = [t for t, kind, a, _ in trace.events if kind == timeline.OUTER]
  np.testing.assert_allclose(outer, ends, rtol=1e-12)
  assert trace.end_time == pytest.approx(ends[-1], rel=1e-12)
  assert list(trace.worker_steps) == [steps] * 8
  wait = trace.time_split()["wait"]
  assert wait[3] == 0 and wait[0] == pytest.approx(steps * 2.0 * BASE)  # the others wait for it


def test_diloco_h1_clock_is_allreduces_with_one_last_collective():
  """H=1: the events of All-Reduce (OUTER where it has AVG), plus the last round's outer step."""
  dl, net = clock(sim_config("diloco", jitter=0.3, **{"diloco.inner_steps": 1}), 6)
  ar, _ = clock(sim_config("allreduce", jitter=0.3), 6)
  as_ar = [(t, timeline.AVG if k == timeline.OUTER else k, a, b) for t, k, a, b in dl.events]
  key = lambda e: (e[0], e[1], str(e[2]), str(e[3]))  # noqa: E731  within one instant, any order
  assert sorted(as_ar[:-1], key=key) == sorted(ar.events, key=key)
  assert dl.end_time == pytest.approx(ar.end_time + net.allreduce(8), rel=1e-12)


def _outer_reference(G, m, p_SxD, lr, mu):
  """DiLoCo's outer step in float64 numpy (Douillard et al., 2023; torch SGD with Nesterov)."""
  g = (G - p_SxD).mean(0)
  m = mu * m + g
  return G - lr * (g + mu * m), m


@functools.lru_cache  # one compile of each round program for the whole module: the fast tier's time
def _engine(n=4, outer=None, optimizer="momentum"):
  data = load_dataset("synthetic", seed=0)
  model = build_model("mlp", data["num_classes"], hidden=(8,))
  opt = make_optimizer(_small_config("diloco", **{"optimizer.name": optimizer}).optimizer, 10)
  mesh = C.make_worker_mesh(n, jax.devices()[:1])
  fn = engine.make_sim_round_fn(model, opt, mesh, n, n, outer=outer)
  init = lambda: engine.init_sim_state(model, opt, jax.random.key(0), data["x_train"][:1], n, mesh)  # noqa: E731
  return data, model, opt, mesh, fn, init


def _flat(tree, rows):
  return np.concatenate([np.asarray(a, np.float64).reshape(rows, -1) for a in jax.tree.leaves(tree)], 1)


@pytest.mark.parametrize("optimizer", ["momentum", pytest.param("adamw", marks=pytest.mark.slow)])
def test_diloco_outer_step_matches_numpy(optimizer):
  """Two outer steps (the momentum carries over) through the simulator's round against float64 numpy;
  float32 against float64: rtol 1e-5, atol 1e-6. A round without the outer step changes nothing. The
  inner optimizer's state (momentum SGD's, AdamW's) rides through the outer step untouched."""
  n, lr, mu = 4, 0.7, 0.9
  data, _, _, _, fn, init = _engine(n, outer=(lr, mu), optimizer=optimizer)
  state = init()
  state["outer"] = engine.init_outer_state(state["params"])
  rng = np.random.default_rng(0)
  G, m = _flat(state["outer"]["params"], 1)[0], np.zeros(_flat(state["params"], n).shape[1])
  x = np.zeros((n, 4) + data["x_train"].shape[1:], np.float32)
  y, ar, no = np.zeros((n, 4), np.int32), np.arange(n, dtype=np.int32), np.zeros(n, bool)
  none = np.full(n, -1, np.int32)
  for _ in range(2):
    noisy = jax.tree.map(lambda a: a + rng.normal(size=a.shape).astype(a.dtype), state["params"])
    p = _flat(noisy, n)
    state = {**state, "params": noisy}
    idle, _ = fn(state, x, y, none, ar, False, ar, no, outer_now=False)
    np.testing.assert_array_equal(_flat(idle["params"], n), p)
    state = idle
    state, _ = fn(state, x, y, none, ar, False, ar, no, outer_now=True)
    G, m = _outer_reference(G, m, p, lr, mu)
    np.testing.assert_allclose(_flat(state["outer"]["params"], 1)[0], G, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_flat(state["outer"]["momentum"], 1)[0], m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_flat(state["params"], n), np.broadcast_to(G, p.shape), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 3 s on a quiet machine: the fast tier is at its 2-minute budget
def test_diloco_h1_lr1_no_momentum_equals_allreduce_step_for_step():
  """H=1, outer lr 1, no momentum: the global model after each outer step is All-Reduce's average
  after the same step, and so is every worker's model and optimizer state (float tolerance: G - mean(G
  - p) against mean(p), rtol 1e-5, atol 1e-6), on a heterogeneous trace (jitter: compact rounds too)."""
  n = 8
  dl_trace, _ = clock(sim_config("diloco", jitter=0.3, **{"diloco.inner_steps": 1}), 6)
  ar_trace, _ = clock(sim_config("allreduce", jitter=0.3), 6)
  data, _, _, _, dl_fn, init = _engine(n, outer=(1.0, 0.0))
  ar_fn = _engine(n)[4]
  shards = shard_indices(data["y_train"], n, "iid", seed=0)

  def replay(trace, fn, kw):
    state, starts, after = init(), np.zeros(n, np.int64), []
    if kw:
      state["outer"] = engine.init_outer_state(state["params"])
    for r in timeline.pack_rounds(trace.events, n, n):
      idx = batch_indices(shards, 4, 0, starts)
      args = (r["apply_src"], r["gid"], r["ring"], r["pull_src"], r["start"])
      state, _ = fn(state, data["x_train"][idx], data["y_train"][idx], *args, **(kw(r) if kw else {}))
      starts += r["start"]
      if r["outer"] or (r["gid"] != np.arange(n)).any():
        after.append((_flat(state["params"], n), _flat(state["opt_state"], n)))
    return state, after

  dl, dl_after = replay(dl_trace, dl_fn, lambda r: {"outer_now": r["outer"]})
  ar, ar_after = replay(ar_trace, ar_fn, None)
  assert len(dl_after) == len(ar_after) + 1 == 6  # All-Reduce's last step has no collective
  for (p, o), (q, s) in zip(dl_after, ar_after):
    np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o, s, rtol=1e-5, atol=1e-6)
  # The last step: DiLoCo's outer step is the mean of what All-Reduce's workers hold.
  mean = _flat(ar["params"], n).mean(0)
  np.testing.assert_allclose(
    _flat(dl["params"], n), np.broadcast_to(mean, (n, mean.size)), rtol=1e-5, atol=1e-6
  )


@pytest.mark.slow  # two runs in process, too long for the fast tier
def test_diloco_run_h1_records_allreduces_metrics(tmp_path):
  """Through the executor (outer state, outer_now, compact rounds passing it through): H=1, lr 1, no
  momentum records All-Reduce's metrics at every step to float tolerance (rtol 1e-4 on losses), the
  same accuracies; the last record is one All-Reduce later and its workers agree (consensus 0)."""
  kw = {"hetero.jitter": 0.3, "hetero.slow_workers": (2,), "hetero.slowdown": 2.0}
  kw.update({"log_every": 1, "eval_every": 1})
  dl_kw = {"diloco.inner_steps": 1, "diloco.outer_lr": 1.0, "diloco.outer_momentum": 0.0}
  ar, _ = sim.simulate_and_train(_small_config("allreduce", **kw), str(tmp_path / "ar"))
  dl, trace = sim.simulate_and_train(_small_config("diloco", **kw, **dl_kw), str(tmp_path / "dl"))
  read = lambda d: [json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")]  # noqa: E731
  a, d = read("ar"), read("dl")
  assert [r["step"] for r in a] == [r["step"] for r in d] == list(range(1, 7))
  for ra, rd in zip(a, d):
    for key in ("train_loss", "test_loss"):
      assert rd[key] == pytest.approx(ra[key], rel=1e-4), (key, ra, rd)
    assert rd["test_accuracy"] == ra["test_accuracy"]
  assert [r["time"] for r in d[:-1]] == [r["time"] for r in a[:-1]] and d[-1]["time"] > a[-1]["time"]
  assert d[-1]["consensus_distance"] < 1e-5 < a[-1]["consensus_distance"]  # rounding only
  assert dl["worker_steps"] == ar["worker_steps"]


# -- DiLoCo as published: AdamW inner steps (Douillard et al., 2023) ----------------------------------


def _optimizer(name, **kw):
  opt = default_config.get_config("algorithm=diloco,executor=sim,num_workers=4").optimizer
  opt.name, opt.lr_schedule, opt.warmup_steps = name, "constant", 0
  opt.update(kw)
  return opt


def _tree(*rows):
  return {"w": jnp.array(rows[:2], jnp.float32), "b": jnp.array(rows[2], jnp.float32)}


def test_adamw_is_optax_adamw_with_decoupled_weight_decay():
  """optimizer.name=adamw is optax.adamw with config.optimizer's b1, b2, eps and weight decay, bit for
  bit over two steps (Adam's moments carry over); its decay is decoupled: a zero gradient moves a
  parameter by -lr x wd x param (Adam normalises a zero gradient to 0), where coupled L2 would have
  Adam normalise wd x param to about +-1 and move it by about lr. adam stays optax.adam(lr)."""
  lr, wd = 0.01, 0.1
  opt = _optimizer("adamw", lr=lr, weight_decay=wd, b1=0.8, b2=0.99, eps=1e-6)
  ours, ref = make_optimizer(opt, 10), optax.adamw(lr, 0.8, 0.99, 1e-6, weight_decay=wd)
  params = _tree([0.5, -2.0], [3.0, 0.1], [1.0, -1.0])
  s, r = ours.init(params), ref.init(params)
  for g in (_tree([0.3, -0.1], [0.0, 2.0], [-1.0, 0.5]), _tree([-0.2, 0.4], [1.0, 0.0], [0.1, 0.1])):
    u, s = ours.update(g, s, params)
    v, r = ref.update(g, r, params)
    jax.tree.map(np.testing.assert_array_equal, u, v)
    params = optax.apply_updates(params, u)
  zero = jax.tree.map(jnp.zeros_like, params)
  u, _ = ours.update(zero, ours.init(params), params)
  jax.tree.map(lambda a, p: np.testing.assert_allclose(a, -lr * wd * p, rtol=1e-6), u, params)
  adam = make_optimizer(_optimizer("adam", lr=lr, weight_decay=0.0), 10)
  u, _ = adam.update(params, adam.init(params), params)
  v, _ = optax.adam(lr).update(params, optax.adam(lr).init(params), params)
  jax.tree.map(np.testing.assert_array_equal, u, v)


@pytest.mark.slow  # 4 s in process: the fast tier's 2 minutes
def test_diloco_with_adamw_inner_steps_runs_and_learns(tmp_path):
  """The simulator's DiLoCo with AdamW inner steps (the workers' stacked Adam states): H = 2, 8 steps,
  the training loss falls, and after the last outer step every worker holds the global model."""
  kw = {"optimizer.name": "adamw", "optimizer.lr": 0.01, "optimizer.weight_decay": 0.1}
  kw.update({"diloco.inner_steps": 2, "num_steps": 8, "log_every": 4, "eval_every": 4})
  summary, _ = sim.simulate_and_train(_small_config("diloco", **kw), str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert summary["worker_steps"] == [8] * 8 and records[-1]["step"] == 8
  losses = [r["train_loss"] for r in records if "train_loss" in r]
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
  assert records[-1]["consensus_distance"] < 1e-5


def test_diloco_needs_a_clocked_executor_and_no_leave():
  config = default_config.get_config("algorithm=diloco,executor=spmd,num_workers=4")
  needs = r"^config\.algorithm: 'diloco' .* diloco needs executor=sim or executor=async$"
  with pytest.raises(ConfigError, match=needs):
    validate_train_config(config, num_devices=8, num_processes=5)
  config = default_config.get_config("algorithm=diloco,executor=async,num_workers=4")
  validate_train_config(config, num_devices=8, num_processes=5)
  config.runtime.elastic = True  # its outer step needs every worker: restart-all is its elastic form
  with pytest.raises(ConfigError, match=r"^config\.runtime\.elastic: True .* algorithm=diloco: its outer"):
    validate_train_config(config, num_devices=8, num_processes=5)
  config = sim_config("diloco", n=4, **{"hetero.leave": ((1, 0.1, -1),)})
  with pytest.raises(ConfigError, match=r"^config\.hetero\.leave: .* algorithm=diloco: its outer step"):
    validate_train_config(config, num_devices=8)
  config = sim_config("diloco", n=4, **{"diloco.inner_steps": 0})
  with pytest.raises(ConfigError, match=r"^config\.diloco\.inner_steps: 0 is not allowed"):
    validate_train_config(config, num_devices=8)


# -- Moshpit SGD ------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [(4, 4), (2, 4), (2, 3, 2)])
def test_moshpit_grid_rounds_average_exactly_in_d_rounds(grid):
  """numpy: the mixing matrices of any d consecutive layouts (cyclically) multiply to J / n."""
  layouts = schedule_lib.grid_layouts(grid)
  n, d = int(np.prod(grid)), len(grid)
  assert len(layouts) == d and all(len(g) == grid[k] for k, l in enumerate(layouts) for g in l)
  for k in range(d):
    w = np.eye(n)
    for j in range(d):
      w = C.mixing_matrix(layouts[(k + j) % d], n) @ w
    np.testing.assert_allclose(w, np.full((n, n), 1 / n), atol=1e-12)


def _avg_rounds(trace, n):
  """Each AVG event of the trace with the generator round (request) its group came from."""
  pending = {}
  for g in trace.buffer.groups:
    pending.setdefault(g.members, []).append(g.request)
  return [(tuple(a), pending[tuple(a)].pop(0)) for _, kind, a, _ in trace.events if kind == timeline.AVG]


def _replay_averages(groups, n, x_NxD):
  """The engine's P-Reduce (the simulator's full round: no step, no apply) over `groups` in order."""
  data, _, _, _, fn, init = _engine(n)
  state = init()
  shapes = [a.shape for a in jax.tree.leaves(state["params"])]
  leaves, s = [], 0
  for shape in shapes:  # x as the params: one column block per leaf
    size = int(np.prod(shape[1:]))
    leaves.append(x_NxD[:, s : s + size].reshape(shape).astype(np.float32))
    s += size
  state["params"] = jax.tree.unflatten(jax.tree.structure(state["params"]), leaves)
  x = np.zeros((n, 4) + data["x_train"].shape[1:], np.float32)
  y, ar, none = np.zeros((n, 4), np.int32), np.arange(n, dtype=np.int32), np.full(n, -1, np.int32)
  for members in groups:
    gid = ar.copy()
    gid[list(members)] = min(members)
    state, _ = fn(state, x, y, none, gid, False, ar, np.zeros(n, bool))
  return _flat(state["params"], n), sum(int(np.prod(s[1:])) for s in shapes)


@pytest.mark.parametrize("grid", [pytest.param((4, 4), marks=pytest.mark.slow), (2, 2, 4)])
def test_moshpit_clock_averages_along_one_dimension_per_round(grid):
  """Heterogeneous speeds (a 3x straggler, jitter): every worker's k-th average is its group of
  layout k mod d, and replaying the averages alone through the engine gives every worker the exact
  mean once it has averaged d times (float32: rtol 1e-5)."""
  n, d = int(np.prod(grid)), len(grid)
  layouts = schedule_lib.grid_layouts(grid)
  trace, _ = clock(sim_config("moshpit", n=n, jitter=0.3, **{"moshpit.grid": grid}), 4 * d)
  seen = [0] * n
  avgs = [a for _, kind, a, _ in trace.events if kind == timeline.AVG]
  for members in avgs:
    for m in members:
      assert members == next(g for g in layouts[seen[m] % d] if m in g), (m, seen[m], members)
      seen[m] += 1
  assert min(seen) >= d
  x = np.random.default_rng(1).normal(size=(n, 200))
  got, D = _replay_averages(avgs, n, x)
  np.testing.assert_allclose(got, np.broadcast_to(x[:, :D].mean(0), (n, D)), rtol=1e-5, atol=1e-6)


def test_moshpit_with_a_dead_peer_averages_its_groups_without_it():
  """Worker 5 of a (2, 4) grid dead from the start: round r's groups are layout r mod 2's groups less
  worker 5 (its pair partner 1 has no group in the dimension-0 rounds); the engine's averages over the
  complete rounds equal numpy's lockstep Moshpit over those groups for every worker (5 keeps its own
  model; float32: rtol 1e-5)."""
  n, grid = 8, (2, 4)
  layouts = schedule_lib.grid_layouts(grid)
  config = sim_config("moshpit", jitter=0.3, **{"moshpit.grid": grid, "hetero.leave": ((5, 0.0, -1),)})
  trace, _ = clock(config, 8)
  rounds = {}
  for g in trace.buffer.groups:
    rounds.setdefault(g.request, []).append(g.members)
  for r, request in enumerate(sorted(rounds)):
    live = [tuple(m for m in g if m != 5) for g in layouts[r % 2]]
    assert sorted(rounds[request]) == sorted(g for g in live if len(g) > 1), r
  avgs = _avg_rounds(trace, n)
  done = {}
  for _, request in avgs:
    done[request] = done.get(request, 0) + 1
  complete = [q for q in sorted(rounds) if done.get(q, 0) == len(rounds[q])]
  last = next((q for q, c in zip(sorted(rounds), complete) if q != c), None)  # complete rounds: a prefix
  complete = [q for q in complete if last is None or q < last]
  assert len(complete) >= 4
  x = np.random.default_rng(2).normal(size=(n, 200))
  got, D = _replay_averages([m for m, q in avgs if q in complete], n, x)
  ref = x[:, :D].copy()
  for q in complete:
    for g in rounds[q]:
      ref[list(g)] = ref[list(g)].mean(0)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  assert not np.allclose(ref[1], ref[0])  # the dead peer's pair partner lags: a real degradation


def test_moshpit_grid_is_validated_and_needs_a_clocked_executor():
  with pytest.raises(ConfigError, match=r"^config\.moshpit\.grid: \(3, 3\) is not allowed: .*num_workers=8"):
    validate_train_config(sim_config("moshpit", **{"moshpit.grid": (3, 3)}), num_devices=8)
  with pytest.raises(ConfigError, match=r"^config\.moshpit\.grid: \(1, 8\) is not allowed"):
    validate_train_config(sim_config("moshpit", **{"moshpit.grid": (1, 8)}), num_devices=8)
  validate_train_config(sim_config("moshpit", **{"moshpit.grid": (2, 2, 2)}), num_devices=8)
  assert default_config.get_config("num_workers=16").moshpit.grid == (4, 4)
  config = default_config.get_config("algorithm=moshpit,executor=spmd,num_workers=8")
  needs = r"^config\.algorithm: 'moshpit' .* moshpit needs executor=sim or executor=async$"
  with pytest.raises(ConfigError, match=needs):
    validate_train_config(config, num_devices=8)
  config = default_config.get_config("algorithm=moshpit,executor=async,num_workers=4")
  with pytest.raises(ConfigError, match=r"^config\.moshpit\.grid: \(2, 4\) is not allowed"):
    config.moshpit.grid = (2, 4)
    validate_train_config(config, num_devices=8, num_processes=5)


class _Recorded:
  """A windowed Moshpit generator that logs each group it makes with the view it was made on: (asker,
  members, view.now, every worker's expected readiness, whether the request was a forced one)."""

  ask_ahead = False

  def __init__(self, gen):
    self.gen, self.log = gen, []

  def __call__(self, worker, view):
    before, ready = view.buffer.count, view.started_at + view.estimates
    forced = bool(self.gen.skipped[worker] >= self.gen.max_gap)
    self.gen(worker, view)
    for g in view.buffer.groups[before - view.buffer.first :]:
      self.log.append((worker, g.members, view.now, ready, forced))


def _fast_rate(config, steps=300, record=False):
  """Worker steps per virtual second of the workers that are not slow, and the generator's log."""
  speed, net = sim.build_clock(config, model_bytes=4e5, base_time=BASE)
  gg = sim.make_group_generator(config, np.random.default_rng([4, config.seed]))
  gg = _Recorded(gg) if record else gg
  trace = timeline.simulate(timeline.ClockSpec("moshpit", speed, net, steps * config.num_workers, gg=gg))
  fast = np.delete(np.asarray(trace.worker_steps), list(config.hetero.slow_workers))
  return fast.mean() / trace.end_time, gg, trace


def test_windowed_moshpit_does_not_wait_for_a_straggler_and_lockstep_does():
  """A 5x straggler (worker 3) on a (4, 4) grid, jitter 0.05, a window of half a base step: no group
  another worker asked for holds the straggler unless it was expected ready within the window (forced
  requests aside), its lines average without it, and the fast workers step at the homogeneous rate
  (within 10%); lockstep Moshpit runs at the straggler's pace (under a quarter of its homogeneous rate)."""
  kw = {"moshpit.window": 0.5 * BASE, "moshpit.grid": (4, 4)}
  windowed = sim_config("moshpit", n=16, s=5.0, jitter=0.05, **kw)
  rate, rec, trace = _fast_rate(windowed, record=True)
  home, _, _ = _fast_rate(sim_config("moshpit", n=16, slow=(), jitter=0.05, **kw))
  assert rate > 0.9 * home, (rate, home)
  drawn_in = [(now, ready[3]) for a, m, now, ready, forced in rec.log if 3 in m and a != 3 and not forced]
  assert drawn_in and all(r <= now + 0.5 * BASE for now, r in drawn_in)
  forced_in = [m for a, m, _, _, forced in rec.log if 3 in m and a != 3 and forced]
  assert len(forced_in) <= 2  # a fast worker's forced request takes the soonest peer: hardly ever it
  lines = [set(g) for layout in schedule_lib.grid_layouts((4, 4)) for g in layout if 3 in g]
  without = [m for _, m, _, _, _ in rec.log if 3 not in m and any(set(m) <= line for line in lines)]
  assert len(without) > 10 * len(drawn_in)  # its lines went on without it
  assert 20 < trace.worker_steps[3] < 0.3 * trace.worker_steps[0]  # it stepped at its own pace
  with_it = sum(3 in m for _, m, _, _, _ in rec.log)
  assert with_it > trace.worker_steps[3] / 2  # and averaged in most of its steps
  lockstep, _, _ = _fast_rate(sim_config("moshpit", n=16, s=5.0, jitter=0.05, **{"moshpit.grid": (4, 4)}))
  lock_home, _, _ = _fast_rate(sim_config("moshpit", n=16, slow=(), jitter=0.05, **{"moshpit.grid": (4, 4)}))
  assert lockstep < 0.25 * lock_home, (lockstep, lock_home)


def test_moshpit_window_keys_are_validated_and_zero_is_lockstep():
  config = sim_config("moshpit", **{"moshpit.window": -0.1})
  with pytest.raises(ConfigError, match=r"^config\.moshpit\.window: -0\.1 is not allowed: seconds >= 0"):
    validate_train_config(config, num_devices=8)
  config = sim_config("moshpit", **{"moshpit.window": 0.01, "moshpit.max_gap": -1})
  with pytest.raises(ConfigError, match=r"^config\.moshpit\.max_gap: -1 is not allowed"):
    validate_train_config(config, num_devices=8)
  config.moshpit.max_gap = 2
  validate_train_config(config, num_devices=8)
  gen = sim.make_group_generator(config, np.random.default_rng(0))
  assert isinstance(gen, group_gen.moshpit_window_gg) and gen.max_gap == 2 and not gen.ask_ahead
  config.moshpit.window = 0.0
  assert isinstance(sim.make_group_generator(config, np.random.default_rng(0)), group_gen.moshpit_gg)

"""Today's baselines in the asynchronous runtime (executor=async, real processes): Moshpit SGD's grid
rounds through the authority (elastic: without a dead worker), and DiLoCo's All-Reduce every H steps
with its outer step, each replayed exactly by the engine."""

import json
import os

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from configs import default as default_config
from ripples_jax import engine
from ripples_jax import schedule as schedule_lib
from ripples_jax.runtime import diloco
from ripples_jax.runtime import trace as trace_lib
from tests.test_runtime import MODEL, assert_replay_matches, launch_bounded, make_config, run_args


def groups_of(traces, w):
  return [sorted(e["m"]) for e in traces[w] if e["k"] == "group"]


@pytest.mark.slow
@pytest.mark.nightly  # the full tier's Moshpit rounds are the online protocol's (tests/test_online.py)
def test_moshpit_on_four_processes_alternates_grid_dimensions_and_replays(tmp_path):
  """4 workers on the grid (2, 2): the authority appends one whole round per request, so every
  worker's j-th group is its group along dimension j mod 2 (never a group of another shape), and the
  engine's replay of the recorded order lands on every worker's model."""
  workdir, steps = str(tmp_path / "run"), 32
  args = run_args(
    workdir, "moshpit", 4, steps, ["--config.runtime.step_time=0.01", "--config.moshpit.grid=(2,2)"]
  )
  code, out = launch_bounded(4, args)
  assert code == 0, out[-3000:]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert sum(summary["worker_steps"]) >= 4 * steps and summary["authority"]["requests"] > 0
  layouts = schedule_lib.grid_layouts((2, 2))
  traces = trace_lib.load_traces(workdir)
  for w in range(4):
    got = groups_of(traces, w)
    assert len(got) >= steps // 2, got
    assert got == [sorted(next(g for g in layouts[j % 2] if w in g)) for j in range(len(got))], (w, got)
  config = make_config("moshpit", 4, steps, MODEL)
  config.moshpit.grid = (2, 2)
  assert_replay_matches(config, workdir, tmp_path)


def test_diloco_outer_step_on_the_flat_layout_is_the_engines():
  """runtime/diloco.py's outer step on one worker's flat {"params", "model_state"} equals the engine's
  over the stacked workers (engine.diloco_outer_step, which the replay runs), two rounds (momentum)."""
  rng = np.random.default_rng(0)
  S, lr, mu = 3, 0.7, 0.9
  params = {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
  state = {"bn": rng.normal(size=6).astype(np.float32)}
  config = default_config.get_config("algorithm=diloco,executor=async,num_workers=3")
  config.diloco.outer_lr, config.diloco.outer_momentum = lr, mu
  step = diloco.make_outer_step(config, params, state)
  flat0, unravel = ravel_pytree({"params": params, "model_state": state})
  outer, want = diloco.init_outer(flat0), engine.init_outer_state(stack([params] * S))
  for _ in range(2):
    workers = [
      jax.tree.map(lambda a: a + rng.normal(size=a.shape).astype(np.float32), params) for _ in range(S)
    ]
    states = [
      jax.tree.map(lambda a: a + rng.normal(size=a.shape).astype(np.float32), state) for _ in range(S)
    ]
    got_p, got_s, want = engine.diloco_outer_step(lr, mu, stack(workers), stack(states), want)
    mean = ravel_pytree({"params": mean_of(workers), "model_state": mean_of(states)})[0]
    flat, outer = step(mean, outer)
    tree = unravel(flat)
    for w in range(S):  # every slot restarts from the new global model, the state averaged
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b[w], rtol=1e-5, atol=1e-6), tree["params"], got_p
      )
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b[w], rtol=1e-5, atol=1e-6), tree["model_state"], got_s
      )


def stack(trees):
  return jax.tree.map(lambda *a: np.stack(a), *trees)


def mean_of(trees):
  return jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *trees)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["momentum", pytest.param("adamw", marks=pytest.mark.nightly)])
def test_diloco_on_two_processes_averages_every_h_steps_and_replays(tmp_path, optimizer):
  """2 workers, H = 4: the All-Reduce with its outer step after every 4th local step and after the
  last, nothing between; the engine's replay (its OUTER events) lands on every worker's model, which is
  the one global model. The inner steps are the run's optimizer: momentum SGD, or AdamW as published."""
  n, workdir, steps, H = 2, str(tmp_path / "run"), 30, 4
  extra = ["--config.runtime.step_time=0.01", f"--config.diloco.inner_steps={H}"]
  opt = {"optimizer.name": optimizer} | ({"optimizer.lr": 0.003} if optimizer == "adamw" else {})
  args = run_args(workdir, "diloco", n, steps, extra + [f"--config.{k}={v}" for k, v in opt.items()])
  code, out = launch_bounded(n, args)
  assert code == 0, out[-3000:]
  traces = trace_lib.load_traces(workdir)
  for w in range(n):
    done, at = 0, []
    for e in traces[w]:
      done += e["k"] == "step"
      if e["k"] == "group":
        assert e["outer"] and e["m"] == list(range(n)), e
        at.append(done)
    assert done == steps and at == [*range(H, steps, H), steps], (w, at)
  # The one group is connected before the run (gloo's 30 s rendezvous would end a run whose straggler
  # reaches the first outer step later): no set-up inside the run.
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert all(s == 0.0 for s in summary["group_setup_s"]) and all(a > 0 for a in summary["group_ahead_s"])
  finals = [np.load(os.path.join(workdir, "snapshots", f"final-{w}.npy")) for w in range(n)]
  for f in finals[1:]:
    np.testing.assert_allclose(f, finals[0], rtol=1e-6, atol=1e-7)
  # The deployable model is the global one (worker 0's copy at every evaluation and the end), held by
  # every worker after the last outer step, and charged nothing.
  snap = os.path.join(workdir, "snapshots")
  np.testing.assert_allclose(np.load(os.path.join(snap, "final-global.npy")), finals[0], rtol=1e-6, atol=1e-7)
  evals = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl")) if "test_accuracy" in l]
  assert summary["consensus_charge"] == 0.0 and len(evals) >= 4
  assert all(os.path.exists(os.path.join(snap, f"eval{i}-global.npy")) for i in range(len(evals) - 1))
  assert evals[-1]["consensus_accuracy"] == evals[-1]["test_accuracy"]
  # Mid-run a marker falls between outer steps: the inner models' mean is not the deployable model.
  assert any(r["consensus_accuracy"] != r["test_accuracy"] for r in evals[1:-1]), evals
  assert all(r["consensus_time"] == r["time"] for r in evals)
  config = make_config("diloco", n, steps, MODEL, **opt)
  config.diloco.inner_steps = H
  assert_replay_matches(config, workdir, tmp_path)


@pytest.mark.slow
@pytest.mark.nightly
def test_moshpit_goes_on_without_a_dead_worker_and_replays(tmp_path):
  """Elastic Moshpit (runtime.elastic) on the grid (2, 2): worker 2 dies at its step 20; the rounds made
  after its leave average its grid groups without it (worker 0's group along dimension 0 and worker
  3's along dimension 1 become groups of one, which are none), the others end at the budget, and the
  replay equals their models."""
  from tests.test_elastic import assert_replayed, elastic_run, traces_of

  steps = 120
  fail = ["--config.runtime.fail_worker=2", "--config.runtime.fail_step=20", "--config.moshpit.grid=(2,2)"]
  code, out, workdir, summary = elastic_run(tmp_path, steps, fail, algorithm="moshpit")
  assert code == 0, out[-3000:]
  assert "worker 2 exited with -9 (SIGKILL); the run goes on without it" in out
  assert [e[1:] for e in summary["membership"]] == [[2, "leave"]], summary["membership"]
  traces = traces_of(workdir)
  after = [sorted(e["m"]) for w in (0, 1, 3) for e in after_leave(traces[w], 2) if e["k"] == "group"]
  assert after and {tuple(m) for m in after} <= {(0, 1), (1, 3)}, after  # (0, 2) and (2, 3) lost worker 2
  assert sum(summary["worker_steps"]) + summary["unmade_steps"] >= 4 * steps
  assert_replayed(workdir, steps, "moshpit")


def after_leave(events, worker):
  """The events after this trace's membership entry for `worker`'s leave."""
  at = next(
    i for i, e in enumerate(events) if e["k"] == "member" and e["w"] == worker and e["kind"] == "leave"
  )
  return events[at + 1 :]


def ps_reference(config):
  """The single-process pieces a parameter server's run is made of: (initial flat, the local step's
  jitted halves on one device, batch(w, step), the left-to-right mean of k buffers, optimizer init)."""
  from jax.sharding import Mesh

  from ripples_jax import data as data_lib
  from ripples_jax import workload
  from ripples_jax.distributed.arrays import LOCAL
  from ripples_jax.models import init_model
  from ripples_jax.runtime.process import make_step_fns

  s = workload.build(config)
  params, ms = init_model(s.model, jax.random.key(config.seed), s.data["x_train"][:1])
  flat0, unravel = ravel_pytree({"params": params, "model_state": ms})
  grad_fn, apply_fn, rep, batch_sharding = make_step_fns(
    s.model, s.optimizer, unravel, Mesh(np.array(jax.devices()[:1]), (LOCAL,))
  )

  def batch(w, step):
    idx = data_lib.batch_indices([s.shards[w]], config.batch_size, config.seed, [step], workers=[w])[0]
    return (
      jax.device_put(s.data["x_train"][idx], batch_sharding),
      jax.device_put(s.data["y_train"][idx], batch_sharding),
    )

  def opt0():
    return jax.device_put(jax.device_get(s.optimizer.init(params)), rep)

  return jax.device_put(np.asarray(flat0), rep), grad_fn, apply_fn, batch, opt0


def ps_run(tmp_path, algorithm, n, steps):
  workdir = str(tmp_path / "run")
  args = run_args(
    workdir, algorithm, n, steps, ["--config.runtime.step_time=0.01", "--config.runtime.checkpoint_every=0"]
  )
  code, out = launch_bounded(n, args)
  assert code == 0, out[-3000:]
  snap = lambda name, w: np.load(os.path.join(workdir, "snapshots", f"{name}-{w}.npy"))  # noqa: E731
  server = [json.loads(line) for line in open(os.path.join(workdir, "server.jsonl"))]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["worker_steps"] == [steps] * n
  return make_config(algorithm, n, steps, MODEL), snap, server, summary


@pytest.mark.slow
def test_ps_sync_on_two_processes_is_the_mean_of_the_local_steps_every_step(tmp_path):
  """ps_sync, 2 workers and the coordinator's server: every step each worker's local step (its own
  optimizer) from the one model, then the server's mean, which every worker pulls: the single-process
  reference of those rounds lands on the server's final model and every worker's, and the server's
  evaluation marks sit after every eval_every steps (k x 8 x n worker steps)."""
  n, steps = 2, 20
  config, snap, server, summary = ps_run(tmp_path, "ps_sync", n, steps)
  flat, grad_fn, apply_fn, batch, opt0 = ps_reference(config)
  opts = [opt0() for _ in range(n)]
  mean = jax.jit(lambda *xs: sum(xs[1:], xs[0]) / len(xs))
  for step in range(steps):
    models = []
    for w in range(n):
      g, ms, _ = grad_fn(flat, *batch(w, step))
      new, opts[w] = apply_fn(jax.numpy.array(flat), opts[w], g, ms)
      models.append(new)
    flat = mean(*models)
  for who in (n, *range(n)):
    np.testing.assert_allclose(snap("final", who), np.asarray(flat), rtol=1e-6, atol=1e-7)
  assert [(e["id"], e["s"]) for e in server if e["k"] == "mark"] == [(0, 0), (1, 8 * n), (2, 16 * n)]
  records = [json.loads(line) for line in open(os.path.join(str(tmp_path / "run"), "metrics.jsonl"))]
  assert [r["worker_steps"] for r in records if "test_accuracy" in r] == [0, 16, 32, 40]
  assert summary["time_to_target"] is None or summary["time_to_target"] > 0


@pytest.mark.slow
def test_ps_async_on_two_processes_applies_each_gradient_to_the_model_it_was_pulled_after(tmp_path):
  """ps_async, 2 workers: server.jsonl's applies, in order, are every worker's steps 0..steps-1 once
  each; replaying them (each gradient on the model the worker pulled after its previous push, applied
  by the server's optimizer at lr / n) lands on the server's final model, and each worker's final model
  is the server's right after that worker's last gradient."""
  n, steps = 2, 20
  config, snap, server, _ = ps_run(tmp_path, "ps_async", n, steps)
  applies = [(e["w"], e["s"]) for e in server if e["k"] == "apply"]
  for w in range(n):
    assert [s for v, s in applies if v == w] == list(range(steps))
  flat, grad_fn, apply_fn, batch, opt0 = ps_reference(config)
  opt, pulled = opt0(), {w: flat for w in range(n)}
  for w, s in applies:
    g, ms, _ = grad_fn(pulled[w], *batch(w, s))
    flat, opt = apply_fn(jax.numpy.array(flat), opt, g, ms)
    pulled[w] = flat
  np.testing.assert_allclose(snap("final", n), np.asarray(flat), rtol=1e-6, atol=1e-7)
  for w in range(n):
    np.testing.assert_allclose(snap("final", w), np.asarray(pulled[w]), rtol=1e-6, atol=1e-7)


def test_ps_runs_in_the_runtime_with_the_coordinator_as_server_and_refuses_elastic():
  from ripples_jax import run as run_lib
  from ripples_jax.config import validate_train_config
  from ripples_jax.errors import ConfigError

  for algorithm in ("ps_sync", "ps_async"):
    config = default_config.get_config(f"algorithm={algorithm},executor=async,num_workers=4")
    validate_train_config(config, num_devices=8, num_processes=5)
    assert run_lib.executor_of(config) == "async/ps"
    config.runtime.elastic = True
    with pytest.raises(ConfigError, match=rf"^config\.runtime\.elastic: True .* algorithm={algorithm}: its "):
      validate_train_config(config, num_devices=8, num_processes=5)

"""The asynchronous parameter server's staleness-aware step (ps.staleness=divide, Zhang et al. 2016) and
its momentum (ps.server_momentum): the staleness count, the simulator against a reference replaying the
clock's events, and the validator's one-line errors."""

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from configs import default as default_config
from ripples_jax import engine, sim, workload
from ripples_jax.config import ConfigError
from ripples_jax.config import validate_train_config as validate_config
from ripples_jax.data import batch_indices
from ripples_jax.models import init_model
from ripples_jax.timeline import APPLY, JOIN, PULL, START, ps_async


def test_the_staleness_of_each_application_is_the_servers_updates_since_the_pull_it_was_computed_on():
  """Three workers and the server (slot 3). Versions count the server's applies; a gradient's staleness
  is the version it makes minus the version its worker pulled last (0 before any pull)."""
  S = 3
  events = [
    (0.0, PULL, 0, S),  # w0 holds v0
    (0.0, PULL, 1, S),  # w1 holds v0
    (0.0, START, 0, None),
    (1.0, APPLY, S, 0),  # v1 from v0: 1
    (1.0, PULL, 0, S),  # w0 holds v1
    (1.1, APPLY, S, 2),  # w2 never pulled: v2 from the initial v0: 2
    (1.2, APPLY, S, 1),  # v3 from v0: 3
    (1.3, APPLY, S, 0),  # v4 from v1: 3
    (1.4, PULL, 1, S),  # w1 holds v4
    (1.5, JOIN, 2, S),  # w2 (rejoined) holds v4
    (1.6, APPLY, S, 2),  # v5 from v4: 1
    (1.7, APPLY, S, 1),  # v6 from v4: 2
    (1.8, APPLY, 1, 1),  # a worker's own apply is not the server's
  ]
  assert ps_async.staleness(events, S) == [1, 2, 3, 3, 1, 2]
  # The runtime's server: apply, then that worker's pull, one request at a time.
  count = ps_async.Staleness()
  assert [count.apply(0), count.apply(1)] == [1, 2]
  count.pull(1)
  assert [count.apply(0), count.apply(1)] == [3, 2]


def test_a_homogeneous_clocks_steady_staleness_is_the_worker_count():
  """Equal workers take turns: every gradient in the steady state has the n - 1 others' before it."""
  c = default_config.get_config("algorithm=ps_async,executor=sim,num_workers=4,steps=10")
  taus = ps_async.staleness(sim.run_clock(c, 4e5, 0.01).events, 4)
  assert len(taus) == 40 and taus[:3] == [1, 2, 3] and set(taus[10:]) == {4}


def _run(tmp_path, monkeypatch, **kw):
  """A small simulated ps_async run (3 workers, one 3x slower, jitter): (config, the final state, the
  clock's trace)."""
  c = default_config.get_config("algorithm=ps_async,executor=sim,num_workers=3,dataset=synthetic,model=mlp")
  c.num_steps, c.log_every, c.eval_every, c.checkpoint_every = 5, 5, 5, 0
  c.hetero.slow_workers, c.hetero.slowdown, c.hetero.jitter = (1,), 3.0, 0.3
  c.optimizer.lr_schedule, c.optimizer.warmup_steps, c.optimizer.lr = "constant", 0, 0.3
  c.update_from_flattened_dict(kw)
  got, execute = {}, sim.execute

  def spy(*args, **kwargs):  # the state the executor ends with (simulate_and_train returns the summary)
    got["out"] = execute(*args, **kwargs)
    got["trace"] = args[4]
    return got["out"]

  monkeypatch.setattr(sim, "execute", spy)
  sim.simulate_and_train(c, str(tmp_path))
  return c, got["out"][0], got["trace"]


def _reference(c, events):
  """The server's final flat params from the clock's events, replayed here: each START a gradient (jax's)
  on the model its worker pulled last, each APPLY the server's momentum SGD with L2 in numpy, the
  gradient times 1 / staleness counted by hand (divide: at the config's lr; none: at lr / n)."""
  s, n = workload.build(c), c.num_workers
  params, ms = init_model(s.model, jax.random.key(c.seed), s.data["x_train"][:1])
  flat, unravel = ravel_pytree(params)
  loss = lambda f, x, y: engine.cross_entropy_loss(s.model, unravel(f), ms, x, y)[0]  # noqa: E731
  grad = jax.jit(jax.grad(loss))
  divide, mu, wd = c.ps.staleness == "divide", c.ps.server_momentum, c.optimizer.weight_decay
  lr = c.optimizer.lr if divide else c.optimizer.lr / n
  server, held = np.asarray(flat), {w: np.asarray(flat) for w in range(n)}
  trace, pending, steps, version, pulled = np.zeros_like(server), {}, [0] * n, 0, [0] * n
  for _, kind, a, b in events:
    if kind == START:
      idx = batch_indices([s.shards[a]], c.batch_size, c.seed, [steps[a]], workers=[a])[0]
      pending[a], steps[a] = (
        np.asarray(grad(held[a], s.data["x_train"][idx], s.data["y_train"][idx])),
        steps[a] + 1,
      )
    elif kind == APPLY:
      version += 1
      g = pending.pop(b) * (np.float32(1.0 / (version - pulled[b])) if divide else 1)
      trace = mu * trace + g + wd * server
      server = server - lr * trace
    elif kind == PULL:
      held[a], pulled[a] = server, version
  return server


@pytest.mark.slow  # 2-3 s each in process: the fast tier's 2 minutes
@pytest.mark.parametrize("staleness", ["divide", "none"])
def test_the_servers_model_is_the_reference_replay_of_the_clock_with_lr_over_staleness(
  tmp_path, monkeypatch, staleness
):
  c, state, trace = _run(tmp_path, monkeypatch, **{"ps.staleness": staleness, "ps.server_momentum": 0.5})
  taus = ps_async.staleness(trace.events, c.num_workers)
  assert len(taus) == 15 and max(taus) > c.num_workers  # the slow worker's gradients are staler than n
  got = ravel_pytree(jax.tree.map(lambda a: np.asarray(a[c.num_workers]), state["params"]))[0]
  np.testing.assert_allclose(got, _reference(c, trace.events), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "key, value, says",
  [
    ("ps.staleness", "half", "config.ps.staleness: 'half' is not allowed: one of none, divide"),
    ("ps.server_momentum", 1.0, "config.ps.server_momentum: 1.0 is not allowed: a number in [0, 1)"),
    ("ps.server_momentum", -0.1, "config.ps.server_momentum: -0.1 is not allowed: a number in [0, 1)"),
  ],
)
def test_the_validator_refuses_bad_ps_keys_in_one_line_and_only_for_ps_async(key, value, says):
  c = default_config.get_config("executor=sim,num_workers=4,algorithm=ps_async")
  c.update_from_flattened_dict({key: value})
  with pytest.raises(ConfigError) as e:
    validate_config(c, num_devices=8)
  assert str(e.value) == says
  for other in ("ps_sync", "adpsgd"):  # their records do not name the key: it is not read, not checked
    c.algorithm = other
    validate_config(c, num_devices=8)


def test_divide_needs_an_sgd_optimizer():
  c = default_config.get_config("executor=sim,num_workers=4,algorithm=ps_async")
  c.ps.staleness, c.optimizer.name = "divide", "adam"
  with pytest.raises(ConfigError) as e:
    validate_config(c, num_devices=8)
  assert str(e.value).startswith(
    "config.ps.staleness: 'divide' is not allowed: none with optimizer.name=adam"
  )
  assert "\n" not in str(e.value)
  c.optimizer.name = "nesterov"
  validate_config(c, num_devices=8)


def test_the_server_momentum_is_the_servers_optimizer_and_the_default_is_the_earlier_server():
  """ps.server_momentum sets the server optimizer's momentum; by default (0.9) the optimizer is the one
  every earlier ps_async run used (optimizer.momentum, and a config without `ps` reads that)."""
  c = default_config.get_config("executor=sim,num_workers=4,algorithm=ps_async,dataset=synthetic")
  assert (c.ps.staleness, c.ps.server_momentum) == ("none", c.optimizer.momentum)
  old = c.copy_and_resolve_references()
  del old["ps"]
  assert (workload.ps_staleness(old), workload.server_momentum(old)) == ("none", c.optimizer.momentum)
  c.ps.server_momentum = 0.0
  assert workload.server_momentum(c) == 0.0

"""The public API: every name in ripples_jax.__all__ resolves, and P-Reduce / mixing matrices agree."""

import numpy as np
import pytest

import ripples_jax


def test_every_exported_name_resolves_and_is_documented():
  for name in ripples_jax.__all__:
    obj = getattr(ripples_jax, name)
    assert callable(obj), name
    assert obj.__doc__, f"{name} has no docstring"
    assert name in ripples_jax.__doc__, f"{name} is not described in the package docstring"


def test_p_reduce_equals_the_mixing_matrix():
  groups = [(0, 3), (1, 2, 5), (4,), (6, 7)]
  x_WxD = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
  got = np.asarray(ripples_jax.p_reduce(x_WxD, groups))
  np.testing.assert_allclose(got, ripples_jax.mixing_matrix(groups, 8) @ x_WxD, rtol=1e-6, atol=1e-6)
  # Fixed disjoint groups never mix across groups (gap 0); one group of everyone mixes in a round (gap 1).
  assert abs(ripples_jax.spectral_gap([ripples_jax.mixing_matrix(groups, 8)])) < 1e-9
  assert abs(ripples_jax.spectral_gap([ripples_jax.mixing_matrix([tuple(range(8))], 8)]) - 1) < 1e-9


def test_return_state_needs_the_final_checkpoint():
  from configs import default
  from ripples_jax.config import ConfigError

  config = default.get_config("executor=sim,num_workers=8,dataset=synthetic,model=mlp,steps=2")
  config.checkpoint_every = 0
  with pytest.raises(ConfigError, match=r"^config.checkpoint_every: 0 is not allowed with return_state=True"):
    ripples_jax.train_and_evaluate(config, None, return_state=True)

"""P-Reduce against numpy, its invariants, mixing matrices, and compile counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ripples_jax import collectives as C

N = 8
LAYOUTS = {
  "equal": [[0, 1, 2, 3], [4, 5, 6, 7]],
  "unequal": [[0, 1, 2], [3, 4, 5], [6, 7]],  # pmean with groups is wrong exactly here
  "singletons": [[0], [1, 2, 3, 4, 5, 6], [7]],
  "partial": [[1, 6]],  # unlisted workers stay untouched
  "all": [list(range(8))],
  "none": [],
}


def numpy_p_reduce(x, groups):
  out = x.copy()
  for g in groups:
    out[g] = x[g].mean(axis=0)
  return out


@pytest.fixture(scope="module")
def mesh():
  return C.make_worker_mesh(N)


@pytest.mark.parametrize("impl", ["collective", "segment"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_p_reduce_matches_numpy(mesh, impl, name):
  rng = np.random.default_rng(0)
  tree = {"w": rng.normal(size=(N, 3, 5)).astype(np.float32), "b": rng.normal(size=(N, 7)).astype(np.float32)}
  out = C.p_reduce(jax.tree.map(jnp.asarray, tree), LAYOUTS[name], mesh=mesh, impl=impl)
  for k in tree:
    np.testing.assert_allclose(
      np.asarray(out[k]), numpy_p_reduce(tree[k], LAYOUTS[name]), rtol=1e-6, atol=1e-6
    )


def test_unequal_groups_are_not_divided_by_first_group_size(mesh):
  out = C.p_reduce(jnp.arange(8.0), LAYOUTS["unequal"], mesh=mesh, impl="collective")
  np.testing.assert_allclose(np.asarray(out), [1, 1, 1, 4, 4, 4, 6.5, 6.5])


@pytest.mark.parametrize("impl", ["collective", "segment"])
def test_p_reduce_keeps_the_mean_of_all_workers(mesh, impl):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(N, 1000)).astype(np.float32)
  for _ in range(5):
    perm = rng.permutation(N)
    cuts = np.sort(rng.choice(np.arange(1, N), size=rng.integers(1, 5), replace=False))
    groups = [list(g) for g in np.split(perm, cuts)]
    y = np.asarray(C.p_reduce(jnp.asarray(x), groups, mesh=mesh, impl=impl))
    np.testing.assert_allclose(y.mean(0), x.mean(0), rtol=1e-5, atol=1e-6)
    # and it is a projection: averaging again changes nothing
    y2 = np.asarray(C.p_reduce(jnp.asarray(y), groups, mesh=mesh, impl=impl))
    np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6)


def test_one_group_of_all_equals_full_mean(mesh):
  x = np.random.default_rng(2).normal(size=(N, 64)).astype(np.float32)
  for impl in ("collective", "segment"):
    y = np.asarray(C.p_reduce(jnp.asarray(x), LAYOUTS["all"], mesh=mesh, impl=impl))
    np.testing.assert_allclose(y, np.broadcast_to(x.mean(0), x.shape), rtol=1e-6, atol=1e-6)


def test_bad_groups_are_rejected():
  with pytest.raises(ValueError, match="appears twice"):
    C.canonical_layout([[0, 1], [1, 2]], 4)
  with pytest.raises(ValueError, match=r"\[0, 4\)"):
    C.canonical_layout([[0, 4]], 4)


def test_mixing_matrix_properties():
  for groups in LAYOUTS.values():
    w = C.mixing_matrix(groups, N)
    np.testing.assert_allclose(w, w.T)
    np.testing.assert_allclose(w.sum(0), 1)
    np.testing.assert_allclose(w.sum(1), 1)
    np.testing.assert_allclose(w @ w, w, atol=1e-12)
    x = np.random.default_rng(3).normal(size=(N, 4))
    np.testing.assert_allclose(w @ x, numpy_p_reduce(x, groups))


def test_spectral_gap_extremes_and_random_pairs():
  assert C.spectral_gap([C.mixing_matrix(LAYOUTS["all"], N)]) == pytest.approx(1.0)
  assert C.spectral_gap([np.eye(N)]) == pytest.approx(0.0)
  # Random division of 16 workers into pairs: E[W] = I/2 + (J - I) / (2 (n - 1)), so
  # lambda_2 = 1/2 - 1/(2 (n - 1)) = 0.4667 exactly (docs/design.md 3.2's Monte Carlo: 0.49).
  n, rng = 16, np.random.default_rng(4)
  ws = [C.mixing_matrix(rng.permutation(n).reshape(-1, 2), n) for _ in range(3000)]
  assert C.mixing_rate(ws) == pytest.approx(0.5 - 1 / (2 * (n - 1)), abs=0.02)


def test_ring_allreduce_cost_model():
  assert C.ring_allreduce_time(1, 1e6, 1e-5, 1e9) == 0.0
  # k=2: 2 alpha + M/B; bandwidth term approaches 2 M / B for large k.
  assert C.ring_allreduce_time(2, 1e6, 1e-5, 1e9) == pytest.approx(2e-5 + 1e-3)
  assert C.ring_allreduce_time(16, 1e6, 0.0, 1e9) == pytest.approx(2 * 15 / 16 * 1e-3)


def test_segment_path_never_recompiles_for_new_layouts(mesh, compile_counter):
  compiles = compile_counter
  x = jnp.ones((N, 16))
  C.p_reduce(x, LAYOUTS["equal"], impl="segment").block_until_ready()
  before = len(compiles)
  for groups in LAYOUTS.values():
    C.p_reduce(x, groups, impl="segment").block_until_ready()
  assert len(compiles) == before


def test_collective_path_compiles_once_per_layout(mesh, compile_counter):
  compiles = compile_counter
  x = jax.device_put(jnp.ones((N, 16)), C.NamedSharding(mesh, C.P(C.WORKER_AXIS)))
  a, b = [[0, 5], [1, 2]], [[3, 4, 6]]
  C.p_reduce(x, a, mesh=mesh).block_until_ready()
  C.p_reduce(x, b, mesh=mesh).block_until_ready()
  seen = len(compiles)
  assert seen >= 2  # each new layout compiled once (the listener works)
  for _ in range(3):
    C.p_reduce(x, a, mesh=mesh).block_until_ready()
    C.p_reduce(x, b, mesh=mesh).block_until_ready()
  assert len(compiles) == seen

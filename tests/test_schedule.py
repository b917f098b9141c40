"""Static schedules: the authors' layout, partitions, mixing over a period."""

import ml_collections
import numpy as np
import pytest

from ripples_jax import algorithms
from ripples_jax import collectives as C
from ripples_jax.schedule.static import allreduce_layouts, hypercube_layouts, static_gg_layouts


def test_static_gg_reproduces_the_authors_4_per_node_layout():
  # Two nodes of 4 (workers 0-3, 4-7). Step 0: GPU 0 of each node across nodes + pair {2,3} per node;
  # steps 1 and 3: each node's 4 GPUs; step 2: GPU 1 across nodes + pair {0,3} per node.
  step0, step1, step2, step3 = static_gg_layouts(8, 4)
  assert step0 == ((0, 4), (1,), (2, 3), (5,), (6, 7))
  assert step1 == step3 == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert step2 == ((0, 3), (1, 5), (2,), (4, 7), (6,))


@pytest.mark.parametrize("n,w", [(8, 4), (16, 4), (12, 3), (10, 4), (8, 2), (8, 1), (6, 8), (9, 5)])
def test_static_gg_layouts_are_partitions_that_mix(n, w):
  layouts = static_gg_layouts(n, w)
  for layout in layouts:
    assert sorted(i for g in layout for i in g) == list(range(n))
    assert max(len(g) for g in layout) <= max(w, -(-n // w))
  # One period's product is connected: repeated periods reach consensus.
  period = np.linalg.multi_dot([np.eye(n)] + [C.mixing_matrix(l, n) for l in layouts])
  lam = np.sort(np.abs(np.linalg.eigvals(period)))[::-1]
  assert lam[0] == pytest.approx(1.0) and lam[1] < 1 - 1e-6


def test_hypercube_reaches_the_exact_average():
  for n, g in [(8, 2), (16, 2), (9, 3)]:
    layouts = hypercube_layouts(n, g)
    assert len(layouts) == round(np.log(n) / np.log(g))
    prod = np.linalg.multi_dot([np.eye(n)] + [C.mixing_matrix(l, n) for l in layouts])
    np.testing.assert_allclose(prod, np.full((n, n), 1 / n), atol=1e-12)
  with pytest.raises(ValueError, match="power of 2"):
    hypercube_layouts(6)


def _config(algorithm, n=8, layout="node"):
  c = ml_collections.ConfigDict()
  c.algorithm, c.num_workers = algorithm, n
  c.schedule = ml_collections.ConfigDict(dict(layout=layout, workers_per_node=4, hypercube_group_size=2))
  return c


def test_make_schedule_rounds_are_periodic_and_deterministic():
  s = algorithms.make_schedule(_config("ripples_static"))
  assert s.layouts == static_gg_layouts(8, 4)
  for t in range(12):
    r = s.round(t)
    assert r.step_mask.all() and r.layout_idx == t % 4
    assert s.groups(t) == s.layouts[t % 4]
  assert algorithms.make_schedule(_config("allreduce")).layouts == allreduce_layouts(8)
  assert algorithms.make_schedule(_config("ripples_static", layout="hypercube")).layouts == hypercube_layouts(
    8
  )
  with pytest.raises(ValueError, match="config.algorithm"):
    algorithms.make_schedule(_config("gossip"))

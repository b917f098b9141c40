"""losses.py against numpy references, and as the one copy of the classification loss in the library."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from ripples_jax import losses

ROOT = pathlib.Path(__file__).resolve().parents[1]


def reference(logits_BxC, labels_B):
  """float64 numpy: mean of log-sum-exp minus the label's logit, and argmax accuracy (first on a tie)."""
  z = logits_BxC.astype(np.float64)
  m = z.max(-1)
  lse_B = m + np.log(np.exp(z - m[:, None]).sum(-1))
  b = np.arange(len(labels_B))
  return float(np.mean(lse_B - z[b, labels_B])), float(np.mean(z.argmax(-1) == labels_B))


def test_cross_entropy_and_accuracy_match_numpy():
  rng = np.random.default_rng(0)
  for B, C, scale in [(1, 2, 1.0), (7, 10, 3.0), (64, 5, 30.0)]:  # large logits: log-sum-exp must be stable
    logits = (rng.standard_normal((B, C)) * scale).astype(np.float32)
    labels = rng.integers(0, C, B).astype(np.int32)
    loss, acc = reference(logits, labels)
    np.testing.assert_allclose(float(losses.cross_entropy(logits, labels)), loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(losses.accuracy(logits, labels)), acc, rtol=1e-6)  # float32 mean


def test_ties_count_the_first_class_and_the_gradient_is_softmax_minus_one_hot():
  logits = np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]], np.float32)
  assert float(losses.accuracy(logits, np.array([0, 2]))) == 0.5  # row 1's argmax is class 1, not 2
  labels = np.array([0, 2])
  g = jax.grad(losses.cross_entropy)(jnp.asarray(logits), labels)
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(g, (p - np.eye(3)[labels]) / 2, rtol=1e-6, atol=1e-7)


def test_no_other_copy_of_the_loss_in_the_library():
  pattern = re.compile(r"softmax_cross_entropy|log_softmax|argmax\([^)]*\)\s*==")
  found = [
    str(p.relative_to(ROOT))
    for d in ("ripples_jax", "benchmarks", "experiments")
    for p in sorted((ROOT / d).rglob("*.py"))
    if p.name != "losses.py" and pattern.search(p.read_text())
  ]
  assert not found, f"call ripples_jax.losses instead: {found}"

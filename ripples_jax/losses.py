"""The classification loss and accuracy: the one definition every executor trains on and reports.

Softmax cross-entropy on integer class labels and argmax accuracy, both means over the batch. A
ground-floor module (jax and optax only). Callers that need another weighting scale the mean (the
tick's chunks: mean / chunks, summed) or weight chunk means by their sizes (engine.make_eval_fn), so
one definition keeps every executor's numbers the same to the bit.
"""

import jax.numpy as jnp
import optax


def cross_entropy(logits_BxC, labels_B):
  """Mean over B of logsumexp(logits) - logits[label]: optax's integer-label softmax cross-entropy, in
  the logits' dtype. Differentiable in the logits."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B).mean()


def accuracy(logits_BxC, labels_B):
  """Fraction of B whose argmax logit (the first on a tie) is its label, a float scalar."""
  return jnp.mean(jnp.argmax(logits_BxC, -1) == labels_B)

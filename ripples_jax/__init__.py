"""ripples_jax: asynchronous decentralized training (Ripples) and stale pipelines (DSP) in JAX.

The public API (imported lazily, so `import ripples_jax` stays cheap):

  train_and_evaluate(config, workdir)  a Ripples run (executor spmd | sim | async); returns the summary
  load(workdir, step=None)             the trained model back: per-worker and averaged params, config
  p_reduce(x_WxD, groups, mesh=None)   Partial All-Reduce: each group's members get their group's mean
  mixing_matrix(groups, n)             the doubly stochastic W of one round of group averages
  spectral_gap(matrices)               1 - lambda_2(E[W^T W]): how fast a schedule mixes
  random_gg / division_gg / smart_gg   the Group Generators (host-side, deterministic under a seed)
  Service                              the online Group Generator protocol (simulator and runtime)
  make_group_generator(config, rng)    the generator a config names
  simulate(ClockSpec(algorithm, ...))  the discrete-event clock alone (ripples_jax.timeline)
  simulate_and_train(config, workdir)  the simulator executor: the clock, then exact numerics

Everything else is importable from its module (README.md's Layout section).
"""

import importlib

__version__ = "0.1.0"  # pyproject.toml's version (tests/test_packaging.py checks they agree)

_EXPORTS = {
  "train_and_evaluate": "ripples_jax.run",
  "load": "ripples_jax.run",
  "p_reduce": "ripples_jax.collectives",
  "mixing_matrix": "ripples_jax.collectives",
  "spectral_gap": "ripples_jax.collectives",
  "Service": "ripples_jax.schedule.online",
  "random_gg": "ripples_jax.schedule.group_gen",
  "division_gg": "ripples_jax.schedule.group_gen",
  "smart_gg": "ripples_jax.schedule.group_gen",
  "make_group_generator": "ripples_jax.algorithms",
  "simulate": "ripples_jax.timeline",
  "ClockSpec": "ripples_jax.timeline",
  "simulate_and_train": "ripples_jax.sim",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'ripples_jax' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + __all__)

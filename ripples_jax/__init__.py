"""ripples_jax: asynchronous decentralized training (Ripples) and stale pipelines (DSP) in JAX."""

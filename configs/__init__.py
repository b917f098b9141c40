"""ml_collections config files (get_config(arg)); shipped in the package as ripples_jax.configs."""

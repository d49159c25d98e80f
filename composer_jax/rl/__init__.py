"""composer_jax.rl."""

"""composer_jax.parallel."""

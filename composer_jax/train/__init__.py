"""composer_jax.train."""

"""composer_jax.eval."""

"""composer_jax.data."""

"""composer_jax.env."""

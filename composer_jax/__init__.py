"""composer_jax: a Kimi-K2-family MoE + MLA model and its training recipe in JAX / Flax NNX."""

__version__ = "0.1.0"

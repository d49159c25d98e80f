"""The Kimi-K2-family model: MLA attention, DeepSeek-style MoE, MTP, latent decode cache."""

from composer_jax.model.build import (
                                      abstract_model,
                                      build_model,
                                      count_params,
                                      flops_per_token,
                                      model_config,
)
from composer_jax.model.cache import Cache, init_cache
from composer_jax.model.loss import lm_loss
from composer_jax.model.transformer import ModelOutput, Transformer

__all__ = [
                                      "Cache",
                                      "ModelOutput",
                                      "Transformer",
                                      "abstract_model",
                                      "build_model",
                                      "count_params",
                                      "flops_per_token",
                                      "init_cache",
                                      "lm_loss",
                                      "model_config",
]

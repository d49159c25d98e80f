"""Decoding cache: only the MLA latent and the shared RoPE key, per layer.

Per token per layer this is kv_lora_rank + qk_rope_dim numbers (576 for Kimi K2), against
n_heads * (qk_head_dim + v_head_dim) if keys and values were expanded per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from composer_jax.config import ModelConfig
from composer_jax.model.layers import dtype_of


@struct.dataclass
class LayerCache:
  c: jax.Array  # [b, T, kv_lora_rank] normalised latent
  k_pe: jax.Array  # [b, T, qk_rope_dim] rotated shared key
  index: jax.Array  # [b] tokens written so far

  def write(self, c_new: jax.Array, kpe_new: jax.Array) -> "LayerCache":
    s = c_new.shape[1]
    upd = jax.vmap(lambda buf, new, i: jax.lax.dynamic_update_slice_in_dim(buf, new, i, axis=0))
    return LayerCache(c=upd(self.c, c_new.astype(self.c.dtype), self.index),
                      k_pe=upd(self.k_pe, kpe_new.astype(self.k_pe.dtype), self.index),
                      index=self.index + s)


@struct.dataclass
class Cache:
  layers: tuple  # one LayerCache per transformer layer (MTP depths are not cached)

  @property
  def index(self) -> jax.Array:
    return self.layers[0].index


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
  dtype = dtype or dtype_of(cfg.compute_dtype)
  def one():
    return LayerCache(c=jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                      k_pe=jnp.zeros((batch, max_len, cfg.qk_rope_dim), dtype),
                      index=jnp.zeros((batch,), jnp.int32))
  return Cache(layers=tuple(one() for _ in range(cfg.n_layers)))


def cache_elements_per_token_per_layer(cfg: ModelConfig) -> int:
  return cfg.kv_lora_rank + cfg.qk_rope_dim


def expanded_kv_elements_per_token_per_layer(cfg: ModelConfig) -> int:
  return cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)

"""Decoding cache: only the MLA latent and the shared RoPE key, per layer.

Per token per layer this is kv_lora_rank + qk_rope_dim numbers (576 for Kimi K2), against
n_heads * (qk_head_dim + v_head_dim) if keys and values were expanded per head.

Rows advance independently (ragged batches): ``index[b]`` is how many tokens row b holds. A call feeds
tokens [b, s] whose valid tokens are a *prefix* of each row (right padding), marked by a segment-id
row that is non-zero on valid tokens; row b writes its ``n_new[b]`` valid tokens at positions
index[b] .. index[b] + n_new[b] - 1 and advances by n_new[b]. Padding tokens are never written
(scatter with out-of-bounds positions dropped), so a row may be fed 0 tokens while others prefill.

``view`` (static) bounds what attention reads: the first ``view`` slots of the buffer, a bucket
>= the longest filled row, so a decode step costs the filled length, not ``max_len``.

With ``model.scan_layers`` the MoE layers' caches are ONE stacked entry (buffers [n_moe, b, T, .],
one shared ``index`` [b]) after the dense lead layers' entries: the scanned decode carries the whole
stack and each layer writes and reads its slice in place (``layer`` set inside the scan), so a step
still costs the view, not a copy of the stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from composer_jax.config import ModelConfig
from composer_jax.model.layers import dtype_of

MIN_BUCKET = 16


@struct.dataclass
class LayerCache:
  c: jax.Array  # [b, T, kv_lora_rank] normalised latent ([L, b, T, r] when stacked)
  k_pe: jax.Array  # [b, T, qk_rope_dim] rotated shared key ([L, b, T, rope] when stacked)
  index: jax.Array  # [b] tokens written so far
  view: int = struct.field(pytree_node=False, default=0)  # slots attention reads (0 = all T)
  layer: jax.Array | None = None  # stacked buffers: the layer this view writes and reads (scan)

  @property
  def max_len(self) -> int:
    return self.c.shape[-2]

  def read(self) -> tuple[jax.Array, jax.Array]:
    """(latent [b, view, r], rope key [b, view, rope]) of this layer: the slots attention reads."""
    view = self.view or self.max_len
    if self.layer is None:
      return self.c[:, :view], self.k_pe[:, :view]
    # one dynamic slice of the view, never the layer's whole buffer
    sl = lambda a: jax.lax.dynamic_slice(a, (self.layer, 0, 0, 0), (1, a.shape[1], view, a.shape[3]))[0]
    return sl(self.c), sl(self.k_pe)

  def write(self, c_new: jax.Array, kpe_new: jax.Array, n_new: jax.Array | None = None) -> LayerCache:
    """Write the first ``n_new[b]`` of the s new entries of each row at ``index[b]`` (all s if None).

    Entries that would land past the buffer are dropped, never clamped onto earlier tokens; callers
    refuse an overflow beforehand with ``check_room`` (inside jit it cannot raise).
    """
    b, s = c_new.shape[:2]
    n_new = jnp.full((b,), s, jnp.int32) if n_new is None else n_new.astype(jnp.int32)
    j = jnp.arange(s, dtype=jnp.int32)[None]
    pos = jnp.where(j < n_new[:, None], self.index[:, None] + j, self.max_len)  # T = dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
    at = (rows, pos) if self.layer is None else (self.layer, rows, pos)
    c = self.c.at[at].set(c_new.astype(self.c.dtype), mode="drop")
    k_pe = self.k_pe.at[at].set(kpe_new.astype(self.k_pe.dtype), mode="drop")
    return self.replace(c=c, k_pe=k_pe, index=self.index + n_new)


@struct.dataclass
class Cache:
  # one LayerCache per transformer layer (MTP depths are not cached); with model.scan_layers one per
  # dense lead layer, then one stacked LayerCache for all MoE layers
  layers: tuple

  @property
  def index(self) -> jax.Array:
    return self.layers[0].index

  @property
  def max_len(self) -> int:
    return self.layers[0].max_len

  def with_index(self, index) -> Cache:
    """The same buffers with every layer's row lengths set to ``index`` [b] (host-tracked lengths).
    One array per layer, so the cache can be donated to a jitted call (no buffer donated twice)."""
    return Cache(tuple(lc.replace(index=jnp.array(index, jnp.int32)) for lc in self.layers))

  def with_view(self, view: int) -> Cache:
    """Attention reads only the first ``view`` slots (static: one trace per view)."""
    if not 0 <= view <= self.max_len:
      raise ValueError(f"cache view {view} outside [0, {self.max_len}]")
    return Cache(tuple(lc.replace(view=int(view)) for lc in self.layers))


def init_layer_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, stack: tuple = ()) -> LayerCache:
  """One attention layer's empty cache (``stack``: leading layer axes of a stacked entry). An MTP
  depth drafting tokens (rl.speculative_mtp) keeps one of these beside the model's Cache."""
  dtype = dtype or dtype_of(cfg.compute_dtype)
  return LayerCache(c=jnp.zeros((*stack, batch, max_len, cfg.kv_lora_rank), dtype),
                    k_pe=jnp.zeros((*stack, batch, max_len, cfg.qk_rope_dim), dtype),
                    index=jnp.zeros((batch,), jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
  one = lambda *stack: init_layer_cache(cfg, batch, max_len, dtype, stack)
  if cfg.scan_layers:
    return Cache(layers=tuple(one() for _ in range(cfg.n_dense_layers)) + (one(cfg.n_moe_layers),))
  return Cache(layers=tuple(one() for _ in range(cfg.n_layers)))


def bucket(n: int, cap: int, minimum: int = MIN_BUCKET) -> int:
  """The next power of two >= n (at least ``minimum``), capped at ``cap``: few static shapes."""
  b = minimum
  while b < n:
    b *= 2
  return min(b, cap)


def check_room(index, n_new, max_len: int) -> None:
  """Refuse, in one line, a write past the cache (host-side: inside jit it would be dropped)."""
  index, n_new = np.asarray(index), np.asarray(n_new)
  end = index + n_new
  if np.any(end > max_len):
    row = int(np.argmax(end > max_len))
    raise ValueError(f"decode cache overflow: row {row} holds {int(index[row])} tokens + "
                     f"{int(n_new[row])} new > max_len {max_len}; start a new cache or raise max_len")


def cache_elements_per_token_per_layer(cfg: ModelConfig) -> int:
  return cfg.kv_lora_rank + cfg.qk_rope_dim


def expanded_kv_elements_per_token_per_layer(cfg: ModelConfig) -> int:
  return cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)

"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

Keys and values are compressed into a ``kv_lora_rank`` latent plus one shared RoPE key of
``qk_rope_dim``; only those (576 numbers per token per layer for K2) need caching. Training expands
the latent into per-head keys and values; decoding uses the *absorbed* form — the key up-projection
is folded into the query and the value up-projection into the output — and attends over the latent
directly.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.attention import (
  NEG_INF,
  attention,
  attention_mask,
  blockwise_core,
  masked_softmax,
)
from composer_jax.model.layers import KeySeq, Linear, RMSNorm, apply_rope, softmax_scale
from composer_jax.parallel.context import context_attention
from composer_jax.parallel.rules import active, constrain

# The mask and masked softmax live with the training attention; decoding (absorbed) uses them too.
__all__ = ["MLA", "NEG_INF", "attention_mask", "masked_softmax"]


class MLA(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: KeySeq):
    self.cfg = cfg
    d, h = cfg.d_model, cfg.n_heads
    if cfg.q_lora_rank:
      self.q_a = Linear(d, (cfg.q_lora_rank,), ("embed", "q_lora"), cfg, rngs)
      self.q_norm = RMSNorm(cfg.q_lora_rank, cfg)
      self.q_b = Linear(cfg.q_lora_rank, (h, cfg.qk_head_dim), ("q_lora_up", "heads", "head_dim"),
                        cfg, rngs)
    else:
      self.q_proj = Linear(d, (h, cfg.qk_head_dim), ("embed", "heads", "head_dim"), cfg, rngs)
    self.kv_a = Linear(d, (cfg.kv_lora_rank + cfg.qk_rope_dim,), ("embed", "kv_lora"), cfg, rngs)
    self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg)
    self.kv_b = Linear(cfg.kv_lora_rank, (h, cfg.qk_nope_dim + cfg.v_head_dim),
                       ("kv_lora_up", "heads", "head_dim"), cfg, rngs)
    self.o_proj = Linear(h * cfg.v_head_dim, (d,), ("heads", "embed"), cfg, rngs)
    self.scale = softmax_scale(cfg)
    # Off by default; the train step turns it on with model.set_attributes(record_max_logit=True)
    # and reads the values with nnx.pop(model, nnx.Intermediate).
    self.record_max_logit = False

  def _query(self, x, cos, sin):
    cfg = self.cfg
    q = self.q_b(self.q_norm(self.q_a(x))) if cfg.q_lora_rank else self.q_proj(x)
    q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
    q_nope, q_pe = q[..., : cfg.qk_nope_dim], q[..., cfg.qk_nope_dim:]
    return q_nope, apply_rope(q_pe, cos, sin)

  def _latent(self, x, cos, sin):
    cfg = self.cfg
    kv = self.kv_a(x)
    c, k_pe = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank:]
    return self.kv_norm(c), apply_rope(k_pe, cos, sin)

  def _out(self, o):
    b, s = o.shape[:2]
    o = constrain(o, ("act_batch", "act_seq", "act_heads", None))
    return self.o_proj(o.reshape(b, s, -1))

  def __call__(self, x, cos, sin, seg=None, cache=None):
    """x [b,s,d]; cos/sin [b,s,rope/2]; seg [b,s] or None.

    With ``cache`` (a ``LayerCache``), runs the absorbed path over the cached latent and returns
    (out, new_cache); otherwise the expanded training path and (out, None).
    """
    if cache is not None:
      return self.absorbed(x, cos, sin, cache, seg)
    cfg = self.cfg
    q_nope, q_pe = self._query(x, cos, sin)
    c, k_pe = self._latent(x, cos, sin)
    mesh, _ = active()
    if mesh is not None and mesh.shape.get("context", 1) > 1:  # sequence sharded: balanced CP
      # gathers the latent (kv_lora_rank + rope per token), expands K/V on each device and attends
      # block by block (O(s) memory per device; dense = the per-pair reference)
      w = self.kv_b.w[...].astype(self.kv_b.compute_dtype)
      core = (None if cfg.attention_impl == "dense"
              else functools.partial(blockwise_core, rows=cfg.attention_rows))
      o, top = context_attention(q_nope, q_pe, c.astype(w.dtype), k_pe, w, seg, self.scale,
                                 local=self._attend, with_max_logit=True, core=core,
                                 block=cfg.attention_block)
    else:
      kv = self.kv_b(c)  # [b, s, h, nope + v]
      k_nope, v = kv[..., : cfg.qk_nope_dim], kv[..., cfg.qk_nope_dim:]
      o, top = self._attend(q_nope, q_pe, k_nope, k_pe, v, seg)
    if self.record_max_logit:  # per-head max attention logit for QK-clip (MuonClip)
      self.sow(nnx.Intermediate, "max_logit", top)
    return self._out(o), None

  def _attend(self, q_nope, q_pe, k_nope, k_pe, v, seg):
    """(o, per-head max logit or None): causal segment attention over the concatenated nope | rope
    dims (the shared rope key broadcast to every head), one q.k product as the dense path took."""
    cfg = self.cfg
    q = jnp.concatenate([q_nope, q_pe], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None], k_nope.shape[:3] + k_pe.shape[-1:])],
                        axis=-1)
    return attention(q, k, v, seg, scale=self.scale, impl=cfg.attention_impl,
                     block=cfg.attention_block, with_max_logit=self.record_max_logit,
                     rows=cfg.attention_rows)

  def absorbed(self, x, cos, sin, cache, seg=None):
    """Decode/prefill: attend over the cached latent with the up-projections absorbed.

    ``seg`` [b, s] (non-zero = valid; valid tokens first in each row) gives each row's count of new
    tokens (a ragged batch); None = all s. Attention reads the first ``cache.view`` slots.
    """
    cfg = self.cfg
    b, s, _ = x.shape
    q_nope, q_pe = self._query(x, cos, sin)
    c, k_pe = self._latent(x, cos, sin)
    start = cache.index
    n_new = None if seg is None else jnp.sum(seg != 0, axis=1).astype(jnp.int32)
    cache = cache.write(c, k_pe, n_new)
    view = cache.view or cache.max_len
    w = self.kv_b.w[...].astype(q_nope.dtype)  # [r, h, nope + v]
    w_k, w_v = w[..., : cfg.qk_nope_dim], w[..., cfg.qk_nope_dim:]
    q_lat = jnp.einsum("bqhd,rhd->bqhr", q_nope, w_k)  # query in latent space
    ckv, kpe = cache.read()
    ckv, kpe = ckv.astype(q_lat.dtype), kpe.astype(q_pe.dtype)
    scores = (jnp.einsum("bqhr,bkr->bhqk", q_lat, ckv, preferred_element_type=jnp.float32)
              + jnp.einsum("bqhd,bkd->bhqk", q_pe, kpe, preferred_element_type=jnp.float32))
    q_idx = start[:, None] + jnp.arange(s)[None]  # positions of the new tokens
    k_idx = jnp.broadcast_to(jnp.arange(view)[None], (b, view))
    mask = attention_mask(q_idx, k_idx, k_valid=k_idx < cache.index[:, None])
    probs = masked_softmax(scores * self.scale, mask).astype(ckv.dtype)
    # [b, h, q, r], then the transpose: on XLA:CPU the product straight into [b, q, h, r] ran 4-5x
    # slower (a 16-row decode over a 1024 view: 2.0 ms against 0.39 ms a layer)
    o_lat = jnp.einsum("bhqk,bkr->bhqr", probs, ckv).transpose(0, 2, 1, 3)
    o = jnp.einsum("bqhr,rhd->bqhd", o_lat, w_v)
    return self._out(o), cache

"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

Keys and values are compressed into a ``kv_lora_rank`` latent plus one shared RoPE key of
``qk_rope_dim``; only those (576 numbers per token per layer for K2) need caching. Training expands
the latent into per-head keys and values; decoding uses the *absorbed* form — the key up-projection
is folded into the query and the value up-projection into the output — and attends over the latent
directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.layers import KeySeq, Linear, RMSNorm, apply_rope, softmax_scale
from composer_jax.parallel.rules import active, constrain

NEG_INF = -1e30


def attention_mask(q_pos_idx, k_pos_idx, q_seg=None, k_seg=None, k_valid=None):
  """Boolean [b, 1, sq, sk]: causal by index, same segment, and (decoding) key slot written."""
  mask = q_pos_idx[:, :, None] >= k_pos_idx[:, None, :]
  if q_seg is not None:
    mask &= q_seg[:, :, None] == k_seg[:, None, :]
  if k_valid is not None:
    mask &= k_valid[:, None, :]
  return mask[:, None]


@jax.custom_vjp
def masked_softmax(scores, mask):
  """Softmax over the keys ``mask`` allows; rows with no valid key (padding) give zeros, not NaN.

  A custom VJP because the [b, h, q, k] tensor is the largest of the attention: the forward is one
  max and one exp/sum pass, the backward ``p * (g - sum(g * p))`` (masked entries have p = 0), with
  no select / softmax / select chain to transpose.
  """
  return _masked_softmax_fwd(scores, mask)[0]


def _masked_softmax_fwd(scores, mask):
  top = jnp.max(jnp.where(mask, scores, NEG_INF), axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(scores - top), 0.0)
  probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(e.dtype).tiny)
  return probs, probs


def _masked_softmax_bwd(probs, g):
  return probs * (g - jnp.sum(g * probs, axis=-1, keepdims=True)), None


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


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
    b, s, _ = x.shape
    q_nope, q_pe = self._query(x, cos, sin)
    c, k_pe = self._latent(x, cos, sin)
    kv = self.kv_b(c)  # [b, s, h, nope + v]
    k_nope, v = kv[..., : cfg.qk_nope_dim], kv[..., cfg.qk_nope_dim:]
    mesh, _ = active()
    if mesh is not None and mesh.shape.get("context", 1) > 1:  # sequence sharded: balanced CP
      from composer_jax.parallel.context import context_attention
      o = context_attention(q_nope, q_pe, k_nope, k_pe, v, seg, self.scale)
      return self._out(o), None
    # One [b,h,q,k] product over the concatenated nope | rope dims (the shared rope key broadcast
    # to every head), with the softmax scale folded into q: a separate head-less rope einsum made
    # XLA:CPU transpose the whole score tensor forward and backward, the dominant attention cost.
    q = jnp.concatenate([q_nope, q_pe], axis=-1) * jnp.asarray(self.scale, q_nope.dtype)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None], k_nope.shape[:3] + k_pe.shape[-1:])],
                        axis=-1)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    idx = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    mask = attention_mask(idx, idx, seg, seg)
    if self.record_max_logit:  # per-head max attention logit for QK-clip (MuonClip)
      self.sow(nnx.Intermediate, "max_logit", jnp.max(jnp.where(mask, scores, NEG_INF), axis=(0, 2, 3)))
    probs = masked_softmax(scores, mask).astype(v.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return self._out(o), None

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
    ckv, kpe = cache.c[:, :view].astype(q_lat.dtype), cache.k_pe[:, :view].astype(q_pe.dtype)
    scores = (jnp.einsum("bqhr,bkr->bhqk", q_lat, ckv, preferred_element_type=jnp.float32)
              + jnp.einsum("bqhd,bkd->bhqk", q_pe, kpe, preferred_element_type=jnp.float32))
    q_idx = start[:, None] + jnp.arange(s)[None]  # positions of the new tokens
    k_idx = jnp.broadcast_to(jnp.arange(view)[None], (b, view))
    mask = attention_mask(q_idx, k_idx, k_valid=k_idx < cache.index[:, None])
    probs = masked_softmax(scores * self.scale, mask).astype(ckv.dtype)
    o_lat = jnp.einsum("bhqk,bkr->bqhr", probs, ckv)
    o = jnp.einsum("bqhr,rhd->bqhd", o_lat, w_v)
    return self._out(o), cache

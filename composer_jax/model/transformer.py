"""The decoder: embedding, dense-then-MoE blocks, final norm, head, optional MTP depths.

With ``model.scan_layers`` the MoE blocks are one stacked module (``moe_layers``, see
``model/scan.py``) run by a scan; ``layers`` then holds only the dense lead blocks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from composer_jax.config import ModelConfig
from composer_jax.model.cache import Cache, LayerCache, check_room
from composer_jax.model.layers import (
  MLP,
  KeySeq,
  Linear,
  RMSNorm,
  dtype_of,
  param,
  rope_cos_sin,
)
from composer_jax.model.mla import MLA
from composer_jax.model.moe import MoE, MoEStats
from composer_jax.model.scan import STACK, remat_block, scan_blocks, stack_modules
from composer_jax.parallel.rules import constrain

REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@struct.dataclass
class ModelOutput:
  logits: jax.Array  # [b, s, vocab]
  mtp_logits: tuple = ()  # per MTP depth k (1-based): [b, s, vocab], position t predicts t+1+k
  router_loads: jax.Array | None = None  # [n_moe_blocks, E] (main stack, then MTP blocks)
  aux_loss: jax.Array | None = None  # scalar, summed over MoE blocks
  routed_experts: jax.Array | None = None  # [n_moe_layers, b, s, k] when return_routing=True
  live_routing: jax.Array | None = None  # [n_moe_layers, b, s, k] the router's own choice (replay)
  cache: Any = None  # updated Cache when decoding
  hidden: jax.Array | None = None  # final hidden state before the output norm


def _stack_stats(stats: list[MoEStats]) -> MoEStats | None:
  """Per-layer MoEStats -> one MoEStats with every field stacked on a leading layer axis."""
  return jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, moe: bool, rngs: KeySeq):
    self.cfg = cfg
    self.attn_norm = RMSNorm(cfg.d_model, cfg)
    self.attn = MLA(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg)
    self.is_moe = moe
    self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, cfg.dense_ffn_dim, rngs)

  def __call__(self, x, cos, sin, seg=None, cache=None, replay_ids=None):
    a, cache = self.attn(self.attn_norm(x), cos, sin, seg, cache)
    h = constrain(x + a, ("act_batch", "act_seq", "act_embed"))
    stats = None
    if self.is_moe:
      valid = None if seg is None else seg != 0
      m, stats = self.mlp(self.mlp_norm(h), replay_ids, valid, decode=cache is not None)
    else:
      m = self.mlp(self.mlp_norm(h))
    return constrain(h + m, ("act_batch", "act_seq", "act_embed")), cache, stats


class MTPDepth(nnx.Module):
  """DeepSeek-V3 multi-token prediction: proj([norm(emb(t+k)), norm(h)]) -> block -> shared head."""

  def __init__(self, cfg: ModelConfig, rngs: KeySeq):
    self.enorm = RMSNorm(cfg.d_model, cfg)
    self.hnorm = RMSNorm(cfg.d_model, cfg)
    self.proj = Linear(2 * cfg.d_model, (cfg.d_model,), ("embed_in", "embed"), cfg, rngs)
    self.block = Block(cfg, moe=cfg.n_moe_layers > 0, rngs=rngs)
    self.norm = RMSNorm(cfg.d_model, cfg)

  def __call__(self, h, emb_ahead, cos, sin, seg, cache=None):
    """Training (``cache`` None): (hidden, router stats). Decoding over this depth's own latent cache
    (speculative drafts, composer_jax.rl.engine): (hidden, new cache)."""
    x = self.proj(jnp.concatenate([self.enorm(emb_ahead), self.hnorm(h)], axis=-1))
    x, cache_out, stats = self.block(x, cos, sin, seg, cache)
    return (x, stats) if cache is None else (x, cache_out)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | KeySeq):
    self.cfg = cfg
    if isinstance(rngs, nnx.Rngs):
      rngs = KeySeq(rngs.params())
    pd = dtype_of(cfg.param_dtype)
    self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pd, std=cfg.init_std)
    n_loop = cfg.n_dense_layers if cfg.scan_layers else cfg.n_layers
    self.layers = nnx.List([Block(cfg, moe=i >= cfg.n_dense_layers, rngs=rngs)
                            for i in range(n_loop)])
    if cfg.scan_layers:
      setattr(self, STACK, stack_modules(lambda r: Block(cfg, moe=True, rngs=r), cfg.n_moe_layers,
                                         rngs()))
    self.norm = RMSNorm(cfg.d_model, cfg)
    if not cfg.tie_embeddings:
      self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pd, std=cfg.init_std)
    self.mtp = nnx.List([MTPDepth(cfg, rngs) for _ in range(cfg.mtp_depths)])

  # -- pieces -------------------------------------------------------------------------------------

  def embed_tokens(self, tokens):
    # The table whole along d (FSDP's all-gather of a weight) before the lookup: gathering rows of a
    # d-sharded table gave rows sharded on d, which XLA then moved to batch-sharded by all-gathering
    # the whole global batch's embeddings onto every device.
    table = constrain(self.embed[...], ("vocab", None))
    x = jnp.take(table, tokens, axis=0).astype(dtype_of(self.cfg.compute_dtype))
    return constrain(x, ("act_batch", "act_seq", "act_embed"))

  def logits(self, h):
    w = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
    out = jnp.einsum("bsd,dv->bsv", h, w.astype(h.dtype))
    return constrain(out, ("act_batch", "act_seq", "act_vocab"))

  def block_groups(self) -> list[tuple[Block, int]]:
    """Every block in forward order (main stack, then MTP depths) as (block, rows): rows = 0 for
    a module of one layer, n for the stacked module of n layers (variables [n, ...])."""
    groups = [(b, 0) for b in self.layers]
    if self.cfg.scan_layers:
      groups.append((getattr(self, STACK), self.cfg.n_moe_layers))
    return groups + [(d.block, 0) for d in self.mtp]

  def moe_modules(self) -> list[MoE]:
    """The MoE modules in forward order; under scan_layers one of them is the stack (its router
    bias [n_moe_layers, E]): ``moe_groups`` gives the row counts."""
    return [m for m, _ in self.moe_groups()]

  def moe_groups(self) -> list[tuple[MoE, int]]:
    return [(b.mlp, n) for b, n in self.block_groups() if b.is_moe]

  def attention_groups(self) -> list[tuple[MLA, int]]:
    return [(b.attn, n) for b, n in self.block_groups()]

  def _run_block(self, block, x, cos, sin, seg, cache, replay):
    if self.cfg.remat == "none" or cache is not None:
      return block(x, cos, sin, seg, cache, replay)
    if self.cfg.remat == "moe_only" and not block.is_moe:
      return block(x, cos, sin, seg, cache, replay)
    return remat_block(block, REMAT_POLICIES.get(self.cfg.remat), x, cos, sin, seg, replay)

  def mtp_draft_logits(self, hidden, ahead_tokens, positions, segment_ids, cache: LayerCache, at):
    """The first MTP depth run over its own latent cache (speculative drafting): logits [b, V] at
    position ``at`` [b] for the token after ``ahead_tokens`` there, and the depth's new cache.

    ``hidden`` [b, s, d] is the main stack's output for the fed tokens and ``ahead_tokens`` [b, s]
    the token after each (position t pairs h_t with token t+1, as in training); ``segment_ids``
    mark the positions whose pairs are known (a prefix per row), which are the ones written.
    """
    cos, sin = rope_cos_sin(positions, self.cfg)
    depth = self.mtp[0]
    h, cache = depth(hidden, self.embed_tokens(ahead_tokens), cos, sin, segment_ids, cache)
    h = jnp.take_along_axis(h, jnp.asarray(at, jnp.int32)[:, None, None], axis=1)
    return self.logits(depth.norm(h))[:, 0], cache

  # -- forward ------------------------------------------------------------------------------------

  def __call__(self, tokens, segment_ids=None, positions=None, *, cache: Cache | None = None,
               routed_experts=None, return_routing: bool = False, return_hidden: bool = False,
               mtp: bool = True, logit_positions=None, return_live_routing: bool = False) -> ModelOutput:
    """tokens [b,s] int32. ``segment_ids`` (0 = padding) separate packed documents.

    ``routed_experts`` [n_moe_layers, b, s, k] replays recorded router choices (RL); with
    ``return_routing`` the choices made are returned in the same layout. ``cache`` switches to the
    absorbed decoding path and returns the updated cache; there ``segment_ids`` (non-zero = valid,
    valid tokens first) give each row's count of new tokens, so rows of different lengths share a
    batch (see composer_jax.model.cache). ``logit_positions`` [b] computes the head only at one
    position per row (logits [b, 1, vocab]): a prefill needs the last valid token's, not all s.
    """
    cfg = self.cfg
    b, s = tokens.shape
    if cache is not None and not any(isinstance(a, jax.core.Tracer) for a in (cache.index, segment_ids)):
      n_new = s if segment_ids is None else jnp.sum(jnp.asarray(segment_ids) != 0, axis=1)
      check_room(cache.index, n_new, cache.max_len)  # refused here: inside jit it would be dropped
    if positions is None:
      start = cache.index[:, None] if cache is not None else jnp.zeros((b, 1), jnp.int32)
      positions = start + jnp.arange(s, dtype=jnp.int32)[None]
    cos, sin = rope_cos_sin(positions, cfg)
    x = self.embed_tokens(tokens)
    n_loop = len(self.layers)
    if cache is not None and len(cache.layers) != n_loop + cfg.scan_layers:
      raise ValueError(f"the cache has {len(cache.layers)} layer entries, this model (model.scan_layers="
                       f"{str(cfg.scan_layers).lower()}) needs {n_loop + cfg.scan_layers}: build it "
                       "with init_cache(model.cfg, ...)")
    new_layers, stats, moe_i = [], [], 0
    for i, block in enumerate(self.layers):
      layer_cache = cache.layers[i] if cache is not None else None
      replay = None
      if block.is_moe and routed_experts is not None:
        replay = routed_experts[moe_i]
      x, layer_cache, st = self._run_block(block, x, cos, sin, segment_ids, layer_cache, replay)
      new_layers.append(layer_cache)
      if st is not None:
        stats.append(st)
        moe_i += 1
    main = _stack_stats(stats)  # [n_moe_layers, ...] per field
    if cfg.scan_layers:  # the loop above ran only the dense lead layers
      x, main, stack_cache, top = scan_blocks(
          getattr(self, STACK), cfg.n_moe_layers, x, cos, sin, segment_ids,
          cache=cache.layers[n_loop] if cache is not None else None, replay=routed_experts,
          remat=cfg.remat != "none", policy=REMAT_POLICIES.get(cfg.remat))
      new_layers.append(stack_cache)
      if top is not None:  # where pop_max_logits finds it: [n_moe_layers, heads]
        getattr(self, STACK).attn.sow(nnx.Intermediate, "max_logit", top)
    hidden = x
    if logit_positions is not None:  # [b] -> logits [b, 1, V]; [b, m] -> [b, m, V]
      lp = jnp.asarray(logit_positions, jnp.int32)
      x = jnp.take_along_axis(x, lp[:, None, None] if lp.ndim == 1 else lp[:, :, None], axis=1)
    logits = self.logits(self.norm(x))
    mtp_logits, h, mtp_stats = [], hidden, []
    if mtp and cache is None:
      for k, depth in enumerate(self.mtp, start=1):
        ahead = jnp.pad(tokens[:, k:], ((0, 0), (0, k)))
        h, st = depth(h, self.embed_tokens(ahead), cos, sin, segment_ids)
        mtp_logits.append(self.logits(depth.norm(h)))
        if st is not None:
          mtp_stats.append(st)
    loads = [main.load] if main is not None else []
    loads = jnp.concatenate(loads + [st.load[None] for st in mtp_stats]) if loads or mtp_stats else None
    aux = sum((st.aux_loss for st in mtp_stats),
              jnp.zeros((), jnp.float32) + (main.aux_loss.sum() if main is not None else 0.0))
    routing = main.expert_ids if return_routing and main is not None else None
    live = None
    if return_live_routing and main is not None:
      live = main.expert_ids if main.live_ids is None else main.live_ids
    return ModelOutput(logits=logits, mtp_logits=tuple(mtp_logits), router_loads=loads,
                       aux_loss=aux, routed_experts=routing, live_routing=live,
                       cache=Cache(tuple(new_layers)) if cache is not None else None,
                       hidden=hidden if return_hidden else None)

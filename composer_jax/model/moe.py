"""Mixture-of-experts layer: router, dropless routed experts, shared experts.

Dispatch is dropless: the (token, slot) pairs are sorted by expert and fed to one grouped matmul per
projection (``composer_jax.kernels.gmm``), so no capacity factor exists and nothing is ever dropped,
however skewed the routing. The dispatch itself (``dropless_moe``, and on a mesh with an expert
axis the same bookkeeping with an all-to-all or all-gather exchange around it) lives in
``composer_jax.parallel.experts``, which imports nothing from the model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.layers import MLP, KeySeq, dtype_of, param
from composer_jax.model.routing import (
  expert_load,
  route,
  select_experts,
  sequence_aux_loss,
)
from composer_jax.parallel.experts import dropless_moe, expert_parallel_moe
from composer_jax.parallel.rules import active, constrain

__all__ = ["MoE", "MoEStats", "RouterBias", "decode_layout", "dropless_moe", "moe_dispatch",
           "per_pair_moe"]


class RouterBias(nnx.Variable):
  """Selection bias of the aux-loss-free balancing rule: state, but not a gradient-trained Param."""


class MoEStats(NamedTuple):
  expert_ids: jax.Array  # [b, s, k] int32 — what the router chose (or was told to use)
  load: jax.Array  # [E] fraction of assignments per expert
  aux_loss: jax.Array  # scalar
  live_ids: jax.Array | None = None  # [b, s, k] the router's own choice when ids were replayed


# Decode dispatch. The training block layout pads every expert's group to whole blocks (~ceil(m/bm)
# + E blocks: 2,000+ rows on GPU for one decode step of 8 tokens, ~50,000 for K2's 384 experts).
# Up to PER_PAIR_MAX (token, slot) pairs instead loop over the pairs, each multiplied by its own
# expert's matrices (a dynamic index, no copy of every pair's weights: gathering them all up front
# materialised pairs x 3 x d x f numbers and measured 2-4x slower on CPU; the loop measured level
# with the CPU sorted layout, itself 16-row blocks, on the bench model's decode). Past that, decode
# keeps the grouped matmul, with DECODE_BLOCK_ROWS-row blocks while the groups average a few rows
# (E x 16 padding rows instead of E x 128 on the TPU kernel). Prefill and training keep the
# default. On GPU decode keeps the training layout too: on an H100 (bench.yaml, 16 rows, float32)
# the 16-row blocks ran at 0.65x the default ones (experiments/results/rl_decode_gpu.json), where
# on 2 CPU cores the decode layout and the cache view together were 2.9x.
PER_PAIR_MAX = 64
DECODE_BLOCK_ROWS = 16


def decode_layout(pairs: int, n_experts: int, precision: str, backend: str) -> str | int | None:
  """How a decode step's routed experts run: "per_pair", or the grouped matmul's block rows
  (None = the training default)."""
  if precision != "bf16" or backend == "gpu":
    return None
  if pairs <= PER_PAIR_MAX:
    return "per_pair"
  return DECODE_BLOCK_ROWS if pairs <= 8 * n_experts else None  # groups of a few rows on average


def per_pair_moe(x, expert_ids, weights, w_gate, w_up, w_down):
  """Small-batch routed experts: x [T,d], expert_ids/weights [T,k] -> [T,d], one pair at a time."""
  n_tok, k = expert_ids.shape

  def one(_, pair):
    xi, e = pair
    h = jax.nn.silu(xi @ w_gate[e]) * (xi @ w_up[e])
    return None, h.astype(xi.dtype) @ w_down[e]

  _, y = jax.lax.scan(one, None, (jnp.repeat(x, k, axis=0), expert_ids.reshape(-1)))
  return jnp.einsum("tkd,tk->td", y.reshape(n_tok, k, -1), weights.astype(y.dtype))


def moe_dispatch(x, expert_ids, weights, w_gate, w_up, w_down, *, impl: str = "auto",
                 precision: str = "bf16", per_pair_max: int | None = None):
  """Single-shard routed experts, dispatch chosen by row count (static). ``per_pair_max`` None is
  decode: few pairs -> one pair at a time, more -> grouped matmul on small blocks; 0 is
  training (the default layout always). Quantized recipes always take the grouped matmul, whose
  operands are fake-quantized as in training."""
  pairs = expert_ids.size
  if per_pair_max is None:
    block_rows = decode_layout(pairs, w_gate.shape[0], precision, jax.default_backend())
    if block_rows == "per_pair":
      return per_pair_moe(x, expert_ids, weights, w_gate, w_up, w_down)
  elif precision == "bf16" and pairs <= per_pair_max:
    return per_pair_moe(x, expert_ids, weights, w_gate, w_up, w_down)
  else:
    block_rows = None
  return dropless_moe(x, expert_ids, weights, w_gate, w_up, w_down, impl=impl, precision=precision,
                      block_rows=block_rows)


class MoE(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: KeySeq):
    self.cfg = cfg
    d, e, f = cfg.d_model, cfg.n_routed_experts, cfg.moe_ffn_dim
    pd = dtype_of(cfg.param_dtype)
    self.router = param(rngs, (d, e), ("embed", None), jnp.float32, std=cfg.init_std)
    self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), axes=(None,), eager_sharding=False)
    self.w_gate = param(rngs, (e, d, f), ("exp", "exp_embed", "exp_mlp"), pd, std=cfg.init_std)
    self.w_up = param(rngs, (e, d, f), ("exp", "exp_embed", "exp_mlp"), pd, std=cfg.init_std)
    self.w_down = param(rngs, (e, f, d), ("exp", "exp_mlp", "exp_embed"), pd, std=cfg.init_std)
    self.shared = MLP(cfg, f * cfg.n_shared_experts, rngs) if cfg.n_shared_experts else None

  def __call__(self, x, replay_ids=None, valid=None, decode: bool = False):
    """``decode`` (the cached path) lets few rows take the per-pair dispatch; training keeps the
    grouped matmul whatever the batch, so the kernels it tests are the ones it trains with."""
    cfg = self.cfg
    b, s, d = x.shape
    cdt = dtype_of(cfg.compute_dtype)
    xt = x.reshape(b * s, d)
    logits = xt.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
    replay = None if replay_ids is None else replay_ids.reshape(b * s, -1)
    ids, weights, scores = route(logits, self.router_bias[...], cfg, replay)
    w = [getattr(self, n)[...].astype(cdt) for n in ("w_gate", "w_up", "w_down")]
    mesh, _ = active()
    if mesh is not None and mesh.shape.get("expert", 1) > 1:
      y = expert_parallel_moe(xt.astype(cdt), ids, weights, *w, cfg=cfg, mesh=mesh)
    else:
      y = moe_dispatch(xt.astype(cdt), ids, weights, *w, impl=cfg.gmm_impl,
                       precision=cfg.gmm_precision, per_pair_max=None if decode else 0)
    y = constrain(y.reshape(b, s, d), ("act_batch", "act_seq", "act_embed"))
    if self.shared is not None:
      y = y + self.shared(x)
    aux = (sequence_aux_loss(scores, ids, b, cfg, valid) if cfg.seq_aux_loss_coef > 0
           else jnp.zeros((), jnp.float32))
    # Under router replay, the router's own choice too (RL's routing-mismatch metric; XLA shares the
    # selection with the fallback for unrecorded tokens).
    live = None if replay is None else select_experts(scores, self.router_bias[...], cfg).reshape(b, s, -1)
    return y.astype(x.dtype), MoEStats(ids.reshape(b, s, -1), expert_load(ids, cfg.n_routed_experts, valid), aux,
                                       live)


"""Mixture-of-experts layer: router, dropless routed experts, shared experts.

Dispatch is dropless: the (token, slot) pairs are sorted by expert and fed to one grouped matmul per
projection (``composer_jax.kernels.gmm``), so no capacity factor exists and nothing is ever dropped,
however skewed the routing. On a mesh with an expert axis the same bookkeeping runs inside
``composer_jax.parallel.experts`` with an all-to-all (or all-gather) exchange around it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.kernels import gmm
from composer_jax.model.layers import KeySeq, MLP, dtype_of, param
from composer_jax.model.routing import expert_load, route, sequence_aux_loss
from composer_jax.parallel.rules import active, constrain


class RouterBias(nnx.Variable):
  """Selection bias of the aux-loss-free balancing rule: state, but not a gradient-trained Param."""


class MoEStats(NamedTuple):
  expert_ids: jax.Array  # [b, s, k] int32 — what the router chose (or was told to use)
  load: jax.Array  # [E] fraction of assignments per expert
  aux_loss: jax.Array  # scalar


def sort_by_expert(expert_ids: jax.Array, n_experts: int):
  """Bookkeeping shared by every dispatch path.

  Returns (order [T*k]: the (token, slot) pairs sorted by expert, inverse [T*k], group_sizes [E]).
  """
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  group_sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
  return order, inverse, group_sizes


def expert_ffn(xs, group_sizes, w_gate, w_up, w_down, *, impl: str, precision: str):
  """SwiGLU of each row with its group's expert weights; rows sorted by group."""
  kw = dict(impl=impl, precision=precision)
  # One grouped matmul for gate and up: the row layout (and quantization) is paid once, not twice.
  f = w_gate.shape[-1]
  gu = gmm(xs, jnp.concatenate([w_gate, w_up], axis=-1), group_sizes, **kw)
  h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
  return gmm(h.astype(xs.dtype), w_down, group_sizes, **kw)


def dropless_moe(x, expert_ids, weights, w_gate, w_up, w_down, *, impl: str = "auto",
                 precision: str = "bf16"):
  """Single-shard routed experts: x [T,d], expert_ids/weights [T,k] -> [T,d]."""
  n_tok, k = expert_ids.shape
  order, inverse, group_sizes = sort_by_expert(expert_ids, w_gate.shape[0])
  xs = x[order // k]
  ys = expert_ffn(xs, group_sizes, w_gate, w_up, w_down, impl=impl, precision=precision)
  y = ys[inverse].reshape(n_tok, k, -1)
  return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


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

  def __call__(self, x, replay_ids=None, valid=None):
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
      from composer_jax.parallel.experts import expert_parallel_moe
      y = expert_parallel_moe(xt.astype(cdt), ids, weights, *w, cfg=cfg, mesh=mesh)
    else:
      y = dropless_moe(xt.astype(cdt), ids, weights, *w, impl=cfg.gmm_impl,
                       precision=cfg.gmm_precision)
    y = constrain(y.reshape(b, s, d), ("act_batch", "act_seq", "act_embed"))
    if self.shared is not None:
      y = y + self.shared(x)
    aux = (sequence_aux_loss(scores, ids, b, cfg, valid) if cfg.seq_aux_loss_coef > 0
           else jnp.zeros((), jnp.float32))
    return y.astype(x.dtype), MoEStats(ids.reshape(b, s, -1), expert_load(ids, cfg.n_routed_experts), aux)


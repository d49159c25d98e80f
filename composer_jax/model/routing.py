"""Pure routing functions: scores, group-limited top-k, combine weights, balancing.

Kimi K2 / DeepSeek-V3 routing: sigmoid scores; a per-expert bias (trained by the aux-loss-free rule,
not by gradients) is added for *selection only*; experts are first restricted to the best
``topk_group`` of ``n_group`` groups; the combine weights come from the un-biased scores of the
chosen experts, normalised to sum to one, times ``routed_scaling_factor``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig


def router_scores(logits: jax.Array, scoring: str) -> jax.Array:
  logits = logits.astype(jnp.float32)
  if scoring == "sigmoid":
    return jax.nn.sigmoid(logits)
  return jax.nn.softmax(logits, axis=-1)


def select_experts(scores: jax.Array, bias: jax.Array | None, cfg: ModelConfig) -> jax.Array:
  """Top-k expert ids [T, k] from scores [T, E] (+ selection bias), group-limited if n_group > 1."""
  choice = scores + bias.astype(scores.dtype) if (bias is not None and cfg.selection_bias) else scores
  n_tok, n_exp = choice.shape
  if cfg.n_group > 1:
    grouped = choice.reshape(n_tok, cfg.n_group, n_exp // cfg.n_group)
    if cfg.scoring == "sigmoid":  # DeepSeek-V3 "noaux_tc": a group scores the sum of its top 2
      group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
    else:  # "group_limited_greedy": a group scores its best expert
      group_score = grouped.max(-1)
    top_groups = jax.lax.top_k(group_score, cfg.topk_group)[1]  # [T, topk_group]
    keep = jnp.zeros((n_tok, cfg.n_group), bool).at[jnp.arange(n_tok)[:, None], top_groups].set(True)
    grouped = jnp.where(keep[:, :, None], grouped, -jnp.inf)
    choice = grouped.reshape(n_tok, n_exp)
  return jax.lax.top_k(choice, cfg.n_experts_per_tok)[1].astype(jnp.int32)


def combine_weights(scores: jax.Array, expert_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Gate weights [T, k] for the chosen ``expert_ids`` from the un-biased scores."""
  w = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if cfg.norm_topk_prob and cfg.n_experts_per_tok > 1:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return w * cfg.routed_scaling_factor


def route(logits: jax.Array, bias: jax.Array | None, cfg: ModelConfig,
          replay_ids: jax.Array | None = None):
  """Returns (expert_ids [T,k], weights [T,k], scores [T,E]).

  ``replay_ids`` (router replay for RL): use these experts instead of choosing, but compute their
  weights from this model's own scores so gradients flow through the router as usual. A token whose
  recorded ids hold any negative entry has no recorded route (prompt tokens a sampler never saw,
  padding): it takes the live router's choice, whole, so its k experts stay distinct.
  """
  scores = router_scores(logits, cfg.scoring)
  if replay_ids is None:
    ids = select_experts(scores, bias, cfg)
  else:
    replay_ids = replay_ids.astype(jnp.int32)
    missing = jnp.any(replay_ids < 0, axis=-1, keepdims=True)
    ids = jnp.where(missing, select_experts(scores, bias, cfg), replay_ids)
  return ids, combine_weights(scores, ids, cfg), scores


def expert_load(expert_ids: jax.Array, n_experts: int, valid: jax.Array | None = None) -> jax.Array:
  """Fraction of this batch's (token, slot) assignments that went to each expert: [E].

  ``expert_ids`` [tokens, k]; ``valid`` (any shape with ``tokens`` elements, e.g. [b, s]) keeps
  padding out of the count, which under SFT/RL padding would otherwise skew the bias update. No
  valid token gives an all-zero load (and so no bias change).
  """
  k = expert_ids.shape[-1]
  ids = expert_ids.reshape(-1, k)
  w = (jnp.ones(ids.shape[:1], jnp.float32) if valid is None
       else valid.reshape(-1).astype(jnp.float32))
  counts = jnp.zeros((n_experts,), jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(w, k))
  return counts / jnp.maximum(w.sum() * k, 1.0)


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones.

  bias_e += rate * sign(mean_load - load_e). ``load`` is [E] (or [..., E], averaged first).
  """
  load = load.reshape(-1, load.shape[-1]).mean(0)
  return (bias + rate * jnp.sign(load.mean() - load)).astype(bias.dtype)


def sequence_aux_loss(scores: jax.Array, expert_ids: jax.Array, batch: int, cfg: ModelConfig,
                      valid: jax.Array | None = None) -> jax.Array:
  """DeepSeek-V3's sequence-wise balance loss: mean over sequences of sum_e f_e * P_e.

  f_e = E / (k * S) * (tokens of the sequence routed to e); P_e = mean over the sequence of the
  scores normalised over all experts. Scaled by ``seq_aux_loss_coef``.
  """
  n_tok, n_exp = scores.shape
  seq = n_tok // batch
  k = cfg.n_experts_per_tok
  norm = scores / (scores.sum(-1, keepdims=True) + 1e-20)
  w = jnp.ones((n_tok,), jnp.float32) if valid is None else valid.reshape(-1).astype(jnp.float32)
  onehot = jax.nn.one_hot(expert_ids, n_exp, dtype=jnp.float32).sum(1) * w[:, None]  # [T, E]
  count = onehot.reshape(batch, seq, n_exp).sum(1)
  n_valid = jnp.maximum(w.reshape(batch, seq).sum(1, keepdims=True), 1.0)
  f = count * n_exp / (k * n_valid)
  p = (norm * w[:, None]).reshape(batch, seq, n_exp).sum(1) / n_valid
  return cfg.seq_aux_loss_coef * jnp.mean(jnp.sum(f * p, -1))

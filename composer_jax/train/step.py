"""The pure train step and the held-out bits-per-byte evaluation.

``TrainState`` is a plain dict pytree, the unit that is sharded, donated and checkpointed:
  params     nnx.State of the trained ``nnx.Param`` leaves
  rest       nnx.State of every other model variable (the MoE ``router_bias``)
  opt_state  the Optax state (parameter-shaped leaves sharded like their parameters)
  step       int32 scalar, optimizer steps taken
  rng        uint32 raw PRNG key, split once per step (kept for stochastic parts; checkpointed)

``train_step(state, batch) -> (state, metrics)`` has no side effects: gradient accumulation over
``grad_accum`` micro-batches (a scan, token-weighted so the result equals one big batch), the loss
of ``composer_jax.model.lm_loss`` (next token + MTP + optional z-loss + optional aux loss), one
optimizer update, then the aux-loss-free router-bias update from the step's expert loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from composer_jax.config import Config
from composer_jax.model import lm_loss
from composer_jax.model.routing import update_router_bias
from composer_jax.train import optim
from composer_jax.train.optim import qk_clip_scales


def param_axes(params: Any) -> list:
  """Logical axes of each parameter, in ``jax.tree.leaves(params)`` order."""
  from composer_jax.parallel.rules import variable_axes
  return [variable_axes(v) for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def split_model(model) -> tuple[Any, Any, Any]:
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, params, rest


def load_balance(loads: jax.Array | None) -> dict:
  """Expert-load metrics from [n_moe_blocks, E] assignment fractions.

  max_violation = mean over blocks of (max_e load - mean load) / mean load (0 = perfectly even).
  """
  if loads is None:
    return {}
  mean = loads.mean(-1, keepdims=True)
  vio = (loads.max(-1, keepdims=True) - mean) / jnp.maximum(mean, 1e-9)
  return {"expert_max_violation": vio.mean()}


def pop_max_logits(model) -> jax.Array:
  """[n_attention, heads] max attention logits recorded by the forward pass (then cleared), one row
  per attention layer in forward order (a stacked module of n layers gives n rows)."""
  rows = []
  for attn, n in model.attention_groups():
    top = jnp.max(jnp.stack(attn.max_logit.get_value()), axis=0)  # [heads], or [n, heads] stacked
    rows.append(top if n else top[None])
  nnx.pop(model, nnx.Intermediate)
  return jnp.concatenate(rows)


def _head_scale(v: jax.Array) -> jax.Array:
  """Per-head factors [..., heads] shaped to multiply a weight [..., in, heads, dim]."""
  return v.reshape(v.shape[:-1] + (1, v.shape[-1], 1))


def apply_qk_clip(model, max_logits: jax.Array, tau: float) -> None:
  """MuonClip for MLA, in place: rescale the query/key weights of heads whose logit exceeded tau.

  Head-specific query and key ``nope`` columns get sqrt(gamma) each; the query's rotary columns get
  gamma (the rotary key is shared by all heads and stays as it is); values are untouched.
  """
  cfg = model.cfg
  nope = cfg.qk_nope_dim
  row = 0
  for attn, n in model.attention_groups():
    ml = max_logits[row: row + n] if n else max_logits[row]  # [heads], or [n, heads] stacked
    row += n or 1
    root, gamma = map(_head_scale, qk_clip_scales(ml, tau))
    q = attn.q_b if cfg.q_lora_rank else attn.q_proj
    w = q.w[...]  # [(n,) in, heads, nope + rope]
    col = jnp.arange(w.shape[-1]) < nope
    q.w[...] = (w * jnp.where(col, root, gamma)).astype(w.dtype)
    kv = attn.kv_b.w[...]  # [(n,) kv_lora, heads, nope + v]
    col = jnp.arange(kv.shape[-1]) < nope
    attn.kv_b.w[...] = (kv * jnp.where(col, root, 1.0)).astype(kv.dtype)


def update_router_biases(model, loads: jax.Array, rate: float) -> None:
  """The aux-loss-free bias step of every MoE layer, in place, from ``loads`` [n_moe_blocks, E]
  (forward order; a stacked module of n layers takes n rows, each layer its own)."""
  row = 0
  for moe, n in model.moe_groups():
    if n:
      step = jax.vmap(update_router_bias, in_axes=(0, 0, None))
      moe.router_bias[...] = step(moe.router_bias[...], loads[row: row + n], rate)
    else:
      moe.router_bias[...] = update_router_bias(moe.router_bias[...], loads[row], rate)
    row += n or 1


def _micro_batches(batch: dict, n: int) -> dict:
  return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def lm_loss_fn(model, batch: dict, cfg: Config):
  """The default training loss: next-token (+ MTP, z-loss, aux) LM loss on a packed batch.

  Every loss handed to ``make_train_step`` has this signature:
  ``loss_fn(model, batch, cfg) -> (loss scalar, metrics dict, ModelOutput)``. ``metrics["tokens"]``
  is the count the loss averages over (it weighs micro-batches under gradient accumulation) and
  ``out.router_loads`` feeds the aux-loss-free router-bias update.
  """
  chunk = cfg.train.loss_chunk
  out = model(batch["tokens"], batch["segment_ids"], batch["positions"], return_hidden=chunk > 0)
  head = None
  if chunk > 0:  # the loss makes the logits chunk by chunk; XLA drops the unused out.logits
    head = (model.norm(out.hidden), head_weight(model))
  loss, metrics = lm_loss(out, batch["tokens"], batch["loss_mask"], cfg.model, batch["segment_ids"],
                          z_loss=cfg.train.z_loss, head=head, chunk=chunk)
  return loss, metrics, out


def head_weight(model) -> jax.Array:
  """The output head [d, vocab] as ``Transformer.logits`` multiplies it (the embedding when tied)."""
  return model.embed[...].T if model.cfg.tie_embeddings else model.head[...]


ROWS = "rows"  # the metrics key of a loss's per-row outputs (see make_train_step)


def make_train_step(graphdef, cfg: Config, tx: optax.GradientTransformation,
                    lr_fn: Callable | None = None, loss_fn: Callable | None = None) -> Callable:
  """``train_step(state, batch)`` for ``loss_fn`` (default ``lm_loss_fn``; see it for the contract).

  Every leaf of ``batch`` has the batch as its leading dim (micro-batches split it). A loss may put
  per-row arrays (leading dim = its batch) under ``metrics[ROWS]``: they come back as ``out[ROWS]``
  for the whole batch, computed at the weights before the update, and are not averaged.
  """
  mcfg, tcfg = cfg.model, cfg.train
  user_loss = loss_fn if loss_fn is not None else lm_loss_fn
  qk_clip = cfg.optim.qk_clip

  def loss_fn(params, rest, mb):
    model = nnx.merge(graphdef, params, rest)
    if qk_clip:
      model.set_attributes(record_max_logit=True, raise_if_not_found=False)
    loss, metrics, out = user_loss(model, mb, cfg)
    if "tokens" not in metrics:
      raise ValueError("loss_fn metrics must contain 'tokens' (the count the loss averages over)")
    metrics = dict(metrics)
    rows = metrics.pop(ROWS, {})
    head_max = pop_max_logits(model) if qk_clip else jnp.zeros((0,), jnp.float32)
    loads = out.router_loads if out.router_loads is not None else jnp.zeros((0,), jnp.float32)
    return loss, (metrics, loads, head_max, rows)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
    params, rest = state["params"], state["rest"]
    n = tcfg.grad_accum
    if n == 1:
      (loss, (metrics, loads, head_max, rows)), grads = grad_fn(params, rest, batch)
    else:
      # Token-weighted sum over micro-batches: each micro loss is a mean over its own targets.
      def body(carry, mb):
        g_acc, m_acc, l_acc, h_acc, tok = carry
        (_, (m, lo, hm, r)), g = grad_fn(params, rest, mb)
        w = m["tokens"]
        g_acc = jax.tree.map(lambda a, b: a + w * b.astype(jnp.float32), g_acc, g)
        m_acc = jax.tree.map(lambda a, b: a + w * b, m_acc, m)
        return (g_acc, m_acc, l_acc + lo, jnp.maximum(h_acc, hm), tok + w), r

      mbs = _micro_batches(batch, n)
      first = jax.tree.map(lambda x: x[0], mbs)
      m_shape = jax.eval_shape(lambda: grad_fn(params, rest, first)[0][1])
      zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), t)
      # The gradient sum is float32 whatever the parameter dtype (a bf16 carry would lose the small
      # micro-batch contributions, and scan needs the carry's dtype fixed).
      init = (zeros(params), zeros(m_shape[0]), zeros(m_shape[1]),
              jnp.full(m_shape[2].shape, -jnp.inf, jnp.float32), jnp.zeros((), jnp.float32))
      (g_sum, m_sum, l_sum, head_max, tok), rows = jax.lax.scan(body, init, mbs)
      rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), rows)  # micro-batches -> rows
      denom = jnp.maximum(tok, 1.0)
      # With a float32 master copy the float32 mean goes to the optimizer as it is.
      keep32 = isinstance(state["opt_state"], optim.MasterState)
      grads = jax.tree.map(lambda g, p: g / denom if keep32 else (g / denom).astype(p.dtype),
                           g_sum, params)
      metrics = jax.tree.map(lambda m: m / denom, m_sum)
      metrics["tokens"] = tok
      loads = l_sum / n
      loss = metrics["loss"]
    grad_norm = optax.tree.norm(grads)
    params, opt_state = optim.apply(tx, grads, state["opt_state"], params)
    if qk_clip:  # on the master copy when there is one (the weights are its rounding)
      master = isinstance(opt_state, optim.MasterState)
      model = nnx.merge(graphdef, opt_state.master if master else params, rest)
      apply_qk_clip(model, head_max, qk_clip)
      clipped = split_model(model)[1]
      if master:
        opt_state = opt_state._replace(master=clipped)
        clipped = optim.cast_like(clipped, params)
      params = clipped
    if bool(loads.size) and mcfg.bias_update_rate > 0:
      model = nnx.merge(graphdef, params, rest)
      update_router_biases(model, loads, mcfg.bias_update_rate)
      rest = split_model(model)[2]
    rng = jax.random.split(jax.random.wrap_key_data(state["rng"]))[0]
    new_state = {"params": params, "rest": rest, "opt_state": opt_state,
                 "step": state["step"] + 1, "rng": jax.random.key_data(rng)}
    out = {k: v for k, v in metrics.items() if k != "tokens"}
    if qk_clip:
      out["max_attn_logit"] = head_max.max()
    out.update(loss=loss, grad_norm=grad_norm, target_tokens=metrics["tokens"],
               update_skipped=(grad_norm == 0).astype(jnp.float32),  # optim.skip_zero_grads
               **load_balance(loads if loads.size else None))
    if lr_fn is not None:
      out["lr"] = lr_fn(state["step"])
    if rows:
      out[ROWS] = rows
    return new_state, out

  return train_step


def bits_per_byte_sums(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                       byte_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of next-token CE in bits, sum of UTF-8 bytes of those targets) over masked targets.

  bits/byte = first / second, summed over a whole evaluation set. It is independent of the
  tokenizer, so runs with different vocabularies compare.
  """
  lg = logits[:, :-1].astype(jnp.float32)
  tgt = tokens[:, 1:]
  mask = loss_mask[:, 1:].astype(jnp.float32)
  lp = jnp.take_along_axis(jax.nn.log_softmax(lg, -1), tgt[..., None], -1)[..., 0]
  bits = -(lp * mask).sum() / math.log(2.0)
  nbytes = (byte_lengths[tgt].astype(jnp.float32) * mask).sum()
  return bits, nbytes


def make_eval_step(graphdef) -> Callable:
  def eval_step(params, rest, batch, byte_lengths):
    model = nnx.merge(graphdef, params, rest)
    out = model(batch["tokens"], batch["segment_ids"], batch["positions"], mtp=False)
    return bits_per_byte_sums(out.logits, batch["tokens"], batch["loss_mask"], byte_lengths)
  return eval_step

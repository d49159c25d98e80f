"""Language-model losses: next-token cross-entropy, MTP depths, z-loss, router aux loss."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig
from composer_jax.parallel.rules import constrain


def _targets(tokens, loss_mask, segment_ids, shift: int):
  """(targets [b, s], valid [b, s] float32): position t predicts tokens[t + shift] when the mask
  marks that token and it lies in t's packed segment; the last ``shift`` positions are invalid."""
  b, s = tokens.shape
  n = s - shift
  tgt = jnp.pad(tokens[:, shift:], ((0, 0), (0, shift)))
  valid = loss_mask[:, shift:].astype(jnp.float32) if loss_mask is not None else jnp.ones((b, n))
  if segment_ids is not None:
    valid = valid * ((segment_ids[:, shift:] == segment_ids[:, :n]) & (segment_ids[:, shift:] != 0))
  return tgt, jnp.pad(valid, ((0, 0), (0, shift)))


def shifted_ce(logits, tokens, loss_mask, segment_ids, shift: int, z_loss: float = 0.0):
  """Mean CE of logits[:, t] predicting tokens[:, t+shift] over valid targets.

  A target is valid when ``loss_mask`` marks it and it lies in the same packed segment as the
  position that predicts it. The targets are shifted (and the last ``shift`` positions marked
  invalid), never the logits: slicing [b, s, vocab] copies the largest tensor of the step forward
  and pads its gradient backward. Returns (loss, n_valid, z_term).
  """
  tgt, valid = _targets(tokens, loss_mask, segment_ids, shift)
  lg = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(lg, axis=-1)
  lp = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0] - lse
  denom = jnp.maximum(valid.sum(), 1.0)
  loss = -(lp * valid).sum() / denom
  z = jnp.zeros((), jnp.float32)
  if z_loss:
    z = z_loss * ((lse ** 2) * valid).sum() / denom
  return loss, valid.sum(), z


# --------------------------------------------------------------------------------------------------
# The head and the CE in chunks of positions (train.loss_chunk)
# --------------------------------------------------------------------------------------------------
# The [b, s, vocab] float32 logits are the step's largest tensor (524 MB on bench.yaml), written by
# the head, read by the softmax, and its gradient written and read twice more. Chunked, each chunk's
# logits are made, turned into their gradient (softmax - one-hot) and consumed by the two gradient
# products at once, inside the forward: the backward only scales the two sums by the incoming
# cotangent. Same FLOPs (no recompute); measured 1.34x on the head + CE alone of bench.yaml (64
# positions x 8 rows per chunk, vs 1.19x at 16, 1.24x at 32, 1.27x at 256).


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_ce_sums(h, w, tgt, valid, z_coef: float, chunk: int):
  """(sum of valid * (nll + z_coef * lse^2), sum of valid * nll, sum of valid * lse^2) of the logits
  h [b, s, d] @ w [d, V]. Only the first output carries a gradient (the others are metrics)."""
  return _head_ce_fwd(h, w, tgt, valid, z_coef, chunk)[0]


def _chunks(x, chunk: int):
  """[b, s, ...] -> [n, b, chunk, ...], chunk j holding positions j, n + j, 2n + j, ...: strided, so
  a sequence axis sharded over context keeps its sharding on the chunk axis and each chunk is spread
  over every shard (s is zero-padded to n * chunk)."""
  b, s = x.shape[:2]
  n = -(-s // chunk)
  x = jnp.pad(x, ((0, 0), (0, n * chunk - s)) + ((0, 0),) * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((b, chunk, n) + x.shape[2:]), 2, 0)


def _unchunk(x, s: int):
  n, b, chunk = x.shape[:3]
  return jnp.moveaxis(x, 0, 2).reshape((b, n * chunk) + x.shape[3:])[:, :s]


def _head_ce_fwd(h, w, tgt, valid, z_coef, chunk):
  cdt = h.dtype

  def body(dw, xs):
    hc, tc, vc = xs
    lg = jnp.einsum("bcd,dv->bcv", hc, w, preferred_element_type=jnp.float32)
    lg = constrain(lg, ("act_batch", "act_seq", "act_vocab"))
    top = jax.lax.stop_gradient(lg.max(-1, keepdims=True))
    e = jnp.exp(lg - top)
    se = e.sum(-1, keepdims=True)
    lse = (top + jnp.log(se))[..., 0]
    nll = lse - jnp.take_along_axis(lg, tc[..., None], axis=-1)[..., 0]
    # d/dlogits of nll = softmax - one-hot; of lse^2 = 2 lse softmax
    scale = vc * (1.0 + 2.0 * z_coef * lse)
    onehot = jnp.arange(lg.shape[-1], dtype=tc.dtype) == tc[..., None]
    g = (e * (scale[..., None] / se) - jnp.where(onehot, vc[..., None], 0.0)).astype(cdt)
    dh = jnp.einsum("bcv,dv->bcd", g, w, preferred_element_type=jnp.float32).astype(cdt)
    dw = dw + jnp.einsum("bcd,bcv->dv", hc, g, preferred_element_type=jnp.float32)
    sums = jnp.stack([(nll * vc).sum(), (lse * lse * vc).sum()])
    return dw, (sums, dh)

  xs = (_chunks(h, chunk), _chunks(tgt, chunk), _chunks(valid, chunk))
  dw, (sums, dh) = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  nll, z = sums.sum(0)
  out = (nll + z_coef * z, nll, z)
  return out, (_unchunk(dh, h.shape[1]), dw.astype(w.dtype))


def _head_ce_bwd(z_coef, chunk, res, ct):
  dh, dw = res
  g = ct[0]
  return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None, None)


_head_ce_sums.defvjp(_head_ce_fwd, _head_ce_bwd)


def chunked_head_ce(h, w, tokens, loss_mask, segment_ids, shift: int, z_loss: float = 0.0,
                    chunk: int = 64):
  """``shifted_ce(h @ w, ...)`` without the [b, s, vocab] logits: the product and the CE run over
  chunks of ``chunk`` positions (all rows at once). h [b, s, d] (compute dtype), w [d, V] cast to
  it; the logits accumulate in float32. Returns (loss, n_valid, z_term) as shifted_ce does."""
  tgt, valid = _targets(tokens, loss_mask, segment_ids, shift)
  denom = jnp.maximum(valid.sum(), 1.0)
  total, nll, z = _head_ce_sums(h, w.astype(h.dtype), tgt, valid, float(z_loss), int(chunk))
  ce = jax.lax.stop_gradient(nll) / denom
  z_term = jax.lax.stop_gradient(z_loss * z) / denom
  # total / denom is ce + z_term in value; the gradient flows through total alone
  loss = total / denom - jax.lax.stop_gradient(total / denom) + ce
  return loss, valid.sum(), z_term


def lm_loss(out, tokens, loss_mask, cfg: ModelConfig, segment_ids=None, z_loss: float = 0.0,
            head=None, chunk: int = 0):
  """Total training loss and its parts.

  loss = CE(next token) + z_loss * lse^2 + mtp_loss_weight * mean_k CE(token t+1+k) + aux.
  ``loss_mask`` [b,s] marks the tokens that are targets (1) — e.g. assistant tokens in SFT.
  ``head`` (h, w), the normed final hidden state [b, s, d] and the output weight [d, V], with
  ``chunk`` > 0 computes the next-token CE by ``chunked_head_ce`` (``out.logits`` is not read, so
  under jit the full logits are never made); the MTP depths still read their logits.
  """
  if head is not None and chunk > 0:
    ce, n_tok, z = chunked_head_ce(*head, tokens, loss_mask, segment_ids, 1, z_loss, chunk)
  else:
    ce, n_tok, z = shifted_ce(out.logits, tokens, loss_mask, segment_ids, 1, z_loss)
  metrics = {"ce": ce, "tokens": n_tok}
  total = ce + z
  if z_loss:
    metrics["z_loss"] = z
  if out.mtp_logits:
    mtp = [shifted_ce(lg, tokens, loss_mask, segment_ids, k + 1)[0]
           for k, lg in enumerate(out.mtp_logits, start=1)]
    mtp_mean = sum(mtp) / len(mtp)
    metrics["mtp_ce"] = mtp_mean
    total = total + cfg.mtp_loss_weight * mtp_mean
  if out.aux_loss is not None:
    metrics["aux_loss"] = out.aux_loss
    total = total + out.aux_loss
  metrics["loss"] = total
  return total, metrics

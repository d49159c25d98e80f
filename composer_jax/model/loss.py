"""Language-model losses: next-token cross-entropy, MTP depths, z-loss, router aux loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig


def shifted_ce(logits, tokens, loss_mask, segment_ids, shift: int, z_loss: float = 0.0):
  """Mean CE of logits[:, t] predicting tokens[:, t+shift] over valid targets.

  A target is valid when ``loss_mask`` marks it and it lies in the same packed segment as the
  position that predicts it. The targets are shifted (and the last ``shift`` positions marked
  invalid), never the logits: slicing [b, s, vocab] copies the largest tensor of the step forward
  and pads its gradient backward. Returns (loss, n_valid, z_term).
  """
  b, s = tokens.shape
  n = s - shift
  tgt = jnp.pad(tokens[:, shift:], ((0, 0), (0, shift)))
  valid = loss_mask[:, shift:].astype(jnp.float32) if loss_mask is not None else jnp.ones((b, n))
  if segment_ids is not None:
    valid = valid * ((segment_ids[:, shift:] == segment_ids[:, :n]) & (segment_ids[:, shift:] != 0))
  valid = jnp.pad(valid, ((0, 0), (0, shift)))
  lg = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(lg, axis=-1)
  lp = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0] - lse
  denom = jnp.maximum(valid.sum(), 1.0)
  loss = -(lp * valid).sum() / denom
  z = jnp.zeros((), jnp.float32)
  if z_loss:
    z = z_loss * ((lse ** 2) * valid).sum() / denom
  return loss, valid.sum(), z


def lm_loss(out, tokens, loss_mask, cfg: ModelConfig, segment_ids=None, z_loss: float = 0.0):
  """Total training loss and its parts.

  loss = CE(next token) + z_loss * lse^2 + mtp_loss_weight * mean_k CE(token t+1+k) + aux.
  ``loss_mask`` [b,s] marks the tokens that are targets (1) — e.g. assistant tokens in SFT.
  """
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

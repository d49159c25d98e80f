"""Pure sampling from logits: temperature, top-k, top-p, and the log-prob the trainer can reproduce.

The log-prob reported for a sampled id is always under the *temperature-scaled softmax over the whole
vocabulary*, ``log_softmax(logits / T)[id]``: exactly what the trainer computes from its own logits,
so importance ratios and ``train_infer_logprob_abs_diff`` compare like with like. With top-k / top-p
the id is drawn from the truncated, renormalised distribution; its reported log-prob is still the
full-vocabulary one (smaller than the truncated distribution's by log of the kept mass), the
convention of the public RL stacks, which the importance correction then absorbs. ``T <= 0`` is greedy
(argmax) with the log-prob under ``log_softmax(logits)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def truncate(scaled: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Scaled logits [b, V] with everything outside the top-k and the top-p nucleus set to -inf.

  top-p keeps the smallest set of most-likely ids whose probability (after top-k) reaches ``top_p``;
  the most likely id is always kept. Ids tied with the last kept logit are kept too.
  """
  out = scaled
  if top_k and top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
    out = jnp.where(scaled < kth, -jnp.inf, out)
  if top_p < 1.0:
    srt = jnp.sort(out, axis=-1)[:, ::-1]  # descending
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted id
    keep = before < top_p
    keep = keep.at[:, 0].set(True)
    thr = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    out = jnp.where(out < thr, -jnp.inf, out)
  return out


def sample(logits: jax.Array, key: jax.Array, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Draw one id per row of ``logits`` [b, V]; returns (ids int32 [b], logprobs float32 [b])."""
  logits = logits.astype(jnp.float32)
  if temperature <= 0:
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
  else:
    scaled = logits / temperature
    logp = jax.nn.log_softmax(scaled, axis=-1)
    ids = jax.random.categorical(key, truncate(scaled, top_k, top_p), axis=-1).astype(jnp.int32)
  return ids, jnp.take_along_axis(logp, ids[:, None], axis=-1)[:, 0]

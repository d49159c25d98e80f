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

NUCLEUS_BISECTIONS = 50  # halvings of the logit range: the threshold is then exact to float32


def truncate(scaled: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Scaled logits [b, V] with everything outside the top-k and the top-p nucleus set to -inf.

  top-p keeps the smallest set of most-likely ids whose probability (after top-k) reaches ``top_p``;
  the most likely id is always kept. Ids tied with the last kept logit are kept too.

  The nucleus threshold is found by bisection on the logit value, not by sorting the vocabulary:
  the largest threshold t with mass(logits >= t) >= top_p. Each halving is one masked sum over the
  row, and after ``NUCLEUS_BISECTIONS`` of them the bracket is narrower than float32 resolves, so
  the kept set equals the sorted definition (a sort of [16, 2048] took 5 ms on this CPU, the
  bisection 0.3 ms; tests/rl/test_sampler.py compares the two).
  """
  out = scaled
  if top_k and top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
    out = jnp.where(scaled < kth, -jnp.inf, out)
  if top_p < 1.0:
    probs = jax.nn.softmax(out, axis=-1)
    # invariant: mass(out >= lo) >= top_p (lo starts at the smallest kept logit); hi only shrinks
    lo = jnp.min(jnp.where(jnp.isfinite(out), out, jnp.inf), axis=-1, keepdims=True)
    hi = jnp.max(out, axis=-1, keepdims=True)

    def halve(_, bracket):
      lo, hi = bracket
      mid = 0.5 * (lo + hi)
      ok = jnp.sum(jnp.where(out >= mid, probs, 0.0), axis=-1, keepdims=True) >= top_p
      return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, NUCLEUS_BISECTIONS, halve, (lo, hi))
    out = jnp.where(out < lo, -jnp.inf, out)
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


def _probs(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """The distribution ``sample`` draws from: softmax of the truncated, temperature-scaled logits."""
  return jax.nn.softmax(truncate(logits.astype(jnp.float32) / temperature, top_k, top_p), axis=-1)


def speculative_verify(target: jax.Array, draft_logits: jax.Array, draft: jax.Array,
                       has_draft: jax.Array, key: jax.Array, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Speculative sampling of one drafted token per row (Leviathan et al. 2023, Chen et al. 2023).

  ``target`` [b, 2, V]: the main model's logits at the position the draft answers (0) and at the
  draft itself (1); ``draft_logits`` [b, V] the drafter's logits that ``draft`` [b] was sampled from
  (by ``sample`` with the same temperature, top-k, top-p); ``has_draft`` [b] bool (rows without a
  draft sample position 0 normally). The draft is kept with probability min(1, p(d) / q(d)); on a
  rejection the token comes from max(p - q, 0) renormalised, and on acceptance a bonus token is drawn
  from position 1. Every emitted id is then distributed exactly as ``sample`` would draw it from the
  target, so rollouts are the same policy with or without drafts. Greedy (T <= 0) keeps the draft iff
  it is the target's argmax.

  Returns (ids int32 [b, 2], logprobs float32 [b, 2] as ``sample`` reports them, n int32 [b]: 2 when
  the draft was kept (ids = draft, bonus), else 1 (ids[:, 0] = the target's token)).
  """
  target = target.astype(jnp.float32)
  if temperature <= 0:
    first = jnp.argmax(target[:, 0], axis=-1).astype(jnp.int32)
    keep = has_draft & (first == draft)
    bonus = jnp.argmax(target[:, 1], axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(target, axis=-1)
  else:
    k_accept, k_fix, k_bonus = jax.random.split(key, 3)
    p = _probs(target[:, 0], temperature, top_k, top_p)
    q = _probs(draft_logits, temperature, top_k, top_p)
    pick = lambda a: jnp.take_along_axis(a, draft[:, None], axis=-1)[:, 0]
    u = jax.random.uniform(k_accept, draft.shape)
    # u * q(d) < p(d) is u < p(d)/q(d) without dividing; q(d) > 0 for a draft sampled from q
    keep = has_draft & (u * pick(q) < pick(p))
    resid = jnp.maximum(p - q, 0.0)
    resid_ok = jnp.sum(resid, axis=-1, keepdims=True) > 0
    # a row without a draft samples p itself; a rejected one the residual (empty only if p == q,
    # where nothing is rejected: p then stands in so that the draw stays defined)
    fix_from = jnp.where(has_draft[:, None] & resid_ok, resid, p)
    fixed = jax.random.categorical(k_fix, jnp.log(fix_from), axis=-1).astype(jnp.int32)
    first = jnp.where(keep, draft, fixed)
    scaled = target[:, 1] / temperature
    bonus = jax.random.categorical(k_bonus, truncate(scaled, top_k, top_p), axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(target / temperature, axis=-1)
  ids = jnp.stack([first, bonus], axis=1)
  lps = jnp.take_along_axis(logp, ids[:, :, None], axis=-1)[:, :, 0]
  return ids, lps, jnp.where(keep, 2, 1).astype(jnp.int32)

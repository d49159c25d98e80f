"""Context parallelism: the sequence sharded over the ``context`` mesh axis, causally load-balanced.

Activations keep the plain layout (device i holds the i-th contiguous chunk of every sequence), so
everything outside attention — position-wise layers, the loss and its shifted targets, MTP — is
untouched. Only the attention core runs inside ``shard_map``:

1. The MLA *latent* is all-gathered over ``context``: the normed ``kv_lora_rank`` vector and the
   shared RoPE key, 576 numbers per token for K2 against 64 x (128 + 128) = 16,384 for the expanded
   per-head keys and values. Each device expands the key blocks it needs with ``kv_b`` locally (a
   few % of the attention FLOPs); the backward is a reduce-scatter of the latent's gradient, and
   ``kv_b``'s gradient is summed over the devices.
2. Causal work is balanced with the zigzag split: the sequence is cut into ``2n`` half-chunks and
   device d attends for half-chunks ``d`` and ``2n-1-d`` (an early and a late one), which need
   ``d+1`` and ``2n-d`` key blocks — ``2n+1`` blocks of ``c x c`` scores on every device, against
   ``4n`` for the dense masked product. The query halves reach their zigzag owner with two
   ``ppermute`` calls (each a permutation, since even and odd half-chunks map to distinct devices)
   and the outputs return the same way.
3. With a ``core`` (the model's blockwise kernel, handed in by the caller) both query halves attend
   in one call over the expanded keys, visiting only their causal, segment-overlapping key tiles:
   one (block x block) tile of scores per head at a time, memory O(s) per device — what a 256K
   context needs. Without one (the reference, ``model.attention_impl=dense``), the ``2n+1``
   (query half, key block) pairs are dense with static shapes and one softmax is taken across the
   pairs of each query half (a shared max and denominator). Both equal the unsharded result.

Causality is by index in the packed row and keys must share the query's segment, as in
``composer_jax.model.attention``; padding (id 0) attends to nothing, and rows with no valid key
give zeros. This module imports nothing
from ``composer_jax.model`` (the model calls it; the dependency runs one way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.rules import active, spec_for

NEG_INF = -1e30


def zigzag_halves(n: int) -> list[tuple[int, int]]:
  """Half-chunks each device attends for: (even one, odd one) of {d, 2n-1-d}."""
  out = []
  for d in range(n):
    a, b = d, 2 * n - 1 - d
    out.append((a, b) if a % 2 == 0 else (b, a))
  return out


def _owner_perms(n: int) -> tuple[list, list]:
  """ppermute pairs moving local half-chunk slot 0 / slot 1 of device i to its zigzag device."""
  proc = lambda m: m if m < n else 2 * n - 1 - m
  return ([(i, proc(2 * i)) for i in range(n)], [(i, proc(2 * i + 1)) for i in range(n)])


def pair_plan(halves: jax.Array, n: int):
  """Static-length (query slot, key block) pairs for query half-chunks ``halves`` [2] (even, odd).

  Pair t < h0+1 is (slot 0, block t); the rest are (slot 1, block t-h0-1): 2n+1 pairs in all.
  """
  t = jnp.arange(2 * n + 1)
  slot = (t > halves[0]).astype(jnp.int32)
  block = jnp.where(slot == 0, t, t - halves[0] - 1)
  return slot, block


def _expand(c, w, dn):
  """Latent [..., r] through kv_b [r, h, dn + dv] -> (k_nope [..., h, dn], v [..., h, dv])."""
  kv = jnp.einsum("...r,rhd->...hd", c, w)
  return kv[..., :dn], kv[..., dn:]


def _block_size(c: int, block: int) -> int:
  """The largest tile <= block that divides a half-chunk of c rows."""
  return max(d for d in range(1, min(block, c) + 1) if c % d == 0)


def _balanced_body(q_nope, q_pe, c_lat, k_pe, w_kv, seg, *, scale, cp_axes, n, vary, core, block):
  b, L = q_nope.shape[:2]
  c = L // 2
  dn = q_nope.shape[-1]
  perm0, perm1 = _owner_perms(n)
  inv = lambda p: [(j, i) for i, j in p]
  if vary:  # kv_b meets different tokens on each of these shards: its gradient sums over them
    w_kv = jax.lax.pcast(w_kv, vary, to="varying")
  if core is not None:
    return _core_body(q_nope, q_pe, c_lat, k_pe, w_kv, seg, scale=scale, cp_axes=cp_axes, n=n,
                      vary=vary, core=core, block=block)

  def to_owner(x):  # [b, L, ...] -> [b, 2, c, ...] holding this device's (even, odd) halves
    x0 = jax.lax.ppermute(x[:, :c], cp_axes, perm0)
    x1 = jax.lax.ppermute(x[:, c:], cp_axes, perm1)
    return jnp.stack([x0, x1], axis=1)

  def gather(x):  # full sequence in natural order, cut into 2n blocks of c
    full = jax.lax.all_gather(x, cp_axes, axis=1, tiled=True)
    return full.reshape((b, 2 * n, c) + x.shape[2:])

  me = jax.lax.axis_index(cp_axes)
  halves = jnp.asarray(zigzag_halves(n), jnp.int32)[me]  # [2]
  slot, block = pair_plan(halves, n)
  qn, qp, qs = to_owner(q_nope), to_owner(q_pe), to_owner(seg)
  cl, kp, ks = gather(c_lat), gather(k_pe), gather(seg)  # the latent travels, not K/V
  q_idx = halves[:, None] * c + jnp.arange(c)[None]  # [2, c] index in the packed row
  k_idx = jnp.arange(2 * n * c).reshape(2 * n, c)
  qn, qp, qs, qi = qn[:, slot], qp[:, slot], qs[:, slot], q_idx[slot]  # [b, P, c, ...]
  cl, kp, ks, ki = cl[:, block], kp[:, block], ks[:, block], k_idx[block]
  kn, vv = _expand(cl, w_kv, dn)  # [b, P, c, h, *]
  scores = (jnp.einsum("bpqhd,bpkhd->bphqk", qn, kn, preferred_element_type=jnp.float32)
            + jnp.einsum("bpqhd,bpkd->bphqk", qp, kp, preferred_element_type=jnp.float32)) * scale
  mask = (qi[None, :, :, None] >= ki[None, :, None, :]) & (qs[..., :, None] == ks[..., None, :])
  mask &= qs[..., :, None] != 0  # padding attends to nothing (model/attention.py)
  mask = mask[:, :, None]  # [b, P, 1, cq, ck]
  scores = jnp.where(mask, scores, NEG_INF)
  onehot = jax.nn.one_hot(slot, 2, dtype=jnp.float32)  # [P, 2]
  # One softmax over all pairs of a query half: shared max, shared denominator.
  pmax = scores.max(-1)  # [b, P, h, cq]
  smax = jnp.where(onehot.T[None, :, :, None, None] > 0, pmax[:, None], NEG_INF).max(2)  # [b,2,h,cq]
  e = jnp.where(mask, jnp.exp(scores - smax[:, slot][..., None]), 0.0)
  denom = jnp.einsum("bphq,ps->bshq", e.sum(-1), onehot)  # [b, 2, h, cq]
  o = jnp.einsum("bphqk,bpkhd->bpqhd", e.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
  o = jnp.einsum("bpqhd,ps->bsqhd", o, onehot)  # [b, 2, c, h, dv]
  d = jnp.transpose(denom, (0, 1, 3, 2))[..., None]  # [b, 2, cq, h, 1]
  o = jnp.where(d > 0, o / jnp.where(d > 0, d, 1.0), 0.0).astype(vv.dtype)
  o0 = jax.lax.ppermute(o[:, 0], cp_axes, inv(perm0))
  o1 = jax.lax.ppermute(o[:, 1], cp_axes, inv(perm1))
  # per-head max logit (QK-clip) over this device's pairs, then over every token shard
  top = jax.lax.pmax(jax.lax.stop_gradient(pmax).max(axis=(0, 1, 3)), vary)
  return jnp.concatenate([o0, o1], axis=1), top


def _core_body(q_nope, q_pe, c_lat, k_pe, w_kv, seg, *, scale, cp_axes, n, vary, core, block):
  """The balanced split with a blockwise ``core``: both query halves of this device attend over
  the gathered, locally expanded keys in one call that visits only their causal key blocks, so
  scores never exceed one (block x block) tile per head: memory O(s) per device."""
  L, h = q_nope.shape[1:3]
  c = L // 2
  perm0, perm1 = _owner_perms(n)
  inv = lambda p: [(j, i) for i, j in p]

  def to_owner(x):  # [b, L, ...] -> [b, L, ...] holding this device's (even, odd) halves
    x0 = jax.lax.ppermute(x[:, :c], cp_axes, perm0)
    x1 = jax.lax.ppermute(x[:, c:], cp_axes, perm1)
    return jnp.concatenate([x0, x1], axis=1)

  gather = lambda x: jax.lax.all_gather(x, cp_axes, axis=1, tiled=True)
  me = jax.lax.axis_index(cp_axes)
  halves = jnp.asarray(zigzag_halves(n), jnp.int32)[me]  # [2]
  q = jnp.concatenate([to_owner(q_nope), to_owner(q_pe)], axis=-1)
  k_nope, v = _expand(gather(c_lat), w_kv, q_nope.shape[-1])  # the latent travels, not K/V
  kp = gather(k_pe)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(kp[:, :, None], kp.shape[:2] + (h, kp.shape[-1]))],
                      axis=-1)
  bs = _block_size(c, block)
  m = c // bs
  q_idx = jnp.concatenate([halves[0] * m + jnp.arange(m), halves[1] * m + jnp.arange(m)])
  o, top = core(q * jnp.asarray(scale, q.dtype), k, v, to_owner(seg), gather(seg), q_idx, bs)
  o0 = jax.lax.ppermute(o[:, :c], cp_axes, inv(perm0))
  o1 = jax.lax.ppermute(o[:, c:], cp_axes, inv(perm1))
  return jnp.concatenate([o0, o1], axis=1).astype(v.dtype), jax.lax.pmax(top, vary)


def dense_attention(q_nope, q_pe, k_nope, k_pe, v, seg, scale, with_max_logit=False):
  """The unsharded computation over expanded keys and values (the reference); with
  ``with_max_logit``, (o, per-head max of the masked scaled logits [h])."""
  b, s = q_nope.shape[:2]
  scores = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=jnp.float32)
            + jnp.einsum("bqhd,bkd->bhqk", q_pe, k_pe, preferred_element_type=jnp.float32))
  idx = jnp.arange(s)
  mask = jnp.broadcast_to(idx[:, None] >= idx[None, :], (b, s, s))
  if seg is not None:  # padding (id 0) attends to nothing: a zero output (model/attention.py)
    mask = mask & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
  logits = jnp.where(mask[:, None], scores * scale, NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1) * mask.any(-1)[:, None, :, None]
  o = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)
  if not with_max_logit:
    return o
  return o, jax.lax.stop_gradient(logits.max(axis=(0, 2, 3)))


def context_attention(q_nope, q_pe, c, k_pe, w_kv, seg, scale: float, mesh=None, rules=None,
                      local=None, with_max_logit=False, core=None, block: int = 128):
  """Causal attention with the sequence sharded over context, from the MLA latent.

  q_nope/q_pe [b,s,h,*]; c [b,s,r] the normed latent; k_pe [b,s,rope] (roped); w_kv [r,h,dn+dv]
  the key/value up-projection. Returns o [b,s,h,dv], or with ``with_max_logit`` (o, per-head max
  logit [h], no gradient) for QK-clip. Where no context axis is active or s does not split into 2n,
  K/V are expanded here and ``local(q_nope, q_pe, k_nope, k_pe, v, seg)`` runs (default:
  dense_attention); it returns what this function would. ``core`` (the model's blockwise kernel,
  ``composer_jax.model.attention.blockwise_core``, handed in so this module never imports the
  model) replaces the dense (query half, key block) pairs with ``block``-row tiles.
  """
  if mesh is None:
    mesh, rules = active()
  b, s = q_nope.shape[:2]
  n, cp_axes, spec = 1, (), None
  if mesh is not None:
    spec = spec_for(("act_batch", "act_seq", "act_heads", None), q_nope.shape, mesh, rules,
                    what="attention", strict=False)
    cp_axes = spec[1] if isinstance(spec[1], tuple) else ((spec[1],) if spec[1] else ())
    for a in cp_axes:
      n *= mesh.shape[a]
  if n == 1 or s % (2 * n):
    k_nope, v = _expand(c, w_kv, q_nope.shape[-1])
    if local is not None:
      return local(q_nope, q_pe, k_nope, k_pe, v, seg)
    return dense_attention(q_nope, q_pe, k_nope, k_pe, v, seg, scale, with_max_logit)
  if seg is None:
    seg = jnp.ones((b, s), jnp.int32)
  q_spec = spec
  lat_spec = P(spec[0], spec[1], None)
  seg_spec = P(spec[0], spec[1])
  w_spec = P(None, spec[2], None)
  axes_of = lambda e: e if isinstance(e, tuple) else ((e,) if e else ())
  vary = axes_of(spec[0]) + cp_axes

  def body(*args):
    return _balanced_body(*args, scale=scale, cp_axes=cp_axes, n=n, vary=vary, core=core,
                          block=block)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(q_spec, q_spec, lat_spec, lat_spec, w_spec, seg_spec),
                     out_specs=(q_spec, P(spec[2])))
  o, top = fn(q_nope, q_pe, c, k_pe, w_kv, seg.astype(jnp.int32))
  return (o, top) if with_max_logit else o

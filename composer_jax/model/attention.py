"""Causal attention with packed segments: one entry point, one implementation chosen per backend.

``attention(q, k, v, segment_ids, scale=..., impl=...)`` takes q, k [b, s, h, dk] and v [b, s, h, dv]
(MLA: dk = nope + rope = 192, dv = 128 for K2). A query attends to the keys at or before its index in
the packed row that carry the same segment id. Padding (id 0) attends to nothing and its output is zero
(the kernels below attend within it, and their output there is zeroed); nothing reads a padding
output (losses, router loads and caches skip id 0), and so blockwise never visits padding, which is
most of the work on an RL batch of right-padded rows. Implementations, chosen by
``model.attention_impl``:

* ``dense``     — the [b, h, s, s] masked softmax: the float32 reference, O(s^2) memory.
* ``blockwise`` — flash-style in pure JAX with a custom VJP (CPU default): loops over (query block,
                  key block) pairs with an online softmax, holds one block of scores at a time, never
                  visits a block above the diagonal, skips blocks the segment ids leave empty (each
                  group of ``rows`` batch rows has its own plan, so a short row is not padded to the
                  longest), and recomputes the scores per block backward. Memory O(s) per head;
                  any dk, dv, s.
                  A sequence of at most one block (``model.attention_block``) is the dense product.
* ``splash``    — TPU: splash attention (block-sparse causal mask + segment ids, Pallas/Mosaic),
                  per-batch-row via vmap. Any dk, dv (192 / 128 lower); s a multiple of 128; tiles
                  of up to max(attention_block, 512) rows dividing s.
* ``pallas_gpu``— GPU: JAX's Pallas Triton flash attention (causal + segment ids). It needs dk == dv:
                  v is zero-padded to dk (and both to the next power of two inside the kernel: 256
                  for MLA's 192), so MLA pays ~2x on the P.V product; s < 128 or a multiple of 128;
                  64-row tiles at a padded head dim of 256 (128 rows overflow shared memory).
                  On an H200 (K2 dims, bf16, fwd+bwd): 75 TFLOP/s at 32K; at 16K 1.2x dense in 1/107 of
                  its memory (0.4 vs 43 GB).
* ``cudnn``     — GPU: ``jax.nn.dot_product_attention(implementation="cudnn")``; needs dk == dv (v
                  padded), dk a multiple of 8 and <= 256 (Hopper; <= 128 before), and has no
                  segment input, so only unpacked batches (segment_ids None). cuDNN >= 9.10 has
                  native MLA dims and packed THD offsets on Hopper, but only through private JAX
                  entry points (jax._src.cudnn), so this module does not use them.

``auto`` picks splash on TPU; on GPU, for 16-bit inputs, cudnn for unpacked rows and pallas_gpu for
packed ones; blockwise elsewhere, float32 on GPU included (cuDNN refuses float32 and Triton's float32
dot runs in TF32, so a float32 config would silently lose precision), and where the kernel's shape
rules do not hold. Kernels run per (batch, head) shard of the active mesh.
The per-head maximum logit (QK-clip) comes free out of the blockwise forward; the kernels get it
from a separate blockwise max pass (no P.V, no gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.rules import active, spec_for

NEG_INF = -1e30
IMPLS = ("auto", "dense", "blockwise", "splash", "pallas_gpu", "cudnn")


# --------------------------------------------------------------------------------------------------
# The dense reference (today's path) and its pieces, shared with decoding
# --------------------------------------------------------------------------------------------------


def attention_mask(q_pos_idx, k_pos_idx, q_seg=None, k_seg=None, k_valid=None):
  """Boolean [b, 1, sq, sk]: causal by index, same segment, and (decoding) key slot written."""
  mask = q_pos_idx[:, :, None] >= k_pos_idx[:, None, :]
  if q_seg is not None:  # padding (id 0) attends to nothing
    mask &= (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg != 0)[:, :, None]
  if k_valid is not None:
    mask &= k_valid[:, None, :]
  return mask[:, None]


@jax.custom_vjp
def masked_softmax(scores, mask):
  """Softmax over the keys ``mask`` allows; rows with no valid key (padding) give zeros, not NaN.

  A custom VJP because the [b, h, q, k] tensor is the largest of the attention: the forward is one
  max and one exp/sum pass, the backward ``p * (g - sum(g * p))`` (masked entries have p = 0), with
  no select / softmax / select chain to transpose.
  """
  return _masked_softmax_fwd(scores, mask)[0]


def _masked_softmax_fwd(scores, mask):
  top = jnp.max(jnp.where(mask, scores, NEG_INF), axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(scores - top), 0.0)
  probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(e.dtype).tiny)
  return probs, probs


def _masked_softmax_bwd(probs, g):
  return probs * (g - jnp.sum(g * probs, axis=-1, keepdims=True)), None


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


def dense_attention(q, k, v, seg, scale, with_max_logit=False):
  """[b, h, s, s] scores with the scale folded into q (one product, as the MLA path always did)."""
  b, s = q.shape[:2]
  q = q * jnp.asarray(scale, q.dtype)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  idx = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
  mask = attention_mask(idx, idx, seg, seg)
  probs = masked_softmax(scores, mask).astype(v.dtype)
  o = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
  if not with_max_logit:
    return o, None
  return o, jax.lax.stop_gradient(jnp.max(jnp.where(mask, scores, NEG_INF), axis=(0, 2, 3)))


# --------------------------------------------------------------------------------------------------
# Blockwise (flash-style) attention in pure JAX
# --------------------------------------------------------------------------------------------------
# Arrays are blocked as [nb, b, h, bs, d] (segments [nb, b, bs]) so a block is one leading index.
# Queries and keys are blocked separately: query block i sits at block ``qidx[i]`` of the key
# sequence (qidx = arange for self-attention; context parallelism passes its zigzag halves).


def _vary(x, *refs):
  """A fresh loop carry typed as varying over the mesh axes ``refs`` vary over (inside shard_map,
  as under context parallelism; a no-op elsewhere), so it matches the carry the body returns."""
  varying = lambda a: set(getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", ()) or ())
  axes = set().union(*(varying(r) for r in refs)) - varying(x)
  return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def _block_mask(sq, sk, qi, j, bs):
  """[b, 1, bs, bs] mask of (query block at key-block index qi, key block j): causal by index,
  same segment, not padding (ids <= 0: 0 padding, -1 the tail up to a whole block). sq, sk: the
  two blocks' segment ids [b, bs]."""
  causal = (qi * bs + jnp.arange(bs))[:, None] >= (j * bs + jnp.arange(bs))[None, :]
  return (causal[None] & (sq[:, :, None] == sk[:, None, :]) & (sq > 0)[:, :, None])[:, None]


def _id_range(sb):
  """Per block and row, the (min, max) of its non-padding segment ids; (int max, -1) if none."""
  valid = sb > 0
  return (jnp.where(valid, sb, jnp.iinfo(jnp.int32).max).min(-1), jnp.where(valid, sb, -1).max(-1))


def _visit_plan(sqb, skb, qidx):
  """Which (query block i, key block j) pairs to visit, as index lists for the loops.

  A pair is visited if j <= qidx[i] and, in some row, the non-padding segment-id ranges of the two
  blocks overlap: exact for the non-decreasing ids of packed rows, never skipping a pair with a
  valid entry otherwise. Returns (keys [nq, nk]: visited j of each i, descending, so the query's
  own block comes first; n_keys [nq]; queries [nk, nq]: visited i of each j; n_queries [nk]).
  """
  nq, nk = sqb.shape[0], skb.shape[0]
  (qlo, qhi), (klo, khi) = _id_range(sqb), _id_range(skb)  # [n, b]
  overlap = ((qlo[:, None] <= khi[None, :]) & (klo[None, :] <= qhi[:, None])).any(-1)
  kj, qi = jnp.arange(nk), jnp.arange(nq)
  visit = overlap & (qidx[:, None] >= kj[None, :])
  keys = jnp.argsort(jnp.where(visit, -kj[None, :], nk), axis=1).astype(jnp.int32)
  queries = jnp.argsort(jnp.where(visit.T, qi[None, :], nq), axis=1).astype(jnp.int32)
  return keys, visit.sum(1), queries, visit.sum(0)


def _fwd_loop(qb, kb, vb, sqb, skb, qidx):
  """Online softmax over the visited key blocks of every query block, its own block first.

  With the query's own block first each row's running max is finite from the start, so masked
  scores (NEG_INF) exponentiate to exactly 0 without a second select. A padding query sees no key:
  its output is set to 0 and its log-sum-exp to 0, so that the backward's exp(NEG_INF - lse) is 0.
  Returns o [nq,b,h,bs,dv] in v's dtype, the log-sum-exp and the row max [nq, b, h, bs] (float32).
  """
  _, b, h, bs, _ = qb.shape
  dv = vb.shape[-1]
  keys, n_keys, _, _ = _visit_plan(sqb, skb, qidx)

  def q_block(i):
    q = qb[i]

    def step(t, carry):
      m, l, acc = carry
      j = keys[i, t]
      s = jnp.einsum("bhqd,bhkd->bhqk", q, kb[j], preferred_element_type=jnp.float32)
      s = jnp.where(_block_mask(sqb[i], skb[j], qidx[i], j, bs), s, NEG_INF)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      alpha = jnp.exp(m - m_new)
      pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(vb.dtype), vb[j],
                      preferred_element_type=jnp.float32)
      return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    init = (jnp.full((b, h, bs), NEG_INF, jnp.float32), jnp.zeros((b, h, bs), jnp.float32),
            jnp.zeros((b, h, bs, dv), jnp.float32))
    init = tuple(_vary(x, qb, kb, vb, sqb, skb, qidx) for x in init)
    m, l, acc = jax.lax.fori_loop(0, n_keys[i], step, init)
    l = jnp.maximum(l, jnp.finfo(jnp.float32).tiny)  # the own block makes l >= 1; guard anyway
    valid = (sqb[i] > 0)[:, None]  # [b, 1, bs]
    o = jnp.where(valid[..., None], acc / l[..., None], 0.0)
    return o.astype(vb.dtype), jnp.where(valid, m + jnp.log(l), 0.0), m

  return jax.lax.map(q_block, jnp.arange(qb.shape[0]))


def _bwd_loop(qb, kb, vb, sqb, skb, qidx, ob, lse, dob):
  """One pass over (key block j, visited query block i): dk_j and dv_j accumulate in the inner
  loop, dq in a float32 buffer updated in place; scores are recomputed from the log-sum-exp."""
  _, b, h, bs, dk = qb.shape
  delta = jnp.einsum("nbhqd,nbhqd->nbhq", ob.astype(jnp.float32), dob.astype(jnp.float32))
  _, _, queries, n_queries = _visit_plan(sqb, skb, qidx)

  def k_block(j, carry):
    dq, dkb, dvb = carry
    k, v = kb[j], vb[j]

    def step(t, inner):
      dq, dk_j, dv_j = inner
      i = queries[j, t]
      q, do = qb[i], dob[i]
      s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
      mask = _block_mask(sqb[i], skb[j], qidx[i], j, bs)
      p = jnp.exp(jnp.where(mask, s, NEG_INF) - lse[i][..., None])
      dv_j = dv_j + jnp.einsum("bhqk,bhqd->bhkd", p.astype(do.dtype), do,
                               preferred_element_type=jnp.float32)
      dp = jnp.einsum("bhqd,bhkd->bhqk", do, v, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta[i][..., None])).astype(q.dtype)
      dk_j = dk_j + jnp.einsum("bhqk,bhqd->bhkd", ds, q, preferred_element_type=jnp.float32)
      dq_i = jnp.einsum("bhqk,bhkd->bhqd", ds, k, preferred_element_type=jnp.float32)
      return dq.at[i].add(dq_i), dk_j, dv_j

    init = (dq, jnp.zeros((b, h, bs, dk), jnp.float32), jnp.zeros((b, h, bs, vb.shape[-1]), jnp.float32))
    init = tuple(_vary(x, qb, kb, vb, sqb, skb, qidx, dob) for x in init)
    dq, dk_j, dv_j = jax.lax.fori_loop(0, n_queries[j], step, init)
    return dq, dkb.at[j].set(dk_j), dvb.at[j].set(dv_j)

  zeros = lambda x: _vary(jnp.zeros(x.shape, jnp.float32), qb, kb, vb, sqb, skb, qidx, dob)
  dq, dkb, dvb = jax.lax.fori_loop(0, kb.shape[0], k_block, (zeros(qb), zeros(kb), zeros(vb)))
  return dq.astype(qb.dtype), dkb.astype(kb.dtype), dvb.astype(vb.dtype)


def _by_rows(loop, rows, *blocked):
  """``loop(*blocked)`` run per group of ``rows`` batch rows, each group with its own visit plan:
  blocked arrays are [n, b, ...] and so are the results. Rows are independent, so this is exact;
  it saves the pairs that only other groups' rows need."""
  b = blocked[0].shape[1]
  if rows >= b:
    return loop(*blocked)
  split = lambda x: x.reshape((x.shape[0], b // rows, rows) + x.shape[2:]).swapaxes(0, 1)
  merge = lambda x: x.swapaxes(0, 1).reshape((x.shape[1], b) + x.shape[3:])
  out = jax.lax.map(lambda xs: loop(*xs), tuple(split(x) for x in blocked))
  return tuple(merge(x) for x in out)


def rows_per_plan(b: int, rows: int) -> int:
  """The largest divisor of the batch b that is at most ``rows`` (>= 1): the rows a plan covers."""
  rows = max(1, min(rows, b))
  while b % rows:
    rows -= 1
  return rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(qb, kb, vb, sqb, skb, qidx, rows):
  o, _, m = _by_rows(lambda *a: _fwd_loop(*a, qidx), rows, qb, kb, vb, sqb, skb)
  return o, m


def _flash_fwd(qb, kb, vb, sqb, skb, qidx, rows):
  o, lse, m = _by_rows(lambda *a: _fwd_loop(*a, qidx), rows, qb, kb, vb, sqb, skb)
  return (o, m), (qb, kb, vb, sqb, skb, qidx, o, lse)


def _flash_bwd(rows, res, g):
  qb, kb, vb, sqb, skb, qidx, o, lse = res
  do, _ = g  # the row max is a statistic (QK-clip), not differentiated
  bwd = lambda qb, kb, vb, sqb, skb, o, lse, do: _bwd_loop(qb, kb, vb, sqb, skb, qidx, o, lse, do)
  dq, dk, dv = _by_rows(bwd, rows, qb, kb, vb, sqb, skb, o, lse, do)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _to_blocks(x, nb, bs):
  """[b, s, h, d] -> [nb, b, h, bs, d], the sequence zero-padded to nb * bs."""
  b, s, h, d = x.shape
  x = jnp.pad(x, ((0, 0), (0, nb * bs - s), (0, 0), (0, 0)))
  return x.reshape(b, nb, bs, h, d).transpose(1, 0, 3, 2, 4)


def _seg_blocks(seg, b, s, nb, bs):
  seg = jnp.ones((b, s), jnp.int32) if seg is None else seg.astype(jnp.int32)
  # padded keys sit after every real query (causally invisible); padded queries are dropped
  seg = jnp.pad(seg, ((0, 0), (0, nb * bs - s)), constant_values=-1)
  return seg.reshape(b, nb, bs).transpose(1, 0, 2)


def blockwise_attention(q, k, v, seg, scale, block=512, with_max_logit=False, rows=None):
  """Flash-style attention in pure JAX; see the module docstring. ``block`` positions per block;
  ``rows`` batch rows per visit plan (``rows_per_plan``; None = the whole batch).

  A sequence that fits one block is one block of scores: the dense product, without the loops.
  """
  b, s, h, _ = q.shape
  if s <= block:
    return dense_attention(q, k, v, seg, scale, with_max_logit)
  bs = block
  nb = -(-s // bs)
  q = q * jnp.asarray(scale, q.dtype)
  sb = _seg_blocks(seg, b, s, nb, bs)
  o, m = _flash(_to_blocks(q, nb, bs), _to_blocks(k, nb, bs), _to_blocks(v, nb, bs), sb, sb,
                jnp.arange(nb, dtype=jnp.int32), rows_per_plan(b, rows or b))
  o = o.transpose(1, 0, 3, 2, 4).reshape(b, nb * bs, h, -1)[:, :s]
  if not with_max_logit:
    return o, None
  m = m.transpose(1, 2, 0, 3).reshape(b, h, nb * bs)[:, :, :s]
  return o, jax.lax.stop_gradient(m.max(axis=(0, 2)))


def blockwise_core(q, k, v, q_seg, k_seg, q_block_idx, block, rows=None):
  """The blockwise kernel for queries at given places in the key sequence (context parallelism).

  q [b, nq*block, h, dk] (scale already applied), k [b, nk*block, h, dk], v [b, nk*block, h, dv];
  q_seg [b, nq*block], k_seg [b, nk*block]; q_block_idx [nq] int32: the key block each query block
  coincides with (causality by index); ``rows`` as in ``blockwise_attention``. Returns
  (o [b, nq*block, h, dv], per-head max logit [h]).
  """
  b, lq, h, _ = q.shape
  nq, nk = lq // block, k.shape[1] // block
  seg_blocks = lambda sg, n: sg.astype(jnp.int32).reshape(b, n, block).transpose(1, 0, 2)
  o, m = _flash(_to_blocks(q, nq, block), _to_blocks(k, nk, block), _to_blocks(v, nk, block),
                seg_blocks(q_seg, nq), seg_blocks(k_seg, nk), q_block_idx.astype(jnp.int32),
                rows_per_plan(b, rows or b))
  o = o.transpose(1, 0, 3, 2, 4).reshape(b, lq, h, -1)
  return o, jax.lax.stop_gradient(m.max(axis=(0, 1, 3)))


def max_logit(q, k, seg, scale, block=512):
  """Per-head max of the masked, scaled logits [h], block by block (no P.V, no gradient)."""
  b, s, h, _ = q.shape
  bs = min(block, s)
  nb = -(-s // bs)
  qb = _to_blocks(jax.lax.stop_gradient(q) * jnp.asarray(scale, q.dtype), nb, bs)
  kb = _to_blocks(jax.lax.stop_gradient(k), nb, bs)
  sb = _seg_blocks(seg, b, s, nb, bs)
  keys, n_keys, _, _ = _visit_plan(sb, sb, jnp.arange(nb))

  def q_block(i):
    def step(t, m):
      j = keys[i, t]
      sc = jnp.einsum("bhqd,bhkd->bhqk", qb[i], kb[j], preferred_element_type=jnp.float32)
      mask = _block_mask(sb[i], sb[j], i, j, bs)
      return jnp.maximum(m, jnp.where(mask, sc, NEG_INF).max(axis=(0, 2, 3)))
    return jax.lax.fori_loop(0, n_keys[i], step, jnp.full((h,), NEG_INF, jnp.float32))

  return jax.lax.map(q_block, jnp.arange(nb)).max(0)


# --------------------------------------------------------------------------------------------------
# Maintained kernels (TPU splash, GPU Pallas/Triton, cuDNN)
# --------------------------------------------------------------------------------------------------


def _kernel_block(s: int, block: int) -> int | None:
  """A block size the kernels take for sequence length s (a multiple of 128 dividing s), else None."""
  bs = min(block, s) // 128 * 128
  while bs >= 128 and s % bs:
    bs -= 128
  return bs if bs >= 128 else None


def splash(q, k, v, seg, scale, block=512, interpret=False):
  """TPU splash attention; q, k [b,s,h,dk], v [b,s,h,dv] -> [b,s,h,dv]. dk != dv is supported."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  b, s, h, _ = q.shape
  bs = _kernel_block(s, block)
  if bs is None:
    raise ValueError(f"model.attention_impl=splash needs a sequence length that is a multiple of "
                     f"128 (got {s}); use attention_impl=blockwise or auto")
  sizes = sa.BlockSizes(block_q=bs, block_kv=bs, block_kv_compute=bs, block_q_dkv=bs,
                        block_kv_dkv=bs, block_kv_dkv_compute=bs, block_q_dq=bs, block_kv_dq=bs)
  mask = sa.MultiHeadMask([sa.CausalMask((s, s))] * h)
  kernel = sa.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                              interpret=interpret)
  seg = jnp.ones((b, s), jnp.int32) if seg is None else seg.astype(jnp.int32)
  t = lambda x: jnp.swapaxes(x, 1, 2)  # [b, h, s, d]
  q = q * jnp.asarray(scale, q.dtype)
  one = lambda q, k, v, sg: kernel(q, k, v, segment_ids=sa.SegmentIds(q=sg, kv=sg))
  return t(jax.vmap(one)(t(q), t(k), t(v), seg))


def pallas_gpu(q, k, v, seg, scale, block=128, interpret=False):
  """JAX's Pallas (Triton) flash attention with segment ids; v zero-padded to q's head dim."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention
  s, dk, dv = q.shape[1], q.shape[-1], v.shape[-1]
  # the kernel pads heads to a power of two and keeps q plus num_stages (2) k and v tiles in shared
  # memory: at 256 (MLA's 192) 128-row tiles ask for 320 KB, over the H100/H200's 227 KB
  if dk > 128:
    block = min(block, 64)
  if s < 128:
    bq = min(block, s)
  else:
    bq = _kernel_block(s, block) if block >= 128 else (block if s % 128 == 0 else None)
  if bq is None or s % bq:
    raise ValueError(f"model.attention_impl=pallas_gpu needs a sequence length below 128 or a "
                     f"multiple of 128 (got {s}); use attention_impl=blockwise or auto")
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dk - dv))) if dv < dk else v
  sizes = gpu_attention.BlockSizes(block_q=bq, block_k=bq, block_q_dkv=min(32, bq),
                                   block_kv_dkv=min(32, bq), block_q_dq=min(32, bq),
                                   block_kv_dq=min(32, bq))
  o = gpu_attention.mha(q, k, vp.astype(q.dtype), None if seg is None else seg.astype(jnp.int32),
                        sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret)
  return o[..., :dv].astype(v.dtype)


def cudnn(q, k, v, seg, scale):
  """cuDNN flash attention through jax.nn; causal only (no segment ids), v padded to dk."""
  if seg is not None:
    raise ValueError("model.attention_impl=cudnn cannot take packed segment ids (jax.nn's cuDNN "
                     "path has no segment input); use attention_impl=pallas_gpu or auto")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"model.attention_impl=cudnn needs 16-bit inputs (got {q.dtype}): set "
                     f"model.compute_dtype=bfloat16, or use attention_impl=auto or blockwise")
  dk, dv = q.shape[-1], v.shape[-1]
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dk - dv))) if dv < dk else v
  o = jax.nn.dot_product_attention(q, k, vp.astype(k.dtype), scale=scale, is_causal=True,
                                   implementation="cudnn")
  return o[..., :dv].astype(v.dtype)


def _per_shard(fn, q, k, v, seg):
  """Run a kernel per (batch, head) shard of the active mesh: XLA cannot partition a custom call,
  so without this a sharded batch would be gathered onto every device first.

  The Pallas kernels declare no varying-axes types, so the shard_map runs with check_vma=False;
  that is only sound when every mesh axis of size > 1 shards the batch or the heads (no replicated
  input whose gradient would need a psum). Otherwise the kernel is called unsharded.
  """
  mesh, rules = active()
  if mesh is None or mesh.size == 1:
    return fn(q, k, v, seg)
  spec = spec_for(("act_batch", None, "act_heads", None), q.shape, mesh, rules, what="attention",
                  strict=False)
  used = {a for e in (spec[0], spec[2]) for a in (e if isinstance(e, tuple) else (e,)) if a}
  if any(n > 1 and a not in used for a, n in mesh.shape.items()):
    return fn(q, k, v, seg)
  b, s = q.shape[:2]
  seg = jnp.ones((b, s), jnp.int32) if seg is None else seg.astype(jnp.int32)
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, P(spec[0], None)),
                       out_specs=spec, check_vma=False)(q, k, v, seg)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def resolve_impl(impl: str, s: int, backend: str | None = None, packed: bool = True,
                 head_dim: int = 192, dtype=jnp.bfloat16) -> str:
  """The implementation ``impl`` means for sequence length s on ``backend`` (default: JAX's).

  On GPU an unpacked batch (no segment ids) goes to cuDNN: on an H200 at K2's head dims it ran
  fwd+bwd at 3.6x the Pallas kernel at 32K (274 vs 76 TFLOP/s, experiments/results/attention_gpu.json).
  float32 inputs on GPU stay on blockwise: on an H100 the float32 tiny config's prefill failed in
  cuDNN ("Q must be fp16/bf16/fp8"), and the Triton kernel's dots would run in TF32.
  """
  if impl not in IMPLS:
    raise ValueError(f"model.attention_impl={impl!r}: use one of {list(IMPLS)}")
  if impl != "auto":
    return impl
  backend = backend or jax.default_backend()
  if backend == "tpu" and s % 128 == 0:
    return "splash"
  if backend == "gpu" and jnp.dtype(dtype).itemsize > 2:
    return "blockwise"
  if backend == "gpu" and not packed and head_dim % 8 == 0 and head_dim <= 256:
    return "cudnn"
  if backend == "gpu" and (s < 128 or s % 128 == 0):
    return "pallas_gpu"
  return "blockwise"


def attention(q, k, v, segment_ids=None, *, scale: float, impl: str = "auto", block: int = 512,
              with_max_logit: bool = False, rows: int | None = None):
  """Causal, segment-masked attention: q, k [b,s,h,dk], v [b,s,h,dv], segment_ids [b,s] or None.

  Returns (o [b,s,h,dv] in v's dtype, per-head max logit [h] float32 or None). ``block`` is the
  blockwise/kernel tile along the sequence, ``rows`` the batch rows per blockwise visit plan.
  """
  s = q.shape[1]
  impl = resolve_impl(impl, s, packed=segment_ids is not None, head_dim=q.shape[-1], dtype=q.dtype)
  if impl == "dense":
    return dense_attention(q, k, v, segment_ids, scale, with_max_logit)
  if impl == "blockwise":
    return blockwise_attention(q, k, v, segment_ids, scale, block, with_max_logit, rows)
  if impl == "splash":
    # TPU tiles of at least 512 rows: the kernel's sweet spot, where CPU prefers small blocks
    fn = lambda q, k, v, sg: splash(q, k, v, sg, scale, max(block, 512))
  elif impl == "pallas_gpu":
    fn = lambda q, k, v, sg: pallas_gpu(q, k, v, sg, scale, min(block, 128))
  else:
    return (cudnn(q, k, v, segment_ids, scale),
            max_logit(q, k, segment_ids, scale, block) if with_max_logit else None)
  o = _per_shard(fn, q, k, v, segment_ids)
  if segment_ids is not None:  # the kernels attend within the padding: zero it, as dense does
    o = o * (segment_ids != 0)[:, :, None, None].astype(o.dtype)
  return o, (max_logit(q, k, segment_ids, scale, block) if with_max_logit else None)

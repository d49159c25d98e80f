"""Grouped matmul Pallas kernels for GPU (Triton lowering), also run in interpret mode on CPU.

Operands are in the block layout (gmm_layout): grid row b is one block of ``block_rows`` rows owned
by group ``block_group[b]``, whose weight tile the kernel reads straight from the full rhs array.
Triton has no scalar-prefetch grid, so the group id is a scalar load inside the kernel and the K loop
is an in-kernel fori_loop with a float32 accumulator.

Every pallas_call passes Triton compiler params: that is what selects the Triton lowering (the GPU
default is Mosaic GPU). tests/kernels/test_lowering.py lowers each kernel for CUDA on a CPU machine.

On one H200 (experiments/results/kernels_gmm_gpu.json; 16384 rows, k 7168, n 2048, 8-48 experts):
the bf16 product alone runs at 280-387 TFLOP/s (the whole gmm() call 213-260, ragged_dot 16-95); the
FP8 block product alone at 214-233 (0.60-0.76x bf16; likely the per-128-k scale multiply and float32
accumulate run on CUDA cores between tensor-core dots), so FP8 is not yet faster than bf16 here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def pick_tile(dim: int, preferred: int = 128) -> int:
  """Largest power-of-two tile <= preferred dividing dim (Triton dots need >= 16), else dim."""
  t = preferred
  while t >= 16:
    if dim % t == 0:
      return t
    t //= 2
  return dim


# Hopper has 227 KB of shared memory per block; keep the pipelined operand tiles well inside it
_SMEM_BUDGET = 192 * 1024


def triton_params(stage_bytes: int, num_warps: int = 4):
  """Explicit Triton params: without them pallas_call on GPU picks the Mosaic GPU backend, which
  stages every BlockSpec'd operand (the full weight array) in shared memory. ``stage_bytes``: the
  operand tiles one K step loads; Triton's software pipeline keeps ``num_stages`` of them in
  shared memory."""
  stages = max(1, min(4, _SMEM_BUDGET // max(stage_bytes, 1)))
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=stages)


def _tile_for(dim: int, *dtypes) -> int:
  """128-wide tiles for <= 16-bit operands, 64 for float32 (so a pipeline stage stays <= 64 KB)."""
  wide = max(jnp.dtype(d).itemsize for d in dtypes)
  return pick_tile(dim, 128 if wide <= 2 else 64)


def _check_pow2(what: str, interpret: bool, **dims):
  """Triton loads only power-of-two tiles (interpret mode takes any shape)."""
  bad = {k: v for k, v in dims.items() if v & (v - 1)}
  if bad and not interpret:
    raise ValueError(f"{what}: Triton needs power-of-two tiles, got {bad}; pad k / n to a multiple "
                     "of 16 and use a power-of-two block_rows (or impl='xla' / 'sorted')")


def _common(a, b):
  """Triton dots need both operands in one dtype (XLA would promote a mixed bf16 x f32 product)."""
  dt = jnp.promote_types(a.dtype, b.dtype)
  return a.astype(dt), b.astype(dt)


def _full(shape):
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _gmm_kernel(gid_ref, gbs_ref, x_ref, w_ref, o_ref, *, nk, bk, bn, transpose_rhs):
  b, j = pl.program_id(0), pl.program_id(1)
  used = gbs_ref[gbs_ref.shape[0] - 1]

  @pl.when(b < used)
  def _compute():
    grp = gid_ref[b]

    def body(kk, acc):
      x = x_ref[:, pl.ds(kk * bk, bk)]
      if transpose_rhs:
        x, w = _common(x, w_ref[grp, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)])
        d = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      else:
        x, w = _common(x, w_ref[grp, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)])
        d = jnp.dot(x, w, preferred_element_type=jnp.float32)
      return acc + d

    acc = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)

  @pl.when(b >= used)
  def _skip():  # trailing padding blocks: never read back, but keep them defined
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def gmm_blocks(xp, rhs, layout, block_rows: int, *, transpose_rhs: bool = False, out_dtype=None,
               interpret: bool = False, num_warps: int = 4):
  """xp[nb*bm, k] @ rhs[block_group[b]] per block -> [nb*bm, n] (rhs [g,k,n], or [g,n,k] transposed)."""
  mp, k = xp.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  nb = mp // block_rows
  bk, bn = _tile_for(k, xp.dtype, rhs.dtype), _tile_for(n, xp.dtype, rhs.dtype)
  _check_pow2("gmm (Pallas GPU)", interpret, block_rows=block_rows, bk=bk, bn=bn)
  wide = max(xp.dtype.itemsize, rhs.dtype.itemsize)
  kernel = functools.partial(_gmm_kernel, nk=k // bk, bk=bk, bn=bn, transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype or xp.dtype),
      grid=(nb, n // bn),
      in_specs=[
          _full(layout.block_group.shape),
          _full(layout.group_block_start.shape),
          pl.BlockSpec((block_rows, k), lambda b, j: (b, 0)),
          _full(rhs.shape),
      ],
      out_specs=pl.BlockSpec((block_rows, bn), lambda b, j: (b, j)),
      compiler_params=triton_params((block_rows + bn) * bk * wide, num_warps),
      interpret=interpret,
      name="gmm_gpu",
  )(layout.block_group, layout.group_block_start, xp, rhs)


def _tgmm_kernel(gbs_ref, x_ref, g_ref, o_ref, *, bm, bk, bn):
  grp, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  def body(b, acc):
    x = x_ref[pl.ds(b * bm, bm), pl.ds(i * bk, bk)]
    x, gr = _common(x, g_ref[pl.ds(b * bm, bm), pl.ds(j * bn, bn)])
    return acc + lax.dot_general(x, gr, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  # the group's blocks are contiguous; an empty group runs zero iterations and stores zeros
  acc = lax.fori_loop(gbs_ref[grp], gbs_ref[grp + 1], body, jnp.zeros((bk, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def tgmm_blocks(xp, gp, layout, block_rows: int, num_groups: int, *, out_dtype=None,
                interpret: bool = False):
  """Per-group xp^T @ gp -> [g, k, n]."""
  k = xp.shape[1]
  n = gp.shape[1]
  bk, bn = _tile_for(k, xp.dtype, gp.dtype), _tile_for(n, xp.dtype, gp.dtype)
  _check_pow2("tgmm (Pallas GPU)", interpret, block_rows=block_rows, bk=bk, bn=bn)
  wide = max(xp.dtype.itemsize, gp.dtype.itemsize)
  kernel = functools.partial(_tgmm_kernel, bm=block_rows, bk=bk, bn=bn)
  gbs = layout.group_block_start[:num_groups + 1]
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype or xp.dtype),
      grid=(num_groups, k // bk, n // bn),
      in_specs=[_full(gbs.shape), _full(xp.shape), _full(gp.shape)],
      out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
      compiler_params=triton_params(block_rows * (bk + bn) * wide),
      interpret=interpret,
      name="tgmm_gpu",
  )(gbs, xp, gp)


def _gmm_fp8_kernel(gid_ref, gbs_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref, *, nk, sb, bn, cb,
                    transpose_rhs):
  b, j = pl.program_id(0), pl.program_id(1)
  used = gbs_ref[gbs_ref.shape[0] - 1]

  @pl.when(b < used)
  def _compute():
    grp = gid_ref[b]

    def body(kk, acc):
      x = x_ref[:, pl.ds(kk * sb, sb)]  # FP8 [bm, sb]: one scale block along k
      sx = xs_ref[:, pl.ds(kk, 1)]  # [bm, 1] float32: the rows' scales for this k block
      # [1, bn/cb]: one scale per cb output columns (a 128x128 tile's scalar, or MX's per column)
      sw = ws_ref[grp, pl.ds(kk, 1), pl.ds(j * (bn // cb), bn // cb)]
      if transpose_rhs:
        w = w_ref[grp, pl.ds(j * bn, bn), pl.ds(kk * sb, sb)]
        dims = (((1,), (1,)), ((), ()))
      else:
        w = w_ref[grp, pl.ds(kk * sb, sb), pl.ds(j * bn, bn)]
        dims = (((1,), (0,)), ((), ()))
      if x.dtype != w.dtype:
        # Pallas' Triton lowering needs one operand type (no E5M2 x E4M3 dot): float16 holds every
        # E4M3 and E5M2 value exactly, so the products are unchanged (16-bit tensor cores, not FP8)
        x, w = x.astype(jnp.float16), w.astype(jnp.float16)
      d = lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
      # the tensor-core product of one scale block, promoted to float32 with both scales (powers of
      # two for MXFP8, so this is exact and only the accumulation order differs from dequantizing)
      return acc + d * sx * sw

    acc = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)

  @pl.when(b >= used)
  def _skip():
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def gmm_fp8_blocks(xq, xs, wq, ws, layout, block_rows: int, *, transpose_rhs: bool = False,
                   out_dtype=jnp.float32, interpret: bool = False, num_warps: int = 4):
  """Block-scaled FP8 product: xq [nb*bm, k] (E4M3 or E5M2) with float32 row scales xs
  [nb*bm, k/sb], wq [g, k, n] (or [g, n, k] with ``transpose_rhs``) with float32 scales ws on wq's
  axes, the contraction axis divided by sb and the output axis by cb.

  * Hopper fp8_block: sb = 128, cb = 128 (1x128 activation scales, 128x128 weight tiles).
  * MXFP8: sb = 32, cb = 1 (E8M0 scales per 32 along k for every output column, decoded to float32).

  The k loop steps one scale block at a time: a k=32 FP8 dot is one Hopper wgmma k-step.
  """
  mp, k = xq.shape
  n = wq.shape[1] if transpose_rhs else wq.shape[2]
  if xs.shape[1] == 0 or k % xs.shape[1]:
    raise ValueError(f"gmm fp8 (Pallas GPU): row scales {xs.shape} do not block k={k}")
  sb = k // xs.shape[1]
  if transpose_rhs:  # the kernel reads rhs scales as [g, k blocks, n blocks]
    ws = jnp.swapaxes(ws, 1, 2)
  if ws.shape[1] != k // sb or n % ws.shape[2]:
    raise ValueError(f"gmm fp8 (Pallas GPU): rhs scales {ws.shape} do not match k={k} / "
                     f"{sb} and n={n}")
  cb = n // ws.shape[2]
  bn = max(pick_tile(n, 128), cb)
  if n % bn or bn % cb or sb < 16:
    raise ValueError(f"gmm fp8 (Pallas GPU): n={n} needs tiles of whole {cb}-column scale blocks "
                     f"and the k scale block ({sb}) must be >= 16 (a Triton dot's minimum k)")
  _check_pow2("gmm fp8 (Pallas GPU)", interpret, block_rows=block_rows, sb=sb, bn=bn)
  kernel = functools.partial(_gmm_fp8_kernel, nk=k // sb, sb=sb, bn=bn, cb=cb,
                             transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
      grid=(mp // block_rows, n // bn),
      in_specs=[
          _full(layout.block_group.shape),
          _full(layout.group_block_start.shape),
          pl.BlockSpec((block_rows, k), lambda b, j: (b, 0)),
          pl.BlockSpec((block_rows, k // sb), lambda b, j: (b, 0)),
          _full(wq.shape),
          _full(ws.shape),
      ],
      out_specs=pl.BlockSpec((block_rows, bn), lambda b, j: (b, j)),
      compiler_params=triton_params((block_rows + bn) * sb, num_warps),  # 1-byte FP8 tiles
      interpret=interpret,
      name="gmm_fp8_gpu",
  )(layout.block_group, layout.group_block_start, xq, xs, wq, ws)

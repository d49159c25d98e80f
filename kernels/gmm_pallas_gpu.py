"""Grouped matmul Pallas kernels for GPU (Triton lowering), also run in interpret mode on CPU.

Operands are in the block layout (gmm_layout): grid row b is one block of ``block_rows`` rows owned
by group ``block_group[b]``, whose weight tile the kernel reads straight from the full rhs array.
Triton has no scalar-prefetch grid, so the group id is a scalar load inside the kernel and the K loop
is an in-kernel fori_loop with a float32 accumulator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def pick_tile(dim: int, preferred: int = 128) -> int:
  """Largest power-of-two tile <= preferred dividing dim (Triton dots need >= 16), else dim."""
  t = preferred
  while t >= 16:
    if dim % t == 0:
      return t
    t //= 2
  return dim


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
        w = w_ref[grp, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)]
        d = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      else:
        w = w_ref[grp, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)]
        d = jnp.dot(x, w, preferred_element_type=jnp.float32)
      return acc + d

    acc = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)

  @pl.when(b >= used)
  def _skip():  # trailing padding blocks: never read back, but keep them defined
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def gmm_blocks(xp, rhs, layout, block_rows: int, *, transpose_rhs: bool = False, out_dtype=None,
               interpret: bool = False):
  """xp[nb*bm, k] @ rhs[block_group[b]] per block -> [nb*bm, n] (rhs [g,k,n], or [g,n,k] transposed)."""
  mp, k = xp.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  nb = mp // block_rows
  bk, bn = pick_tile(k), pick_tile(n)
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
      interpret=interpret,
      name="gmm_gpu",
  )(layout.block_group, layout.group_block_start, xp, rhs)


def _tgmm_kernel(gbs_ref, x_ref, g_ref, o_ref, *, bm, bk, bn):
  grp, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  def body(b, acc):
    x = x_ref[pl.ds(b * bm, bm), pl.ds(i * bk, bk)]
    gr = g_ref[pl.ds(b * bm, bm), pl.ds(j * bn, bn)]
    return acc + lax.dot_general(x, gr, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  # the group's blocks are contiguous; an empty group runs zero iterations and stores zeros
  acc = lax.fori_loop(gbs_ref[grp], gbs_ref[grp + 1], body, jnp.zeros((bk, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def tgmm_blocks(xp, gp, layout, block_rows: int, num_groups: int, *, out_dtype=None,
                interpret: bool = False):
  """Per-group xp^T @ gp -> [g, k, n]."""
  k = xp.shape[1]
  n = gp.shape[1]
  bk, bn = pick_tile(k), pick_tile(n)
  kernel = functools.partial(_tgmm_kernel, bm=block_rows, bk=bk, bn=bn)
  gbs = layout.group_block_start[:num_groups + 1]
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype or xp.dtype),
      grid=(num_groups, k // bk, n // bn),
      in_specs=[_full(gbs.shape), _full(xp.shape), _full(gp.shape)],
      out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
      interpret=interpret,
      name="tgmm_gpu",
  )(gbs, xp, gp)


def _gmm_fp8_kernel(gid_ref, gbs_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref, *, nk, bk, bn,
                    transpose_rhs):
  b, j = pl.program_id(0), pl.program_id(1)
  used = gbs_ref[gbs_ref.shape[0] - 1]

  @pl.when(b < used)
  def _compute():
    grp = gid_ref[b]

    def body(kk, acc):
      x = x_ref[:, pl.ds(kk * bk, bk)]  # E4M3 [bm, 128]
      sx = xs_ref[:, pl.ds(kk, 1)]  # [bm, 1] float32: one scale per row per 128 of k
      if transpose_rhs:
        w = w_ref[grp, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)]
        sw = ws_ref[grp, pl.ds(j, 1), pl.ds(kk, 1)]
        d = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      else:
        w = w_ref[grp, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)]
        sw = ws_ref[grp, pl.ds(kk, 1), pl.ds(j, 1)]  # [1, 1]: the 128x128 weight tile's scale
        d = jnp.dot(x, w, preferred_element_type=jnp.float32)
      # FP8 tensor-core product per 128-wide k slice, promoted to float32 with both scales
      return acc + d * sx * sw

    acc = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)

  @pl.when(b >= used)
  def _skip():
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def gmm_fp8_blocks(xq, xs, wq, ws, layout, block_rows: int, *, transpose_rhs: bool = False,
                   out_dtype=jnp.float32, interpret: bool = False):
  """Hopper FP8 recipe: xq E4M3 [nb*bm, k] with xs float32 [nb*bm, k/128] (1x128 scales), wq E4M3
  [g, k, n] (or [g, n, k] with ``transpose_rhs``) with ws float32 128x128-tile scales."""
  mp, k = xq.shape
  n = wq.shape[1] if transpose_rhs else wq.shape[2]
  bk = bn = 128
  kernel = functools.partial(_gmm_fp8_kernel, nk=k // bk, bk=bk, bn=bn, transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
      grid=(mp // block_rows, n // bn),
      in_specs=[
          _full(layout.block_group.shape),
          _full(layout.group_block_start.shape),
          pl.BlockSpec((block_rows, k), lambda b, j: (b, 0)),
          pl.BlockSpec((block_rows, k // bk), lambda b, j: (b, 0)),
          _full(wq.shape),
          _full(ws.shape),
      ],
      out_specs=pl.BlockSpec((block_rows, bn), lambda b, j: (b, j)),
      interpret=interpret,
      name="gmm_fp8_gpu",
  )(layout.block_group, layout.group_block_start, xq, xs, wq, ws)

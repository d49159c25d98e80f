"""Grouped matmul Pallas kernels for TPU (Mosaic), checked on CPU in TPU interpret mode.

The block layout's group ids are scalar-prefetched into SMEM so the BlockSpec index maps can pick
each block's weight tile; the pipeline then DMAs exactly the tiles a block needs. K (or the token
blocks, for the weight gradient) is the innermost, "arbitrary" grid axis accumulating in VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from composer_jax.kernels.gmm_pallas_gpu import pick_tile
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _interpret(interpret: bool):
  return pltpu.InterpretParams() if interpret else False


def _gmm_kernel(bg_ref, gbs_ref, x_ref, w_ref, o_ref, acc_ref, *, nk, transpose_rhs):
  b, kk = pl.program_id(0), pl.program_id(2)

  @pl.when(kk == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(b < gbs_ref[gbs_ref.shape[0] - 1])  # trailing padding blocks do no work
  def _acc():
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    acc_ref[...] += lax.dot_general(x_ref[...], w_ref[...], dims,
                                    preferred_element_type=jnp.float32)

  @pl.when(kk == nk - 1)
  def _store():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def gmm_blocks(xp, rhs, layout, block_rows: int, *, transpose_rhs: bool = False, out_dtype=None,
               interpret: bool = False):
  mp, k = xp.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  nb = mp // block_rows
  bk, bn = pick_tile(k), pick_tile(n)
  if transpose_rhs:
    w_spec = pl.BlockSpec((None, bn, bk), lambda b, j, kk, bg, gbs: (bg[b], j, kk))
  else:
    w_spec = pl.BlockSpec((None, bk, bn), lambda b, j, kk, bg, gbs: (bg[b], kk, j))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(nb, n // bn, k // bk),
      in_specs=[pl.BlockSpec((block_rows, bk), lambda b, j, kk, bg, gbs: (b, kk)), w_spec],
      out_specs=pl.BlockSpec((block_rows, bn), lambda b, j, kk, bg, gbs: (b, j)),
      scratch_shapes=[pltpu.VMEM((block_rows, bn), jnp.float32)],
  )
  kernel = functools.partial(_gmm_kernel, nk=k // bk, transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype or xp.dtype),
      grid_spec=grid_spec,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=_interpret(interpret),
      name="gmm_tpu",
  )(layout.block_group, layout.group_block_start, xp, rhs)


def _tgmm_kernel(bg_ref, gbs_ref, x_ref, g_ref, o_ref, acc_ref, *, nb):
  b = pl.program_id(2)
  grp = bg_ref[b]
  first = (b == 0) | (grp != bg_ref[jnp.maximum(b - 1, 0)])
  last = (b == nb - 1) | (grp != bg_ref[jnp.minimum(b + 1, nb - 1)])

  @pl.when(first)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  acc_ref[...] += lax.dot_general(x_ref[...], g_ref[...], (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)

  @pl.when(last)  # the output tile changes with the group: blocks of a group are contiguous
  def _store():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tgmm_blocks(xp, gp, layout, block_rows: int, num_groups: int, *, out_dtype=None,
                interpret: bool = False):
  mp, k = xp.shape
  n = gp.shape[1]
  nb = mp // block_rows
  bk, bn = pick_tile(k), pick_tile(n)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(k // bk, n // bn, nb),
      in_specs=[pl.BlockSpec((block_rows, bk), lambda i, j, b, bg, gbs: (b, i)),
                pl.BlockSpec((block_rows, bn), lambda i, j, b, bg, gbs: (b, j))],
      out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, b, bg, gbs: (bg[b], i, j)),
      scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
  )
  out = pl.pallas_call(
      functools.partial(_tgmm_kernel, nb=nb),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype or xp.dtype),
      grid_spec=grid_spec,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=_interpret(interpret),
      name="tgmm_tpu",
  )(layout.block_group, layout.group_block_start, xp, gp)
  # groups without blocks are never visited, so their tiles hold whatever was in memory
  has_rows = (layout.group_block_start[1:] > layout.group_block_start[:-1])[:num_groups]
  return jnp.where(has_rows[:, None, None], out, jnp.zeros((), out.dtype))

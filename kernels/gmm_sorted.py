"""CPU dropless grouped matmul on the block layout: one dense product per row block in use.

ragged_dot on XLA:CPU is a masked dense product over every group (g times the FLOPs). Here a loop
runs over the blocks actually in use (a dynamic trip count, so the static upper bound of
``m / block_rows + g`` blocks costs nothing) and each block multiplies only its own group's weight
matrix, a plain [bm, k] x [k, n] dot that XLA:CPU runs near its dense-matmul speed, written in place.
The wasted work is the padding of each group's last block (about g * block_rows / 2 rows).
"""

from __future__ import annotations

import jax.numpy as jnp
import jax
from jax import lax


def _varying_like(init, *operands):
  """Give a loop's initial carry the operands' varying mesh axes, so the loop also runs inside
  shard_map (whose type check requires carry-in and carry-out to vary over the same axes)."""
  vma = set()
  for o in jax.tree.leaves(operands):
    mat = getattr(jax.typeof(o), "manual_axis_type", None)
    vma |= set(getattr(mat, "varying", ()) or ())
  if not vma:
    return init
  return jax.tree.map(lambda a: lax.pcast(a, tuple(sorted(vma)), to="varying"), init)


def _used_blocks(layout):
  return layout.group_block_start[-1]


def gmm_blocks(xp, rhs, layout, block_rows: int, *, transpose_rhs: bool = False, out_dtype=None):
  """xp[nb*bm, k] @ rhs[group of block] -> [nb*bm, n]; ``transpose_rhs``: rhs is [g, n, k]."""
  mp = xp.shape[0]
  if transpose_rhs:  # one transpose of all experts up front, not one per block inside the loop
    rhs = jnp.swapaxes(rhs, 1, 2)
  n = rhs.shape[2]
  dims = (((1,), (0,)), ((), ()))
  out_dtype = out_dtype or xp.dtype

  def body(b, out):
    x = lax.dynamic_slice_in_dim(xp, b * block_rows, block_rows, axis=0)
    w = lax.dynamic_index_in_dim(rhs, layout.block_group[b], axis=0, keepdims=False)
    y = lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(out_dtype)
    return lax.dynamic_update_slice_in_dim(out, y, b * block_rows, axis=0)

  # rows of unused trailing blocks stay zero (never read back)
  init = _varying_like(jnp.zeros((mp, n), out_dtype), xp, rhs, layout)
  return lax.fori_loop(0, _used_blocks(layout), body, init)


def tgmm_blocks(xp, gp, layout, block_rows: int, num_groups: int, *, out_dtype=None):
  """Per-group xp^T @ gp -> [g, k, n]. A group's blocks are contiguous, so the running sum lives in
  the loop carry and is written once per group, not read-modified-written once per block."""
  k, n = xp.shape[1], gp.shape[1]
  used = _used_blocks(layout)
  bg = layout.block_group

  def body(b, carry):
    out, acc = carry
    x = lax.dynamic_slice_in_dim(xp, b * block_rows, block_rows, axis=0)
    gr = lax.dynamic_slice_in_dim(gp, b * block_rows, block_rows, axis=0)
    grp = bg[b]
    first = (b == 0) | (bg[jnp.maximum(b - 1, 0)] != grp)
    acc = jnp.where(first, 0.0, acc) + lax.dot_general(
        x, gr, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    last = (b == used - 1) | (bg[jnp.minimum(b + 1, bg.shape[0] - 1)] != grp)
    out = lax.cond(last, lambda o: lax.dynamic_update_index_in_dim(o, acc, grp, axis=0),
                   lambda o: o, out)
    return out, acc

  init = (jnp.zeros((num_groups, k, n), jnp.float32), jnp.zeros((k, n), jnp.float32))
  out, _ = lax.fori_loop(0, used, body, _varying_like(init, xp, gp, layout))
  return out.astype(out_dtype or xp.dtype)

"""Block layout for grouped matmuls: rows sorted by group are padded so that every block of
``block_rows`` rows belongs to exactly one group (dropless: nothing is cut, groups just round up).

Every backend but raw ragged_dot works on this layout: the CPU path batches one product per block,
the Pallas kernels map one grid row to one block and read that block's weight matrix, and block-scaled
quantization along the token axis never mixes two groups in one scale block.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class BlockLayout(NamedTuple):
  src: jax.Array          # [num_blocks * block_rows] source row of each padded row, m = empty
  dest: jax.Array         # [m] padded row of each source row, padded size = dropped (past the end)
  block_group: jax.Array  # [num_blocks] group owning each block (trailing unused blocks: last group)
  group_block_start: jax.Array  # [g + 1] first block of each group; last entry = blocks in use


def num_blocks(m: int, g: int, block_rows: int) -> int:
  """Static upper bound on the blocks needed: each group adds at most one partial block."""
  return -(-m // block_rows) + g


def make_layout(group_sizes, m: int, block_rows: int) -> BlockLayout:
  g = group_sizes.shape[0]
  nb = num_blocks(m, g, block_rows)
  total_rows = nb * block_rows
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)  # rows past m do not exist
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  sizes = ends - starts
  pblocks = -(-sizes // block_rows)
  pend_blocks = jnp.cumsum(pblocks)
  pstart_blocks = pend_blocks - pblocks
  group_block_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), pend_blocks]).astype(jnp.int32)

  rows = jnp.arange(m, dtype=jnp.int32)
  grp = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
  grp_c = jnp.minimum(grp, g - 1)
  dest = jnp.where(grp < g, pstart_blocks[grp_c] * block_rows + rows - starts[grp_c], total_rows)

  blocks = jnp.arange(nb, dtype=jnp.int32)
  block_group = jnp.minimum(jnp.searchsorted(pend_blocks, blocks, side="right"), g - 1)
  block_group = block_group.astype(jnp.int32)

  prow = jnp.arange(total_rows, dtype=jnp.int32)
  pgrp = block_group[prow // block_rows]
  off = prow - pstart_blocks[pgrp] * block_rows
  valid = (off >= 0) & (off < sizes[pgrp]) & (prow // block_rows < group_block_start[-1])
  src = jnp.where(valid, starts[pgrp] + off, m)
  return BlockLayout(src.astype(jnp.int32), dest.astype(jnp.int32), block_group, group_block_start)


def _vma(x) -> set:
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return set(getattr(mat, "varying", ()) or ())


def varying_like(init, *operands):
  """Give ``init`` (a loop's initial carry, an operand) the operands' varying mesh axes, so the code
  also type-checks inside shard_map (loop carry-in and carry-out must vary over the same axes)."""
  vma = set().union(*(_vma(o) for o in jax.tree.leaves(operands)))

  def lift(a):
    missing = vma - _vma(a)
    return lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a

  return jax.tree.map(lift, init) if vma else init


def _gather_rows(x, idx):
  return x.at[idx].get(mode="fill", fill_value=0)


# The gathers below are custom VJPs whose backward is a gather too (each row lands in exactly one
# place, so no scatter-add). Inside shard_map the data operand is first lifted to the index arrays'
# varying axes: the backward's cotangent varies like the indices, and the lift's own transpose (a
# psum) makes the gradient match the input again.
@jax.custom_vjp
def _permute_rows(x, take, give_back):
  """x[take] (zeros where take is out of range); the backward gathers the cotangent at give_back."""
  return _gather_rows(x, take)


def _permute_fwd(x, take, give_back):
  return _gather_rows(x, take), give_back


def _permute_bwd(give_back, ct):
  return _gather_rows(ct, give_back), None, None


_permute_rows.defvjp(_permute_fwd, _permute_bwd)


def to_blocks(x, src, dest):
  """[m, d] -> [num_blocks * block_rows, d], padding rows zero."""
  return _permute_rows(varying_like(x, x, src, dest), src, dest)


def from_blocks(xp, src, dest):
  """[num_blocks * block_rows, d] -> [m, d]; rows past the groups come back as zeros."""
  return _permute_rows(varying_like(xp, xp, src, dest), dest, src)


# --------------------------------------------------------------------------------------------------
# Top-k dispatch straight into the block layout (the MoE): tokens in, (token, slot) pairs out
# --------------------------------------------------------------------------------------------------


def pair_maps(order, inverse, layout: BlockLayout):
  """Compose the sort by expert with the block layout, for the m = T*k (token, slot) pairs.

  order / inverse: the pairs sorted by group and its inverse permutation. Returns (row_pair
  [num_blocks * block_rows]: the pair in each padded row, m = padding; pair_row [m]: the padded row
  of each pair) — the (src, dest) of ``from_blocks`` for pairs in their original order.
  """
  m = order.shape[0]
  row_pair = order.at[layout.src].get(mode="fill", fill_value=m)
  return row_pair.astype(jnp.int32), layout.dest[inverse]


def gather_tokens(x, row_pair, pair_row, k: int):
  """x[T, d] -> [num_blocks * block_rows, d]: each padded row holds the token of its pair (zeros for
  padding). One gather replaces "repeat each token k times, sort, pad"; the backward is a gather
  too (each token sums its k rows), never a scatter-add, which XLA:CPU runs slowly."""
  return _gather_tokens(varying_like(x, x, row_pair, pair_row), row_pair, pair_row, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_tokens(x, row_pair, pair_row, k):
  return _gather_rows(x, row_pair // k)  # padding: m // k = T, out of range -> zero


def _tokens_fwd(x, row_pair, pair_row, k):
  return _gather_tokens(x, row_pair, pair_row, k), (pair_row, x.shape[0])


def _tokens_bwd(k, res, ct):
  pair_row, n_tok = res
  return _gather_rows(ct, pair_row).reshape(n_tok, k, ct.shape[1]).sum(1), None, None


_gather_tokens.defvjp(_tokens_fwd, _tokens_bwd)

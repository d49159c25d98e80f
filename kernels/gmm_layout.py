"""Block layout for grouped matmuls: rows sorted by group are padded so that every block of
``block_rows`` rows belongs to exactly one group (dropless: nothing is cut, groups just round up).

Every backend but raw ragged_dot works on this layout: the CPU path batches one product per block,
the Pallas kernels map one grid row to one block and read that block's weight matrix, and block-scaled
quantization along the token axis never mixes two groups in one scale block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


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


def _gather_rows(x, idx):
  return x.at[idx].get(mode="fill", fill_value=0)


@jax.custom_vjp
def to_blocks(x, src, dest):
  """[m, d] -> [num_blocks * block_rows, d], padding rows zero. A gather both ways (no scatter)."""
  return _gather_rows(x, src)


def _to_fwd(x, src, dest):
  return _gather_rows(x, src), (src, dest)


def _to_bwd(res, ct):
  return _gather_rows(ct, res[1]), None, None


to_blocks.defvjp(_to_fwd, _to_bwd)


@jax.custom_vjp
def from_blocks(xp, src, dest):
  """[num_blocks * block_rows, d] -> [m, d]; rows past the groups come back as zeros."""
  return _gather_rows(xp, dest)


def _from_fwd(xp, src, dest):
  return _gather_rows(xp, dest), (src, dest)


def _from_bwd(res, ct):
  return _gather_rows(ct, res[0]), None, None


from_blocks.defvjp(_from_fwd, _from_bwd)

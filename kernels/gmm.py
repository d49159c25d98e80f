"""Grouped matmul: rows of ``lhs`` sorted by group, one weight matrix per group.

``gmm(lhs[m,k], rhs[g,k,n], group_sizes[g]) -> [m,n]``; rows past ``sum(group_sizes)`` give zeros.
``tgmm(lhs[m,k], grad[m,n], group_sizes[g]) -> [g,k,n]`` is the weight-gradient product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs, rhs, group_sizes, *, impl: str = "auto", precision: str = "bf16",
        preferred_element_type=None):
  """Grouped matmul through XLA's ragged_dot (reference path)."""
  del impl, precision
  out_dtype = preferred_element_type or lhs.dtype
  return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                            preferred_element_type=out_dtype)


def tgmm(lhs, grad, group_sizes, *, num_groups: int | None = None):
  """Per-group lhs^T @ grad (the weight gradient of gmm), reference path."""
  g = num_groups if num_groups is not None else group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(lhs.shape[0])
  mask = (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])  # [g, m]
  return jnp.einsum("gm,mk,mn->gkn", mask[:g].astype(lhs.dtype), lhs, grad)

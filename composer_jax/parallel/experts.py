"""Dropless routed-expert dispatch: on one shard, and expert-parallel inside ``shard_map``.

``dropless_moe`` is the single-shard path: the (token, slot) pairs sorted by expert feed one grouped
matmul per projection (``composer_jax.kernels.gmm``). It lives here, not in ``composer_jax.model``,
because the expert-parallel bodies run the same bookkeeping: the model imports this module, and
this module imports nothing from the model.

Outside the MoE the ``expert`` mesh axis is one more batch axis; inside it, each expert rank owns
``E / ep`` experts and tokens travel to the rank of each expert they picked, and back.

Two strategies, chosen by ``mesh.ep_strategy``:

* ``all_to_all`` — sort the (token, slot) pairs by expert (``sort_by_expert``), send each rank
  exactly its rows with a ragged all-to-all, run the local experts (``expert_ffn``), send the
  results back the same way. The offsets and sizes come from one all-gather of the per-expert counts,
  so every rank derives the whole exchange plan locally. The receive buffer holds the worst case
  (every row of every rank to one rank): nothing is ever dropped, however skewed the routing.
* ``all_gather`` — all-gather every token of the expert group, run the local experts on the pairs
  that picked them, reduce-scatter the weighted sums back.

The exchange primitive depends on the backend: ``jax.lax.ragged_all_to_all`` on GPU/TPU, and on CPU
(XLA:CPU has no ragged-all-to-all) ``padded_ragged_all_to_all``, an emulation with the *same
semantics* built from a fixed-size ``all_to_all``. Everything around the primitive is shared, so the
fake-CPU-mesh equivalence tests run the code the pods run.

Expert weights arrive with their own layout (``exp`` over ``expert``, ``exp_embed`` over ``fsdp``,
``exp_mlp`` over ``tensor`` by default): shards of the embed dim are all-gathered inside (their
gradient becomes a reduce-scatter); a sharded FFN dim whose mesh axes do not shard tokens stays
sharded and the partial outputs are summed over those axes (tensor parallelism inside the experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from composer_jax.config import ConfigError, ModelConfig
from composer_jax.kernels.gmm import RowPlan, gmm_planned, plan_rows
from composer_jax.kernels.gmm_layout import (
  from_blocks,
  gather_tokens,
  pair_maps,
  to_blocks,
)
from composer_jax.parallel.rules import MESH_AXES, active, active_option, spec_for

RAGGED_BACKENDS = ("gpu", "cuda", "rocm", "tpu")


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def _axes_of(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


# --------------------------------------------------------------------------------------------------
# Single shard: sort by expert, grouped matmuls
# --------------------------------------------------------------------------------------------------


def sort_by_expert(expert_ids: jax.Array, n_experts: int):
  """Bookkeeping shared by every dispatch path.

  Returns (order [T*k]: the (token, slot) pairs sorted by expert, inverse [T*k], group_sizes [E]).
  """
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  group_sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
  return order, inverse, group_sizes


def _ffn_on_blocks(xp, plan: RowPlan, w_gate, w_up, w_down):
  """SwiGLU per padded row with its group's expert. Padding rows stay zero (silu(0) * 0 = 0).
  Gate and up are two products over the one shared layout: concatenating the weights instead
  copies [E, d, 2f] forward and splits its gradient backward, which measured slower on CPU."""
  h = jax.nn.silu(gmm_planned(xp, w_gate, plan)) * gmm_planned(xp, w_up, plan)
  return gmm_planned(h.astype(xp.dtype), w_down, plan)


def expert_ffn(xs, group_sizes, w_gate, w_up, w_down, *, impl: str, precision: str):
  """SwiGLU of each row with its group's expert weights; rows sorted by group (the EP path)."""
  plan = plan_rows(group_sizes, xs.shape[0], impl=impl, precision=precision)
  xp = to_blocks(xs, plan.layout.src, plan.layout.dest)
  yp = _ffn_on_blocks(xp, plan, w_gate, w_up, w_down)
  return from_blocks(yp, plan.layout.src, plan.layout.dest).astype(xs.dtype)


def dropless_moe(x, expert_ids, weights, w_gate, w_up, w_down, *, impl: str = "auto",
                 precision: str = "bf16", block_rows: int | None = None):
  """Single-shard routed experts: x [T,d], expert_ids/weights [T,k] -> [T,d].

  Tokens go straight into the block layout sorted by expert (one gather), both expert products run
  there, and the rows come back in (token, slot) order (one gather) for the weighted sum: no
  intermediate sorted copy, no scatter-add, forward or backward.
  """
  n_tok, k = expert_ids.shape
  order, inverse, group_sizes = sort_by_expert(expert_ids, w_gate.shape[0])
  plan = plan_rows(group_sizes, n_tok * k, impl=impl, precision=precision, block_rows=block_rows)
  row_pair, pair_row = pair_maps(order, inverse, plan.layout)
  yp = _ffn_on_blocks(gather_tokens(x, row_pair, pair_row, k), plan, w_gate, w_up, w_down)
  y = from_blocks(yp.astype(x.dtype), row_pair, pair_row).reshape(n_tok, k, -1)
  return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


# --------------------------------------------------------------------------------------------------
# Exchange primitives: identical semantics, one per backend
# --------------------------------------------------------------------------------------------------


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                             *, axis_name):
  """``jax.lax.ragged_all_to_all`` emulated with a fixed-size all_to_all (for XLA:CPU).

  Chunk j (``send_sizes[j]`` rows from ``input_offsets[j]``) is padded to the largest possible chunk,
  exchanged, and written on its receiver at the offset the sender named in ``output_offsets``.
  """
  n = input_offsets.shape[0]
  cap = min(operand.shape[0], output.shape[0])  # no chunk can be longer than either buffer
  pos = jnp.arange(cap)
  src = input_offsets[:, None] + pos[None, :]  # [n, cap]
  keep = pos[None, :] < send_sizes[:, None]
  blocks = jnp.take(operand, jnp.where(keep, src, 0), axis=0)
  blocks = jnp.where(keep.reshape(keep.shape + (1,) * (operand.ndim - 1)), blocks, 0)
  recv = jax.lax.all_to_all(blocks, axis_name, 0, 0)  # [n_src, cap, ...]
  where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # my offset per sender
  dst = where[:, None] + pos[None, :]
  dst = jnp.where(pos[None, :] < recv_sizes[:, None], dst, output.shape[0])  # out of range: dropped
  return output.at[dst.reshape(-1)].set(recv.reshape((n * cap,) + operand.shape[1:]), mode="drop")


def exchange_fn(backend: str | None = None):
  """The ragged exchange for ``backend`` (default: JAX's default backend)."""
  backend = backend or jax.default_backend()
  if backend in RAGGED_BACKENDS:
    return jax.lax.ragged_all_to_all
  return padded_ragged_all_to_all


# --------------------------------------------------------------------------------------------------
# Per-shard bodies (run inside shard_map)
# --------------------------------------------------------------------------------------------------


def exchange_plan(group_sizes, ep_axes, n_ep: int):
  """Offsets and sizes of both directions from the per-expert counts of every rank.

  ``group_sizes`` [E] are this rank's rows per global expert. Returns a dict of [n_ep] int32 arrays
  plus ``recv_expert_counts`` [n_ep, E_loc] (rows received from each source for each local expert).
  """
  n_loc = group_sizes.shape[0] // n_ep
  per_rank = group_sizes.reshape(n_ep, n_loc)
  counts = jax.lax.all_gather(per_rank, ep_axes)  # [src, dst, E_loc]
  c = counts.sum(-1)  # [src, dst] rows
  me = jax.lax.axis_index(ep_axes)
  send_sizes = c[me]
  recv_sizes = c[:, me]
  return {
      "send_sizes": send_sizes,
      "input_offsets": _exclusive_cumsum(send_sizes),  # my rows are sorted by destination
      "output_offsets": _exclusive_cumsum(c, axis=0)[me],  # where my chunk lands on each dst
      "recv_sizes": recv_sizes,
      "recv_offsets": _exclusive_cumsum(recv_sizes),  # where each source's chunk lands here
      "back_offsets": _exclusive_cumsum(c, axis=1)[:, me],  # where my results land on each src
      "recv_expert_counts": counts[:, me, :],
  }


def received_expert_ids(recv_expert_counts, n_rows: int):
  """Local expert of each received row (``E_loc`` = empty slot); rows are grouped by source, then
  by expert, because every sender sorted its rows by expert."""
  n_loc = recv_expert_counts.shape[1]
  ends = jnp.cumsum(recv_expert_counts.reshape(-1))
  seg = jnp.searchsorted(ends, jnp.arange(n_rows), side="right")
  return jnp.where(seg < ends.shape[0], seg % n_loc, n_loc).astype(jnp.int32)


def _local_experts(rows, expert_ids, n_loc, w_gate, w_up, w_down, cfg):
  """Rows [R, d] with local expert ids in [0, n_loc] (n_loc = none) -> outputs in the same order."""
  order, inverse, sizes = sort_by_expert(expert_ids, n_loc + 1)
  ys = expert_ffn(rows[order], sizes[:n_loc], w_gate, w_up, w_down, impl=cfg.gmm_impl,
                  precision=cfg.gmm_precision)
  return ys[inverse]  # rows with no local expert are past sum(sizes[:n_loc]): gmm gives zeros


def all_to_all_body(x, ids, weights, w_gate, w_up, w_down, *, cfg, ep_axes, n_ep, exchange):
  n_tok, k = ids.shape
  n_exp = n_ep * w_gate.shape[0]
  order, inverse, group_sizes = sort_by_expert(ids, n_exp)
  xs = x[order // k]  # [N, d], grouped by destination rank
  plan = exchange_plan(group_sizes, ep_axes, n_ep)
  n_rows = xs.shape[0]
  buf = jnp.zeros((n_ep * n_rows, x.shape[1]), x.dtype)  # worst case: every row of every rank
  recv = exchange(xs, buf, plan["input_offsets"], plan["send_sizes"], plan["output_offsets"],
                  plan["recv_sizes"], axis_name=ep_axes)
  local = received_expert_ids(plan["recv_expert_counts"], recv.shape[0])
  ys = _local_experts(recv, local, w_gate.shape[0], w_gate, w_up, w_down, cfg)
  back = exchange(ys.astype(x.dtype), jnp.zeros_like(xs), plan["recv_offsets"], plan["recv_sizes"],
                  plan["back_offsets"], plan["send_sizes"], axis_name=ep_axes)
  y = back[inverse].reshape(n_tok, k, -1)
  return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def all_gather_body(x, ids, weights, w_gate, w_up, w_down, *, cfg, ep_axes, n_ep):
  n_loc = w_gate.shape[0]
  xg = jax.lax.all_gather(x, ep_axes, tiled=True)
  idg = jax.lax.all_gather(ids, ep_axes, tiled=True)
  wg = jax.lax.all_gather(weights, ep_axes, tiled=True)
  local = idg - jax.lax.axis_index(ep_axes) * n_loc
  mine = (local >= 0) & (local < n_loc)
  local = jnp.where(mine, local, n_loc).astype(jnp.int32)
  k = ids.shape[1]
  ys = _local_experts(xg[jnp.arange(idg.size) // k], local.reshape(-1), n_loc, w_gate, w_up,
                      w_down, cfg)
  y = ys.reshape(idg.shape + (-1,))
  part = jnp.einsum("tkd,tk->td", y, jnp.where(mine, wg, 0).astype(y.dtype))
  return jax.lax.psum_scatter(part, ep_axes, scatter_dimension=0, tiled=True)


# --------------------------------------------------------------------------------------------------
# Entry point (called by composer_jax.model.moe.MoE on a mesh with an expert axis)
# --------------------------------------------------------------------------------------------------


def _ordered(axes) -> tuple:
  return tuple(a for a in MESH_AXES if a in set(axes))


def expert_parallel_moe(x, ids, weights, w_gate, w_up, w_down, *, cfg: ModelConfig, mesh: Mesh,
                        strategy: str | None = None, backend: str | None = None):
  """Routed experts on ``mesh``: x [T,d], ids/weights [T,k], w_* [E,d,f]/[E,f,d] -> [T,d]."""
  _, rules = active()
  strategy = strategy or active_option("ep_strategy", "all_to_all")
  sizes = dict(mesh.shape)
  w_spec = spec_for(("exp", "exp_embed", "exp_mlp"), w_gate.shape, mesh, rules, what="expert weights")
  ep_axes = _axes_of(w_spec[0])
  if not ep_axes:  # experts not sharded: plain dropless path, partitioned by XLA
    return dropless_moe(x, ids, weights, w_gate, w_up, w_down, impl=cfg.gmm_impl,
                        precision=cfg.gmm_precision)
  n_ep = 1
  for a in ep_axes:
    n_ep *= sizes[a]
  embed_axes, mlp_axes = _axes_of(w_spec[1]), _axes_of(w_spec[2])
  token_axes = _ordered([a for a in rules["act_batch"] + rules["act_seq"] + ep_axes
                         if sizes.get(a, 1) > 1])
  token_axes = tuple(a for a in token_axes if a not in mlp_axes or a in rules["act_batch"])
  if not set(ep_axes) <= set(token_axes):
    raise ConfigError(f"mesh.rules: expert axes {ep_axes} must also shard tokens (act_batch); "
                      "the expert axis doubles as a batch axis outside the MoE")
  gather_mlp = tuple(a for a in mlp_axes if a in token_axes)
  partial_axes = tuple(a for a in mlp_axes if a not in token_axes)
  n_shards = 1
  for a in token_axes:
    n_shards *= sizes[a]
  n_tok = x.shape[0]
  pad = (-n_tok) % n_shards
  if pad:  # e.g. a decode batch smaller than the mesh: padded rows carry zero weight
    x = jnp.pad(x, ((0, pad), (0, 0)))
    ids = jnp.pad(ids, ((0, pad), (0, 0)))
    weights = jnp.pad(weights, ((0, pad), (0, 0)))
  down_spec = P(w_spec[0], w_spec[2], w_spec[1])
  tok_spec = P(token_axes if token_axes else None, None)

  # Weights replicated over a token axis meet different tokens on each of its shards: mark them
  # varying there, so their gradient is summed over it (the transpose of pcast is a psum).
  vary = tuple(a for a in token_axes if a not in ep_axes + embed_axes + mlp_axes)

  def body(x, ids, weights, w_gate, w_up, w_down):
    def full(w, embed_dim, mlp_dim):
      if vary:
        w = jax.lax.pcast(w, vary, to="varying")
      for a in embed_axes:
        w = jax.lax.all_gather(w, a, axis=embed_dim, tiled=True)
      for a in gather_mlp:
        w = jax.lax.all_gather(w, a, axis=mlp_dim, tiled=True)
      return w
    if partial_axes:  # tokens meet a different FFN shard on each: their gradient sums over them
      x = jax.lax.pcast(x, partial_axes, to="varying")
    w_gate, w_up = full(w_gate, 1, 2), full(w_up, 1, 2)
    w_down = full(w_down, 2, 1)
    kw = {"cfg": cfg, "ep_axes": ep_axes, "n_ep": n_ep}
    if strategy == "all_gather":
      y = all_gather_body(x, ids, weights, w_gate, w_up, w_down, **kw)
    else:
      y = all_to_all_body(x, ids, weights, w_gate, w_up, w_down, exchange=exchange_fn(backend), **kw)
    if partial_axes:  # each shard of the FFN dim holds a partial sum of the output
      y = jax.lax.psum(y, partial_axes)
    return y

  fn = jax.shard_map(body, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, w_spec, w_spec,
                                                  down_spec), out_specs=tok_spec)
  y = fn(x, ids, weights, w_gate, w_up, w_down)
  return y[:n_tok] if pad else y

"""Scanned layers (``model.scan_layers``): the MoE blocks as one stacked module, run by a scan.

A Python loop over 60 blocks traces 60 copies of the block and XLA compiles them all; a scan traces
one block and compiles a loop, so compile time stays flat in depth. Every variable of the stack has
a leading layer axis, named ``layers`` in its logical axes (``parallel/rules.py`` replicates it:
each layer's weights keep the sharding of their own dims).

What the loop returned per layer comes out of the scan stacked along that axis: router statistics
(expert ids, loads, aux losses, the live choice under replay), the per-head max attention logits
of QK-clip, and, when decoding, the stacked latent cache (carried whole; each layer writes and
reads its slice in place).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.model.cache import LayerCache
from composer_jax.model.layers import KeySeq

LAYER_AXIS = "layers"  # logical name of the leading axis of every stacked variable
STACK = "moe_layers"  # the Transformer attribute holding the stack (parameter paths, HF names)


def stack_modules(make: Callable[[KeySeq], nnx.Module], n: int, key: jax.Array) -> nnx.Module:
  """``n`` modules ``make(KeySeq(k_i))`` as one module whose variables are stacked on axis 0.

  Each layer draws its init from its own key (split from ``key``), so layers differ as in a loop.
  """
  @nnx.vmap(in_axes=0, out_axes=0)
  def create(k):
    return make(KeySeq(k))

  stack = create(jax.random.split(key, n))
  for _, node in nnx.iter_graph(stack):
    if isinstance(node, nnx.Variable):
      axes = node.get_metadata().get("axes")
      axes = tuple(axes) if axes is not None else (None,) * (node.ndim - 1)
      node.set_metadata(axes=(LAYER_AXIS,) + axes)
  return stack


def pure_block(graphdef, record: bool):
  """The block as a pure function of its state: ``run(state, x, cos, sin, seg, cache, replay) ->
  (x, cache, stats, max_logit or None)``. The per-head max logits the attention sows (QK-clip) come
  out as a value, so nothing outside the function is mutated: ``jax.checkpoint`` and ``lax.scan``
  of it are plain JAX (``nnx.remat`` / ``nnx.scan`` write variables back, which fails under
  ``jax.grad`` for a model merged from a state the gradient does not trace, the train step's
  ``rest``, and for a model whose state a jitted function closes over)."""
  def run(state, h, cos, sin, seg, lc, rep):
    block = nnx.merge(graphdef, state)
    nnx.pop(block, nnx.Intermediate)  # values sown by an earlier call stay on the caller's module
    h, lc, stats = block(h, cos, sin, seg, lc, rep)
    top = None
    if record:
      top = jnp.max(jnp.stack(jax.tree.leaves(nnx.pop(block, nnx.Intermediate))), axis=0)
    return h, lc, stats, top
  return run


def remat_block(block, policy, x, cos, sin, seg, replay):
  """One block (no cache) under ``jax.checkpoint(policy)``: the loop layout's remat.
  Returns (x, None, stats) as the block does; sown max logits land on ``block.attn`` as usual."""
  graphdef, state = nnx.split(block)
  record = bool(getattr(block.attn, "record_max_logit", False))
  run = jax.checkpoint(pure_block(graphdef, record), policy=policy)
  x, _, stats, top = run(state, x, cos, sin, seg, None, replay)
  if top is not None:
    block.attn.sow(nnx.Intermediate, "max_logit", top)
  return x, None, stats


def scan_blocks(stack, n: int, x, cos, sin, seg, *, cache: LayerCache | None = None, replay=None,
                remat: bool = False, policy=None):
  """Run the ``n`` stacked blocks in order: (x, stats, cache, max_logit).

  ``replay`` [n, b, s, k] recorded expert ids (scanned with the layers); ``stats`` is the blocks'
  ``MoEStats`` stacked to [n, ...]; ``cache`` the stacked LayerCache (updated when given);
  ``max_logit`` [n, heads] when the attention records it (QK-clip), else None. ``remat`` wraps
  each layer's body in ``jax.checkpoint`` with ``policy`` (training only: decoding saves nothing).
  A ``jax.lax.scan`` over the stack's split state (see ``pure_block`` for why not ``nnx.scan``):
  the forward changes no variable of the stack.
  """
  graphdef, state = nnx.split(stack)
  layer = pure_block(graphdef, bool(getattr(stack.attn, "record_max_logit", False)))
  if remat and cache is None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)  # the scan already stops CSE

  def body(carry, xs):
    h, bufs = carry
    st, rep, i = xs
    lc = None
    if bufs is not None:  # every layer starts from the same row lengths
      lc = LayerCache(c=bufs[0], k_pe=bufs[1], index=cache.index, view=cache.view, layer=i)
    h, lc, stats, top = layer(st, h, cos, sin, seg, lc, rep)
    out = None if lc is None else (lc.c, lc.k_pe)
    return (h, out), (stats, top, None if lc is None else lc.index)

  bufs = None if cache is None else (cache.c, cache.k_pe)
  (x, bufs), (stats, top, index) = jax.lax.scan(body, (x, bufs), (state, replay, jnp.arange(n)))
  if cache is not None:
    cache = cache.replace(c=bufs[0], k_pe=bufs[1], index=index[-1])
  return x, stats, cache, top


def layer_paths(path: tuple, n_dense: int, n_moe: int) -> list[tuple]:
  """The per-layer (loop layout) paths that a state path stands for: one per MoE layer for a path
  inside the stack, ``("layers", i, ...)`` as the loop layout names them; the path itself otherwise."""
  path = tuple(path)
  if path and path[0] == STACK:
    return [("layers", n_dense + j) + path[1:] for j in range(n_moe)]
  return [path]

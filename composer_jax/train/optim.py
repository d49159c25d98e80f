"""Optimizers: AdamW, or Muon on weight matrices with AdamW on the rest; schedules; QK-clip.

Which parameters get Muon is decided from their logical ``axes`` (the same metadata the sharding
rules read): every parameter with two or more dims except those with a ``vocab`` axis (embedding and
output head, which Muon handles badly). Expert weights ``[exp, in, out]`` are a batch of matrices,
orthogonalised independently. Muon updates are scaled to AdamW's RMS (Moonlight's 0.2·sqrt(max dim))
so both groups share one learning rate and schedule.

Mixed precision (``optim.master_dtype``). With ``model.param_dtype: bfloat16`` the model's weights
are bf16 (what the forward pass, the sampler, eval and HF export read), but an update of 1e-4 of a
weight's size vanishes when added to a bf16 weight (8 bits of mantissa). So by default
(``master_dtype: float32``) the optimizer keeps the recipe of mixed-precision training:
  * ``MasterState.master``: a float32 master copy of every parameter, sharded like it;
  * the inner optimizer's state (AdamW moments, Muon momentum) is initialised from the master copy,
    so it is float32 too;
  * each step the gradients (bf16, or float32 sums under accumulation) are cast to float32, the
    inner optimizer updates the master copy, and the bf16 weights are recomputed as
    ``master.astype(bf16)`` (never ``bf16 + update``); QK-clip rescales the master copy.
Bytes per parameter: 2 (bf16 weights) + 4 (master) + 8 (AdamW) = 14, or 2 + 4 + 4 = 10 with Muon on
a matrix. ``master_dtype: none`` updates the parameters in their own dtype (moments in that dtype
too: cheaper, lossy). With float32 parameters there is nothing to keep and no ``MasterState``.
Since the master copy is the truth, new weights (``--init``, a reference policy) must enter through
``train.loop.init_state``, which rebuilds the optimizer state from them; writing
``state["params"]`` alone would be undone by the next step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from composer_jax.config import OptimConfig

BATCH_AXES = ("exp", "layers")  # logical axes that index independent matrices


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup, then constant, cosine to ``lr·min_lr_ratio``, or warmup-stable-decay."""
  peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  total = max(total_steps, warmup + 1)
  ramp = optax.linear_schedule(0.0 if warmup else peak, peak, max(warmup, 1))
  if cfg.schedule == "constant":
    rest = optax.constant_schedule(peak)
  elif cfg.schedule == "cosine":
    rest = optax.cosine_decay_schedule(peak, total - warmup, alpha=cfg.min_lr_ratio)
  else:  # wsd: hold the peak, then decay linearly over the last decay_fraction of the run
    decay = max(round(cfg.decay_fraction * total), 1)
    stable = max(total - warmup - decay, 0)
    rest = optax.join_schedules([optax.constant_schedule(peak),
                                 optax.linear_schedule(peak, floor, decay)], [stable])
  return optax.join_schedules([ramp, rest], [warmup])


def muon_dims(axes: tuple | None, ndim: int) -> MuonDimensionNumbers | None:
  """Reduction/output axes of a weight stored ``[*batch, in, *out]``; None = not a Muon param."""
  if ndim < 2:
    return None
  axes = tuple(axes) if axes is not None else (None,) * ndim
  if "vocab" in axes or "norm" in axes:
    return None
  mat = [i for i, a in enumerate(axes) if a not in BATCH_AXES]
  if len(mat) < 2:
    return None
  return MuonDimensionNumbers(reduction_axis=(mat[0],), output_axis=tuple(mat[1:]))


def _path_key(path) -> str:
  return jax.tree_util.keystr(path)


def build_optimizer(cfg: OptimConfig, total_steps: int, params: Any,
                    axes: Any = None) -> optax.GradientTransformation:
  """The full update rule: global-norm clipping, then AdamW or Muon+AdamW with decay masks.

  ``params`` may be abstract (only shapes are read). ``axes`` gives each parameter's logical axis
  names: a list in ``jax.tree.leaves(params)`` order, or a pytree like ``params`` with tuple leaves
  (None = unknown: every >=2-D weight counts as a matrix).
  """
  lr = schedule(cfg, total_steps)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if axes is None:
    axis_leaves = [None] * len(leaves)
  elif isinstance(axes, list):
    axis_leaves = axes
  else:
    axis_leaves = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple) or x is None)
  if len(axis_leaves) != len(leaves):
    raise ValueError(f"{len(axis_leaves)} axes entries for {len(leaves)} parameters")
  # Decay matrices, never norms, biases or other vectors: a leading "layers" axis (stacked layers
  # of model.scan_layers) does not make a norm scale a matrix.
  decay = {_path_key(p): x.ndim - int(bool(a) and a[0] == "layers") >= 2
           for (p, x), a in zip(leaves, axis_leaves)}
  decay_mask = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, x: decay.get(_path_key(path), x.ndim >= 2), p)
  adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=decay_mask)
  if cfg.name == "adamw":
    inner = adamw
  else:
    dims = {_path_key(p): muon_dims(a, x.ndim) for (p, x), a in zip(leaves, axis_leaves)}
    labels = jax.tree_util.tree_map_with_path(
        lambda p, x: "muon" if dims[_path_key(p)] is not None else "adam", params)
    dims_fn = lambda p: jax.tree_util.tree_map_with_path(
        lambda path, x: dims[_path_key(path)], p)
    muon = optax.contrib.muon(lr, ns_steps=cfg.muon_ns_steps, beta=cfg.muon_momentum, eps=cfg.eps,
                              weight_decay=cfg.weight_decay, muon_weight_dimension_numbers=dims_fn,
                              consistent_rms=0.2, nesterov=True)
    inner = optax.multi_transform({"muon": muon, "adam": adamw}, labels)
  parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
  tx = optax.chain(*parts, inner)
  return skip_zero_grads(with_master(tx, cfg.master_dtype) if needs_master(cfg, params) else tx)


def skip_zero_grads(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """No update and no state change when the gradient is exactly zero everywhere.

  An RL batch whose groups each scored alike (all solved or all failed) has advantage 0 on every
  token, so its gradient is 0. AdamW would still step: m/sqrt(v) decays by only b1/sqrt(b2) (0.92
  at 0.9/0.95) per zero step, so a solved batch pushed the policy on along the last direction at
  ~92 % of a real step, overshooting into derailed episodes (docs/rl_tiny.md, "Zero-gradient
  steps"). Skipping keeps the moments and the step count (so the schedule) as they were. The state's
  structure is ``tx``'s own: checkpoints are unchanged.
  """

  def update(grads, state, params=None):
    u, new = tx.update(grads, state, params)
    live = optax.tree.norm(grads) > 0
    u = jax.tree.map(lambda x: jnp.where(live, x, jnp.zeros_like(x)), u)
    new = jax.tree.map(lambda n, o: jnp.where(live, n, o), new, state)
    return u, new

  return optax.GradientTransformation(tx.init, update)


class MasterState(NamedTuple):
  master: Any  # float32 copy of the parameters
  inner: Any  # the wrapped optimizer's state (initialised from the master copy)


def _floating(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def needs_master(cfg: OptimConfig, params: Any) -> bool:
  """Whether ``cfg.master_dtype`` asks for a master copy of these (possibly abstract) params."""
  if cfg.master_dtype == "none":
    return False
  want = jnp.dtype(cfg.master_dtype)
  return any(_floating(x) and jnp.finfo(x.dtype).bits < jnp.finfo(want).bits
             for x in jax.tree.leaves(params))


def with_master(inner: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
  """Wrap ``inner`` so it updates a ``dtype`` master copy; see the module docstring.

  ``update`` returns the updates that take the parameters to ``master.astype(param dtype)``;
  ``apply`` (below) sets the parameters to exactly that instead of adding.
  """
  dt = jnp.dtype(dtype)
  up = lambda t: jax.tree.map(lambda x: x.astype(dt) if _floating(x) else x, t)

  def init(params):
    master = up(params)
    return MasterState(master, inner.init(master))

  def update(grads, state, params=None):
    u, inner_state = inner.update(up(grads), state.inner, state.master)
    master = optax.apply_updates(state.master, u)
    if params is None:
      return u, MasterState(master, inner_state)
    delta = jax.tree.map(lambda m, p: (m.astype(p.dtype) - p), master, params)
    return delta, MasterState(master, inner_state)

  return optax.GradientTransformation(init, update)


def apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any,
          params: Any) -> tuple[Any, Any]:
  """One optimizer update: (new params, new state). With a master copy, the parameters become the
  rounded master copy (adding a bf16 difference could round differently)."""
  updates, opt_state = tx.update(grads, opt_state, params)
  if isinstance(opt_state, MasterState):
    return cast_like(opt_state.master, params), opt_state
  return optax.apply_updates(params, updates), opt_state


def cast_like(src: Any, like: Any) -> Any:
  return jax.tree.map(lambda s, p: s.astype(p.dtype), src, like)


def state_owners(abstract_params: Any, abstract_state: Any) -> list:
  """For each optimizer-state leaf (``tree_leaves_with_path`` order), the index of the parameter it
  belongs to, or None (counts, schedule state). A state leaf belongs to a parameter when its key
  path ends with that parameter's key path (e.g. ``...mu['layers'][0]['w']``) and the shapes agree;
  the longest such path wins."""
  by_path = {_path_key(path): (i, leaf.shape)
             for i, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(abstract_params))}
  owners = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state):
    owner = None
    for j in range(len(path)):
      hit = by_path.get(_path_key(path[j:]))
      if hit is not None and hit[1] == leaf.shape:
        owner = hit[0]
        break
    owners.append(owner)
  return owners


def state_shardings(tx: optax.GradientTransformation, abstract_params: Any,
                    param_shardings: Any, replicated: Any) -> Any:
  """Optimizer-state shardings: every parameter-shaped leaf sharded like its parameter (see
  ``state_owners``); counts, schedules and the like are replicated."""
  abstract_state = jax.eval_shape(tx.init, abstract_params)
  is_sh = lambda x: isinstance(x, jax.sharding.Sharding)
  shardings = jax.tree.leaves(param_shardings, is_leaf=is_sh)
  owners = state_owners(abstract_params, abstract_state)
  leaves = [shardings[o] if o is not None else replicated for o in owners]
  return jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)


def qk_clip_scales(max_logits: jax.Array, tau: float) -> tuple[jax.Array, jax.Array]:
  """MuonClip per-head factors from the step's max pre-softmax logit of each head.

  For a head whose max logit exceeds ``tau``, gamma = tau / max_logit. Head-specific query and key
  parts (MLA's ``nope`` dims) are each scaled by sqrt(gamma), so their product scales by gamma;
  the query's rotary part is scaled by gamma because the rotary key is shared across heads and must
  stay untouched. Returns (sqrt(gamma), gamma), both shaped like ``max_logits``.
  """
  gamma = jnp.minimum(1.0, tau / jnp.maximum(max_logits, 1e-30))
  return jnp.sqrt(gamma), gamma

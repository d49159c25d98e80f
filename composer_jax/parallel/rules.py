"""One logical-axis vocabulary and one rule table mapping it onto the mesh.

Every parameter carries ``axes`` metadata (logical names below); every activation constraint names
logical axes too. ``DEFAULT_RULES`` maps each name to zero or more mesh axes; ``mesh.rules`` in the
config overrides single entries. Placing two dims of one array on the same mesh axis, or a dim whose
size the mesh axes do not divide, raises ``ConfigError`` with one line.

Default layout ("dual-mesh HSDP" of the seeds): non-expert weights are FSDP-sharded over ``fsdp`` and
replicated over ``data`` and ``expert``; expert weights are sharded over ``expert`` x ``fsdp``; the
``expert`` axis doubles as a batch axis outside the MoE.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # Parameters.
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_lora": (),  # the latent as an output (q_a, kv_a: their input dim is already on fsdp)
    "kv_lora": (),
    "q_lora_up": ("fsdp",),  # the latent as an input (q_b, kv_b): FSDP-shard the up-projections
    "kv_lora_up": ("fsdp",),
    "heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "exp": ("expert",),
    "exp_embed": ("fsdp",),
    "exp_mlp": ("tensor",),
    "norm": (),
    "embed_in": (),  # the 2*d input of the MTP projection
    "layers": (),  # the leading axis of stacked (scanned) layers: each layer's weights on every device
    # Activations.
    "act_batch": ("data", "fsdp", "expert"),
    "act_seq": ("context",),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv": (),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_exp": ("expert",),
}


def make_rules(overrides: dict | None = None) -> dict[str, tuple[str, ...]]:
  rules = dict(DEFAULT_RULES)
  for name, target in (overrides or {}).items():
    if name not in DEFAULT_RULES:
      raise ConfigError(f"mesh.rules.{name}: unknown logical axis; known: {sorted(DEFAULT_RULES)}")
    if target is None:
      target = ()
    elif isinstance(target, str):
      target = (target,)
    target = tuple(target)
    for a in target:
      if a not in MESH_AXES:
        raise ConfigError(f"mesh.rules.{name}={a!r}: not a mesh axis; use one of {list(MESH_AXES)}")
    rules[name] = target
  return rules


def spec_for(axes: Sequence[str | None], shape: Sequence[int] | None, mesh: Mesh | None,
             rules: dict, what: str = "array", strict: bool = True) -> P:
  """PartitionSpec for logical ``axes``; mesh axes of size 1 are dropped, misuse is an error.

  ``strict=False`` (activations) instead drops mesh axes that do not divide a dim, e.g. a decode
  batch of 1 on a data axis of 8 stays replicated.
  """
  sizes = dict(mesh.shape) if mesh is not None else {}
  used: dict[str, str] = {}
  out = []
  for i, name in enumerate(axes):
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise ConfigError(f"{what}: logical axis {name!r} has no rule; add it to parallel/rules.py")
    targets = [a for a in rules[name] if sizes.get(a, 1) > 1 and a not in used]
    if not strict and shape is not None:
      kept, n = [], 1
      for a in targets:
        if shape[i] % (n * sizes[a]) == 0:
          kept.append(a)
          n *= sizes[a]
      targets = kept
    for a in [a for a in rules[name] if sizes.get(a, 1) > 1 and a in used]:
      if strict:
        raise ConfigError(f"{what}: dims {used[a]!r} and {name!r} both map to mesh axis {a!r}; "
                          f"change mesh.rules so each mesh axis shards one dim")
    for a in targets:
      used[a] = name
    if shape is not None and targets:
      n = 1
      for a in targets:
        n *= sizes[a]
      if shape[i] % n:
        raise ConfigError(f"{what}: dim {name!r} of size {shape[i]} is not divisible by mesh axes "
                          f"{targets} (total {n}); change the mesh or mesh.rules.{name}")
    out.append(tuple(targets) if len(targets) > 1 else (targets[0] if targets else None))
  return P(*out)


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


def _is_var(x) -> bool:
  from flax import nnx
  return isinstance(x, nnx.Variable)


def variable_axes(var) -> tuple:
  axes = var.get_metadata().get("axes")
  return tuple(axes) if axes is not None else (None,) * len(var.shape)


def state_specs(state, mesh: Mesh | None, rules: dict):
  """Map an (abstract) NNX state to PartitionSpecs, leaf for leaf."""
  def one(path, var):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return spec_for(variable_axes(var), var.shape, mesh, rules, what=f"param {name}")
  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def state_shardings(state, mesh: Mesh, rules: dict):
  specs = state_specs(state, mesh, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# --------------------------------------------------------------------------------------------------
# Activations: the model names logical axes; the active (mesh, rules) decide what that means.
# --------------------------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("composer_jax_mesh", default=None)
_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("composer_jax_mesh_options", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh | None, rules: dict | None = None, **options):
  """Make ``mesh`` and ``rules`` the ones activation constraints (and jit) use inside the block.

  ``options`` carry mesh-level choices the model reads while tracing (e.g. ``ep_strategy``, from
  ``mesh.ep_strategy``; callers pass them from the config).
  """
  token = _ACTIVE.set((mesh, rules or DEFAULT_RULES) if mesh is not None else None)
  opt_token = _OPTIONS.set(options or None)
  try:
    if mesh is not None:
      with jax.set_mesh(mesh):
        yield
    else:
      yield
  finally:
    _ACTIVE.reset(token)
    _OPTIONS.reset(opt_token)


def context_key() -> tuple:
  """A hashable key of the active (mesh, rules, options): everything the model reads while tracing
  that jax.jit's own cache key does not see."""
  got = _ACTIVE.get()
  if got is None:
    return (None, None, tuple(sorted((_OPTIONS.get() or {}).items())))
  mesh, rules = got
  return (mesh, tuple(sorted((k, tuple(v)) for k, v in rules.items())),
          tuple(sorted((_OPTIONS.get() or {}).items())))


def context_jit(fn, **jit_kwargs):
  """``jax.jit(fn, **jit_kwargs)`` with one trace cache per active (mesh, rules, options).

  The rules and options are context variables, outside jax.jit's cache key: a function traced under
  one rule table (say a learner's) would otherwise be replayed under another (a sampler's) with the
  first one's sharding constraints and EP strategy. Use this for any jitted function that runs the
  model and may be called under different ``activate`` blocks.
  """
  import functools
  cache: dict = {}

  @functools.wraps(fn)
  def call(*args, **kwargs):
    key = context_key()
    jitted = cache.get(key)
    if jitted is None:  # a fresh function object: jax.jit's trace cache is keyed on it
      jitted = cache[key] = jax.jit(functools.wraps(fn)(lambda *a, **k: fn(*a, **k)), **jit_kwargs)
    return jitted(*args, **kwargs)

  call.cache = cache
  return call


def active_option(name: str, default=None):
  """An option given to the active ``activate`` block, else ``default``."""
  return (_OPTIONS.get() or {}).get(name, default)


def active() -> tuple[Mesh | None, dict]:
  got = _ACTIVE.get()
  return got if got is not None else (None, DEFAULT_RULES)


def constrain(x: jax.Array, axes: Iterable[str | None]) -> jax.Array:
  """with_sharding_constraint by logical axes; a no-op without an active multi-device mesh."""
  mesh, rules = active()
  if mesh is None or mesh.size == 1:
    return x
  spec = spec_for(tuple(axes), x.shape, mesh, rules, what="activation", strict=False)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

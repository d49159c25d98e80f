"""Per-device memory plan of a config on a mesh, without devices: shapes from eval_shape, partition
specs from the rule table on an ``AbstractMesh``, bytes by arithmetic.

``composer-jax params CONFIG --sharding mesh.fsdp=64 mesh.expert=8 --devices 512`` prints it, so a
pod can be planned on a laptop. The optimizer state is what the run's optimizer really allocates:
``jax.eval_shape`` of ``build_optimizer(cfg.optim, ...).init`` on the abstract parameters (AdamW
moments, Muon momentum, the float32 master copy of ``optim.master_dtype``), each leaf sharded like
the parameter it belongs to (``optim.state_owners``), the rest (counts) replicated. Activations and
gradients are not counted. It lives in ``train/`` because it reads the model and the optimizer.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from composer_jax.config import Config, ConfigError
from composer_jax.model.build import abstract_model
from composer_jax.parallel.mesh import resolve_axis_sizes
from composer_jax.parallel.rules import MESH_AXES, make_rules, spec_for, variable_axes
from composer_jax.train import optim


def _entry_axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def optimizer_description(cfg: Config, master: bool) -> str:
  name = ("Muon on matrices, AdamW on the rest" if cfg.optim.name == "muon" else "AdamW")
  return name + (f", {cfg.optim.master_dtype} master copy" if master else "") + " (from eval_shape)"


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def sharding_plan(cfg: Config, n_devices: int | None = None) -> dict:
  """Per-parameter partition specs and bytes per device for parameters and optimizer state."""
  mc = cfg.mesh
  if n_devices is None:
    fixed = [getattr(mc, a) for a in MESH_AXES]
    n_devices = math.prod(fixed) if -1 not in fixed else jax.device_count()
  sizes = resolve_axis_sizes(mc, n_devices)
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  rules = make_rules(mc.rules)
  model = abstract_model(cfg)
  state, params = nnx.state(model), nnx.state(model, nnx.Param)
  axes = [variable_axes(v) for v in jax.tree.leaves(params, is_leaf=_is_var)]
  tx = optim.build_optimizer(cfg.optim, cfg.train.steps, params, axes)
  opt_state = jax.eval_shape(tx.init, params)
  master = isinstance(opt_state, optim.MasterState)

  def local_elems(shape, spec) -> int:
    return int(np.prod([d // math.prod(sizes[a] for a in _entry_axes(e))
                        for d, e in zip(shape, spec)]))

  # Optimizer bytes per parameter (by the parameter's key path), and the unowned (replicated) rest.
  param_paths = [jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_var)]
  param_vars = jax.tree.leaves(params, is_leaf=_is_var)
  specs = [spec_for(a, v.shape, mesh, rules, what="param") for a, v in zip(axes, param_vars)]
  opt_by_param = [0] * len(param_paths)
  other_opt = 0
  opt_leaves = jax.tree.leaves(opt_state)
  for leaf, owner in zip(opt_leaves, optim.state_owners(params, opt_state)):
    item = np.dtype(leaf.dtype).itemsize
    if owner is None:
      other_opt += int(np.prod(leaf.shape)) * item
    else:
      opt_by_param[owner] += local_elems(leaf.shape, specs[owner]) * item
  opt_of = dict(zip(param_paths, opt_by_param))

  rows = []
  for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_var):
    name = ".".join(str(getattr(k, "key", k)) for k in path)
    ax = variable_axes(var)
    spec = spec_for(ax, var.shape, mesh, rules, what=f"param {name}")
    n_local = local_elems(var.shape, spec)
    rows.append({
        "name": name, "shape": list(var.shape), "dtype": str(np.dtype(var.dtype)),
        "axes": list(ax), "spec": [list(_entry_axes(e)) for e in spec],
        "param_bytes": n_local * np.dtype(var.dtype).itemsize,
        "opt_bytes": opt_of.get(jax.tree_util.keystr(path), 0),
        "global_bytes": int(np.prod(var.shape)) * np.dtype(var.dtype).itemsize,
    })
  param_b = sum(r["param_bytes"] for r in rows)
  opt_b = sum(r["opt_bytes"] for r in rows) + other_opt
  return {
      "mesh": sizes, "n_devices": n_devices, "optimizer": optimizer_description(cfg, master),
      "params": rows,
      "totals": {"param_bytes_per_device": param_b, "opt_bytes_per_device": opt_b,
                 "opt_global_bytes": sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                                         for x in opt_leaves),
                 "total_bytes_per_device": param_b + opt_b,
                 "global_param_bytes": sum(r["global_bytes"] for r in rows)},
  }


def _gib(n: float) -> str:
  return f"{n / 2**30:9.3f} GiB"


def format_plan(plan: dict) -> str:
  """A table; parameters that differ only by layer index are grouped (``layers.*``)."""
  groups: dict = {}
  for r in plan["params"]:
    key = (re.sub(r"\.\d+\.", ".*.", r["name"]), tuple(r["shape"]), r["dtype"],
           tuple(tuple(s) for s in r["spec"]))
    g = groups.setdefault(key, {"n": 0, "param": 0, "opt": 0})
    g["n"] += 1
    g["param"] += r["param_bytes"]
    g["opt"] += r["opt_bytes"]
  mesh = " x ".join(f"{a}={s}" for a, s in plan["mesh"].items() if s > 1) or "1 device"
  lines = [f"mesh: {mesh} ({plan['n_devices']} devices); optimizer state: {plan['optimizer']}",
           (f"{'parameter':<44} {'count':>5} {'shape':<22} {'spec':<34} {'params/dev':>13} "
            f"{'opt/dev':>13}")]
  for (name, shape, _, spec), g in groups.items():
    spec_s = "(" + ", ".join("+".join(s) if s else "-" for s in spec) + ")"
    lines.append(f"{name:<44} {g['n']:>5} {list(shape)!s:<22} {spec_s:<34} "
                 f"{_gib(g['param']):>13} {_gib(g['opt']):>13}")
  t = plan["totals"]
  lines.append(f"per device: params {_gib(t['param_bytes_per_device'])}, optimizer "
               f"{_gib(t['opt_bytes_per_device'])}, total {_gib(t['total_bytes_per_device'])} "
               f"(all parameters: {_gib(t['global_param_bytes'])}; activations not counted)")
  return "\n".join(lines)


__all__ = ["ConfigError", "format_plan", "sharding_plan"]

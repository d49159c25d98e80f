"""Per-device memory plan of a config on a mesh, without devices: shapes from eval_shape, partition
specs from the rule table on an ``AbstractMesh``, bytes by arithmetic.

``composer-jax params CONFIG --sharding mesh.fsdp=64 mesh.expert=8 --devices 512`` prints it, so a
pod can be planned on a laptop. Optimizer state is counted as the optimizer of ``optim.name`` keeps
it, in float32 and sharded like its parameter: AdamW = 2 moments per parameter; Muon = 1 momentum on
the matrices it orthogonalises (``train.optim.muon_dims``) and AdamW's 2 moments on the rest.
Activations are not counted.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import AbstractMesh

from composer_jax.config import Config, ConfigError
from composer_jax.parallel.mesh import resolve_axis_sizes
from composer_jax.parallel.rules import MESH_AXES, make_rules, spec_for, variable_axes


def _entry_axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _optimizer_moments(cfg: Config, axes: tuple, ndim: int, trained: bool) -> int:
  """float32 state tensors per parameter element."""
  if not trained:
    return 0
  if cfg.optim.name == "muon":
    from composer_jax.train.optim import muon_dims
    if muon_dims(axes, ndim) is not None:
      return 1
  return 2


def optimizer_description(cfg: Config) -> str:
  if cfg.optim.name == "muon":
    return "Muon: 1 fp32 momentum on matrices, AdamW 2 fp32 moments on the rest"
  return "AdamW: 2 fp32 moments per parameter"


def sharding_plan(cfg: Config, n_devices: int | None = None) -> dict:
  """Per-parameter partition specs and bytes per device for parameters and optimizer state."""
  from flax import nnx

  from composer_jax.model.build import abstract_model

  mc = cfg.mesh
  if n_devices is None:
    fixed = [getattr(mc, a) for a in MESH_AXES]
    n_devices = math.prod(fixed) if -1 not in fixed else jax.device_count()
  sizes = resolve_axis_sizes(mc, n_devices)
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  rules = make_rules(mc.rules)
  state = nnx.state(abstract_model(cfg))
  rows = []
  for path, var in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    name = ".".join(str(getattr(k, "key", k)) for k in path)
    axes = variable_axes(var)
    spec = spec_for(axes, var.shape, mesh, rules, what=f"param {name}")
    local = [d // math.prod(sizes[a] for a in _entry_axes(e)) for d, e in zip(var.shape, spec)]
    n_local = int(np.prod(local))
    trained = isinstance(var, nnx.Param)
    moments = _optimizer_moments(cfg, axes, len(var.shape), trained)
    rows.append({
        "name": name, "shape": list(var.shape), "dtype": str(np.dtype(var.dtype)),
        "axes": list(axes), "spec": [list(_entry_axes(e)) for e in spec],
        "param_bytes": n_local * np.dtype(var.dtype).itemsize, "opt_bytes": n_local * 4 * moments,
        "global_bytes": int(np.prod(var.shape)) * np.dtype(var.dtype).itemsize,
    })
  param_b = sum(r["param_bytes"] for r in rows)
  opt_b = sum(r["opt_bytes"] for r in rows)
  return {
      "mesh": sizes, "n_devices": n_devices, "optimizer": optimizer_description(cfg),
      "params": rows,
      "totals": {"param_bytes_per_device": param_b, "opt_bytes_per_device": opt_b,
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

"""Per-device memory plan of a config on a mesh, without devices: shapes from eval_shape, partition
specs from the rule table on an ``AbstractMesh``, bytes by arithmetic.

``composer-jax params CONFIG --sharding mesh.fsdp=64 mesh.expert=8 --devices 512`` prints it, so a
pod can be planned on a laptop. The optimizer state is what the run's optimizer really allocates:
``jax.eval_shape`` of ``build_optimizer(cfg.optim, ...).init`` on the abstract parameters (AdamW
moments, Muon momentum, the float32 master copy of ``optim.master_dtype``), each leaf sharded like
the parameter it belongs to (``optim.state_owners``), the rest (counts) replicated.

``memory_plan`` adds one training step at a sequence length (``--seq-len``): gradients, activations
(``train/memory.py``'s model of what the step allocates per device, with the remat policy and context
parallelism) and the optimizer update, and sets the total against a budget (``--budget-gb``). It
lives in ``train/`` because it reads the model and the optimizer.
"""

from __future__ import annotations

import copy
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
from composer_jax.train import memory, optim


def _entry_axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def optimizer_description(cfg: Config, master: bool) -> str:
  name = ("Muon on matrices, AdamW on the rest" if cfg.optim.name == "muon" else "AdamW")
  return name + (f", {cfg.optim.master_dtype} master copy" if master else "") + " (from eval_shape)"


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def mesh_sizes(cfg: Config, n_devices: int | None = None) -> tuple[dict, int]:
  """(mesh axis -> size, device count) for ``n_devices`` (default: the fixed axes' product, or the
  visible devices when an axis is -1)."""
  mc = cfg.mesh
  if n_devices is None:
    fixed = [getattr(mc, a) for a in MESH_AXES]
    n_devices = math.prod(fixed) if -1 not in fixed else jax.device_count()
  return resolve_axis_sizes(mc, n_devices), n_devices


_ABSTRACT: dict = {}


def _abstract(cfg: Config):
  """(state, params, axes, opt_state) by eval_shape, cached on what they depend on: a layout search
  plans one model on many meshes."""
  key = (repr(cfg.model), repr(cfg.optim), cfg.train.steps)
  if key not in _ABSTRACT:
    model = abstract_model(cfg)
    state, params = nnx.state(model), nnx.state(model, nnx.Param)
    axes = [variable_axes(v) for v in jax.tree.leaves(params, is_leaf=_is_var)]
    tx = optim.build_optimizer(cfg.optim, cfg.train.steps, params, axes)
    _ABSTRACT.clear()
    _ABSTRACT[key] = (state, params, axes, jax.eval_shape(tx.init, params))
  return _ABSTRACT[key]


def sharding_plan(cfg: Config, n_devices: int | None = None) -> dict:
  """Per-parameter partition specs and bytes per device for parameters and optimizer state."""
  sizes, n_devices = mesh_sizes(cfg, n_devices)
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  rules = make_rules(cfg.mesh.rules)
  state, params, axes, opt_state = _abstract(cfg)
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
        "trained": isinstance(var, nnx.Param), "local_elems": n_local,
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
               f"(all parameters: {_gib(t['global_param_bytes'])})")
  return "\n".join(lines)


def default_batch(cfg: Config, sizes: dict) -> int:
  """Sequences per batch shard per micro-step: data.batch_size / train.grad_accum over the shards
  of act_batch (data x fsdp x expert by default), at least 1."""
  n = math.prod(sizes[a] for a in make_rules(cfg.mesh.rules)["act_batch"] if sizes.get(a, 1) > 1)
  return max(1, -(-cfg.data.batch_size // (cfg.train.grad_accum * n)))


def memory_plan(cfg: Config, n_devices: int | None = None, seq_len: int | None = None,
                batch: int | None = None, budget_gb: float = 95.0) -> dict:
  """Per-device bytes of one training step: params, optimizer state, gradients and activations.

  total = params + optimizer + gradients + max(activations, optimizer update): the update runs
  after the backward, when the activations are freed. Bad input (a sequence the zigzag split
  cannot cut, a micro-batch below 1) raises a one-line ConfigError before any tracing.
  """
  sizes, n_devices = mesh_sizes(cfg, n_devices)
  seq = seq_len or cfg.data.seq_len
  batch = batch or default_batch(cfg, sizes)
  memory.check_shape(cfg, sizes, seq, batch)
  plan = sharding_plan(cfg, n_devices)
  act = memory.step_memory(cfg, sizes, seq, batch)
  trained = [r for r in plan["params"] if r["trained"]]
  grads = memory.gradient_bytes(sum(r["local_elems"] for r in trained),
                                sum(r["param_bytes"] for r in trained), cfg.train.grad_accum)
  update = memory.update_bytes(max(r["local_elems"] for r in trained))
  t = plan["totals"]
  parts = {"params": t["param_bytes_per_device"], "optimizer": t["opt_bytes_per_device"],
           "gradients": grads, "activations": act["activations"], "update": update}
  total = parts["params"] + parts["optimizer"] + grads + max(act["activations"], update)
  D = act["dims"]
  return {**plan, "step": {
      "seq_len": seq, "batch_per_shard": batch, "tokens_per_device": D.T, "remat": cfg.model.remat,
      "grad_accum": cfg.train.grad_accum, "bytes": parts, "total_bytes": total,
      "no_expert_axis": bool(cfg.model.n_moe_layers and D.ep == 1 and n_devices > 1),
      "budget_bytes": int(budget_gb * 1e9), "fits": total <= budget_gb * 1e9,
      "activation_terms": act["terms"]}}


def search_layouts(cfg: Config, n_devices: int, seq_len: int | None = None,
                   batch: int | None = None, budget_gb: float = 95.0) -> list[dict]:
  """Every mesh of ``n_devices`` with data = 1 and power-of-two expert, context and tensor axes
  (fsdp takes the rest) that the config accepts, planned with ``memory_plan``; sorted fitting
  first, then by total bytes. The rule table, remat policy and micro-batch stay the config's.

  With MoE layers the expert axis is at least 2: without one the routed experts run outside
  shard_map, where XLA cannot partition the GPU/TPU grouped-matmul kernels (custom calls) and
  would gather every device's tokens first, which the activation model does not count."""
  out = []
  pow2 = lambda n: [2 ** i for i in range(n.bit_length()) if n % 2 ** i == 0]
  min_ep = 2 if cfg.model.n_moe_layers else 1
  for e in [e for e in pow2(math.gcd(n_devices, cfg.model.n_routed_experts)) if e >= min_ep]:
    for t in pow2(math.gcd(n_devices // e, cfg.model.n_heads)):
      for c in pow2(n_devices // (e * t)):
        trial = copy.deepcopy(cfg)
        for axis, n in (("data", 1), ("expert", e), ("tensor", t), ("context", c), ("fsdp", -1)):
          setattr(trial.mesh, axis, n)
        try:
          plan = memory_plan(trial, n_devices, seq_len, batch, budget_gb)
        except ConfigError:  # a sequence or a weight the mesh cannot split
          continue
        out.append({"mesh": plan["mesh"], **{k: plan["step"][k] for k in (
            "bytes", "total_bytes", "fits", "tokens_per_device", "batch_per_shard")}})
  return sorted(out, key=lambda r: (not r["fits"], r["total_bytes"]))


def format_search(rows: list[dict], budget_gb: float, top: int = 12) -> str:
  head = (f"{'mesh':<46} {'tokens/dev':>10} {'params':>8} {'optim':>8} {'grads':>8} "
          f"{'activ':>8} {'total':>8}  budget {budget_gb:g} GB")
  lines = [head]
  for r in rows[:top]:
    b = r["bytes"]
    mesh = " x ".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1)
    lines.append(f"{mesh:<46} {r['tokens_per_device']:>10} " + " ".join(
        f"{b[k] / 1e9:8.1f}" for k in ("params", "optimizer", "gradients", "activations"))
        + f" {r['total_bytes'] / 1e9:8.1f}  {'FITS' if r['fits'] else 'DOES NOT FIT'}")
  n_fit = sum(r["fits"] for r in rows)
  lines.append(f"{n_fit} of {len(rows)} layouts fit (GB = 1e9 bytes)")
  return "\n".join(lines)


def _gb(n: float) -> str:
  return f"{n / 1e9:.1f} GB"


def format_step(plan: dict) -> str:
  """The step's activation terms, then one line: params / optimizer / gradients / activations /
  total against the budget, FITS or DOES NOT FIT (GB = 1e9 bytes)."""
  st = plan["step"]
  b = st["bytes"]
  mesh = " x ".join(f"{a}={s}" for a, s in plan["mesh"].items() if s > 1) or "1 device"
  head = (f"step: seq {st['seq_len']}, {st['batch_per_shard']} sequence(s) per batch shard, "
          f"{st['tokens_per_device']} tokens per device, remat {st['remat']}, grad_accum "
          f"{st['grad_accum']}; activation terms per device:")
  lines = [head]
  lines += [f"  {name:<52} {_gb(v):>10}" for name, v in st["activation_terms"].items()]
  upd = f" (optimizer update {_gb(b['update'])} after the backward)"
  verdict = "FITS" if st["fits"] else "DOES NOT FIT"
  if st["no_expert_axis"]:
    lines.append("  note: no expert axis: the routed experts run outside shard_map; XLA cannot "
                 "partition the GPU/TPU grouped-matmul kernels and would gather every device's "
                 "tokens first (not counted above; CPU's sorted path is partitioned)")
  lines.append(f"per device: params {_gb(b['params'])}, optimizer {_gb(b['optimizer'])}, gradients "
               f"{_gb(b['gradients'])}, activations {_gb(b['activations'])}{upd}, total "
               f"{_gb(st['total_bytes'])} / budget {_gb(st['budget_bytes'])} on {plan['n_devices']} "
               f"devices ({mesh}): {verdict}")
  return "\n".join(lines)


__all__ = ["ConfigError", "format_plan", "format_search", "format_step", "memory_plan",
           "search_layouts", "sharding_plan"]

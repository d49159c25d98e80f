"""A small pure train step (AdamW + lm_loss) run on any mesh, for the equivalence suite."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from composer_jax.config import load_config
from composer_jax.model import build_model, lm_loss
from composer_jax.parallel.mesh import build_mesh
from composer_jax.parallel.rules import activate, make_rules, spec_for, state_shardings

N_STEPS = 3
BATCH, SEQ = 8, 64
# Adam divides by sqrt(v) + eps: where a gradient entry is far below eps's scale, a rounding-level
# difference between meshes (1e-7 relative, from another summation order) becomes an update of
# full size. A larger eps bounds that amplification so "same params" is a meaningful check.
EPS = 1e-6


def tiny_config(*overrides):
  return load_config("configs/tiny.yaml", [f"data.seq_len={SEQ}", f"data.batch_size={BATCH}",
                                           *overrides])


def make_batches(cfg, n: int = N_STEPS, seed: int = 0) -> list[dict]:
  """Packed rows: two documents per row at a random split (positions restart, segment ids 1, 2)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    tokens = rng.integers(1, cfg.model.vocab_size, (BATCH, SEQ)).astype(np.int32)
    cut = rng.integers(8, SEQ - 8, (BATCH, 1))
    idx = np.arange(SEQ)[None]
    seg = np.where(idx < cut, 1, 2).astype(np.int32)
    seg[0, -5:] = 0  # some padding at the end of one row
    pos = np.where(idx < cut, idx, idx - cut).astype(np.int32)
    out.append({"tokens": tokens, "segment_ids": seg, "positions": pos,
                "loss_mask": (seg > 0).astype(np.float32)})
  return out


def _step_fn(graphdef, mcfg, tx):
  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    out = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    return lm_loss(out, batch["tokens"], batch["loss_mask"], mcfg, batch["segment_ids"])[0]

  def step(params, rest, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  return step


def initial_state(cfg):
  """The single-device model state every mesh starts from (placed onto each mesh by device_put)."""
  return nnx.split(build_model(cfg), nnx.Param, ...)


def train(cfg, mesh_overrides: dict | None, init, batches, router_bias: float = 0.0,
          ep_strategy: str | None = None) -> dict:
  """Run N_STEPS AdamW steps; returns host copies of losses, first-step grads and final params.

  ``mesh_overrides`` None = one device, no mesh. ``router_bias`` > 0 skews routing: experts 0 and 1
  get that selection bias in every MoE layer, so every token picks them.
  """
  graphdef, params, rest = init
  if router_bias:
    rest = jax.tree.map(lambda v: v.at[:2].set(router_bias), rest)
  tx = optax.adamw(1e-3, b1=0.9, b2=0.95, eps=EPS, weight_decay=0.1)
  step = _step_fn(graphdef, cfg.model, tx)
  mesh, rules, options = None, None, {}
  if mesh_overrides is not None:
    mc = cfg.mesh
    for k, v in {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, "context": 1,
                 **mesh_overrides}.items():
      setattr(mc, k, v)
    mesh, rules = build_mesh(mc), make_rules(mc.rules)
    params = jax.device_put(params, state_shardings(params, mesh, rules))
    rest = jax.device_put(rest, state_shardings(rest, mesh, rules))
    spec = spec_for(("act_batch", "act_seq"), (BATCH, SEQ), mesh, rules, strict=False)
    batches = [jax.device_put(b, NamedSharding(mesh, spec)) for b in batches]
    if ep_strategy:
      options["ep_strategy"] = ep_strategy
  losses, grads0 = [], None
  with activate(mesh, rules, **options):
    opt_state = jax.jit(tx.init)(params)
    jstep = jax.jit(step)
    for b in batches:
      params, opt_state, loss, grads = jstep(params, rest, opt_state, b)
      losses.append(float(loss))
      if grads0 is None:
        grads0 = grads
  host = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(t))
  return {"losses": np.asarray(losses), "grads": host(grads0), "params": host(params),
          "mesh": None if mesh is None else dict(mesh.shape)}


def max_rel_diff(a, b) -> float:
  """Largest per-tensor ||a - b|| / ||b|| over matching leaves."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  worst = 0.0
  for x, y in zip(la, lb):
    denom = max(float(np.linalg.norm(y)), 1e-30)
    worst = max(worst, float(np.linalg.norm(x - y)) / denom)
  return worst


__all__ = ["initial_state", "make_batches", "max_rel_diff", "tiny_config", "train"]

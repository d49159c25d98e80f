"""Optimizers against NumPy float64 references: schedules, Muon's first step, AdamW decay masks,
clipping, and optimizer-state shardings that follow the parameters."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import OptimConfig
from composer_jax.train import optim

NS = (3.4445, -4.775, 2.0315)


def ns5_ref(g: np.ndarray) -> np.ndarray:
  x = g.astype(np.float64)
  t = x.shape[0] > x.shape[1]
  x = x.T if t else x
  x = x / (np.linalg.norm(x) + 1e-8)
  for _ in range(5):
    a = x @ x.T
    x = NS[0] * x + (NS[1] * a + NS[2] * a @ a) @ x
  return x.T if t else x


def lr_ref(cfg: OptimConfig, total: int, step: int) -> float:
  peak, floor, w = cfg.lr, cfg.lr * cfg.min_lr_ratio, cfg.warmup_steps
  if step < w:
    return peak * step / w
  if cfg.schedule == "constant":
    return peak
  if cfg.schedule == "cosine":
    frac = min((step - w) / (total - w), 1.0)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))
  decay = round(cfg.decay_fraction * total)
  start = total - decay
  if step < start:
    return peak
  return peak + (floor - peak) * min((step - start) / decay, 1.0)


@pytest.mark.parametrize("kind", ["constant", "cosine", "wsd"])
def test_schedules(kind):
  cfg = OptimConfig(schedule=kind, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
  fn = optim.schedule(cfg, 100)
  for step in [0, 3, 10, 11, 50, 79, 80, 90, 99, 100]:
    np.testing.assert_allclose(float(fn(step)), lr_ref(cfg, 100, step), rtol=1e-5, atol=1e-9)


def _params():
  k = jax.random.split(jax.random.key(0), 4)
  params = {"embed": jax.random.normal(k[0], (32, 8)), "w": jax.random.normal(k[1], (8, 12)),
            "experts": jax.random.normal(k[2], (4, 8, 6)), "norm": jnp.ones((8,))}
  axes = {"embed": ("vocab", "embed"), "w": ("embed", "mlp"),
          "experts": ("exp", "exp_embed", "exp_mlp"), "norm": ("norm",)}
  grads = jax.tree.map(lambda p: jax.random.normal(k[3], p.shape), params)
  return params, axes, grads


def test_muon_first_step_matches_newton_schulz_reference():
  params, axes, grads = _params()
  cfg = OptimConfig(name="muon", lr=0.02, weight_decay=0.1, warmup_steps=0, schedule="constant",
                    clip_norm=0.0)
  tx = optim.build_optimizer(cfg, 10, params, axes)
  upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  lr, wd = cfg.lr, cfg.weight_decay
  # Matrices: orthogonalised momentum, RMS-matched (0.2 sqrt(max dim)), decoupled decay.
  want_w = -lr * (0.2 * math.sqrt(12) * ns5_ref(np.asarray(grads["w"])) + wd * np.asarray(params["w"]))
  np.testing.assert_allclose(upd["w"], want_w, rtol=2e-4, atol=2e-6)
  # Expert weights: each expert's matrix on its own.
  for e in range(4):
    want = -lr * (0.2 * math.sqrt(8) * ns5_ref(np.asarray(grads["experts"][e]))
                  + wd * np.asarray(params["experts"][e]))
    np.testing.assert_allclose(upd["experts"][e], want, rtol=2e-4, atol=2e-6)
  # Embedding (vocab axis) -> AdamW: first bias-corrected step is sign(g); norms are not decayed.
  want_e = -lr * (np.sign(grads["embed"]) + wd * np.asarray(params["embed"]))
  np.testing.assert_allclose(upd["embed"], want_e, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(upd["norm"], -lr * np.sign(grads["norm"]), rtol=1e-4, atol=1e-6)


def test_newton_schulz_output_is_nearly_orthogonal():
  g = np.random.default_rng(0).normal(size=(16, 40))
  s = np.linalg.svd(ns5_ref(g), compute_uv=False)
  assert 0.6 < s.min() and s.max() < 1.25  # the quintic's known band around 1


def test_adamw_decay_mask_and_clipping():
  params, axes, grads = _params()
  cfg = OptimConfig(name="adamw", lr=0.1, weight_decay=0.5, warmup_steps=0, schedule="constant",
                    clip_norm=1e-3)
  tx = optim.build_optimizer(cfg, 10, params, axes)
  # Zero gradients on w and norm (embed's keeps the update live: optim.skip_zero_grads): w only decays.
  zero = {**jax.tree.map(jnp.zeros_like, grads), "embed": grads["embed"]}
  upd, _ = jax.jit(tx.update)(zero, tx.init(params), params)
  np.testing.assert_allclose(upd["w"], -0.1 * 0.5 * np.asarray(params["w"]), rtol=1e-6)
  np.testing.assert_array_equal(upd["norm"], 0.0)
  # Clipping comes first: Adam's second moment after one step is (1 - b2) * clipped_grad**2.
  _, st = jax.jit(tx.update)(grads, tx.init(params), params)
  nus = jax.tree.leaves(st[1][0].nu)
  total = sum(float(np.sum(np.asarray(v, np.float64))) for v in nus) / (1 - cfg.b2)
  np.testing.assert_allclose(math.sqrt(total), 1e-3, rtol=1e-4)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_an_all_zero_gradient_leaves_parameters_and_state_alone(name):
  """RL batches whose groups all scored alike have gradient 0; AdamW's momentum alone would still
  move the weights by b1/sqrt(b2) = 0.92 of the last step (reference below). The update is skipped."""
  params, axes, grads = _params()
  cfg = OptimConfig(name=name, lr=0.01, weight_decay=0.1, warmup_steps=0, schedule="constant",
                    clip_norm=1.0)
  tx = optim.build_optimizer(cfg, 10, params, axes)
  update = jax.jit(tx.update)
  u1, st1 = update(grads, tx.init(params), params)
  assert float(optax_norm(u1)) > 0
  zero = jax.tree.map(jnp.zeros_like, grads)
  u2, st2 = update(zero, st1, params)
  for a in jax.tree.leaves(u2):
    np.testing.assert_array_equal(a, 0.0)
  for a, b in zip(jax.tree.leaves(st2), jax.tree.leaves(st1), strict=True):
    np.testing.assert_array_equal(a, b)
  # A live gradient after the skip steps as if the zero step never happened.
  u3, _ = update(grads, st2, params)
  u3_ref, _ = update(grads, st1, params)
  jax.tree.map(np.testing.assert_array_equal, u3, u3_ref)
  if name == "adamw":  # what the skip avoids: plain optax AdamW moves on a zero gradient
    ref = optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.0)
    _, s = ref.update(grads["norm"], ref.init(params["norm"]), params["norm"])
    drift, _ = ref.update(jnp.zeros_like(grads["norm"]), s, params["norm"])
    m, v = (1 - cfg.b1) * cfg.b1 * np.asarray(grads["norm"]), (1 - cfg.b2) * cfg.b2 * np.asarray(grads["norm"]) ** 2
    want = -cfg.lr * (m / (1 - cfg.b1 ** 2)) / (np.sqrt(v / (1 - cfg.b2 ** 2)) + cfg.eps)
    np.testing.assert_allclose(drift, want, rtol=1e-5)


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def test_muon_labels_follow_axes():
  assert optim.muon_dims(("vocab", "embed"), 2) is None
  assert optim.muon_dims(("norm",), 1) is None
  d = optim.muon_dims(("exp", "exp_embed", "exp_mlp"), 3)
  assert d.reduction_axis == (1,) and d.output_axis == (2,)
  d = optim.muon_dims(("kv_lora", "heads", "head_dim"), 3)
  assert d.reduction_axis == (0,) and d.output_axis == (1, 2)


def test_optimizer_state_is_sharded_like_params():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "expert"))
  params, axes, _ = _params()
  shard = {"embed": P("fsdp", None), "w": P("fsdp", None), "experts": P("expert", "fsdp", None),
           "norm": P()}
  p_sh = {k: NamedSharding(mesh, v) for k, v in shard.items()}
  params = jax.device_put(params, p_sh)
  tx = optim.build_optimizer(OptimConfig(name="muon"), 10, params, axes)
  o_sh = optim.state_shardings(tx, params, p_sh, NamedSharding(mesh, P()))
  state = jax.jit(tx.init, out_shardings=o_sh)(params)
  by_shape = {v.shape: shard[k] for k, v in params.items()}
  leaves = [x for x in jax.tree.leaves(state) if x.shape in by_shape]
  assert len(leaves) == 2 + 2 * 2  # muon momenta (w, experts) + adam mu and nu (embed, norm)
  for x in leaves:
    assert x.sharding.spec == by_shape[x.shape], (x.shape, x.sharding.spec)


def test_qk_clip_scales():
  logits = jnp.array([50.0, 100.0, 400.0])
  root, gamma = optim.qk_clip_scales(logits, 100.0)
  np.testing.assert_allclose(gamma, [1.0, 1.0, 0.25])
  np.testing.assert_allclose(root ** 2, gamma, rtol=1e-6)


def test_bad_optim_config_is_one_line():
  from composer_jax.config import ConfigError, load_config
  with pytest.raises(ConfigError, match="optim.qk_clip"):
    load_config(None, ["optim.qk_clip=-1"])


@pytest.mark.parametrize("q_lora", [64, 0])
def test_qk_clip_brings_clipped_heads_to_tau(q_lora):
  """After MuonClip on the recorded logits, the same batch's per-head max logit is exactly
  min(max, tau): nope parts scale by sqrt(g)*sqrt(g), rope parts by g*1 (shared key untouched)."""
  from flax import nnx

  from composer_jax.config import load_config
  from composer_jax.model import build_model
  from composer_jax.train.step import apply_qk_clip, pop_max_logits
  cfg = load_config("configs/tiny.yaml", [f"model.q_lora_rank={q_lora}", "model.init_std=0.3",
                                           "model.n_layers=2", "model.mtp_depths=0"])
  model = build_model(cfg, seed=1)
  model.set_attributes(record_max_logit=True, raise_if_not_found=False)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 0, cfg.model.vocab_size)
  fwd = nnx.jit(lambda m: pop_max_logits((m(tokens), m)[1]))
  before = np.asarray(fwd(model))
  tau = float(np.median(before))  # clip about half the heads
  apply_qk_clip(model, jnp.asarray(before), tau)
  # Only layer 0's input is unchanged by the clip (later layers see clipped attention outputs).
  after = np.asarray(fwd(model))
  np.testing.assert_allclose(after[0], np.minimum(before[0], tau), rtol=1e-4)
  assert (before > tau).any()

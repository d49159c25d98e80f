"""The pure train step: gradient accumulation equals one big batch, the router-bias update follows
the aux-loss-free rule, and bits/byte matches a float64 reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import load_config
from composer_jax.data.pipeline import target_mask
from composer_jax.train import optim
from composer_jax.train.step import (
  bits_per_byte_sums,
  make_train_step,
  param_axes,
  split_model,
)

SMALL = ["model.vocab_size=64", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
         "model.q_lora_rank=0", "model.kv_lora_rank=8", "model.qk_nope_dim=4", "model.qk_rope_dim=4",
         "model.v_head_dim=4", "model.n_routed_experts=4", "model.n_group=1", "model.topk_group=1",
         "model.moe_ffn_dim=8", "model.dense_ffn_dim=16", "model.max_seq_len=16", "model.mtp_depths=1",
         "model.bias_update_rate=0.01", "data.seq_len=16", "data.batch_size=4",
         "rl.max_context=0"]  # 0 = the (shrunk) model length, whatever the YAML's rl section says


@pytest.fixture(scope="module")
def setup():
  from composer_jax.model import build_model
  # No warmup: the first step's learning rate is the peak (warmup starts at 0 and moves nothing).
  cfg = load_config("configs/tiny.yaml", SMALL + ["optim.warmup_steps=0", "optim.qk_clip=0"])
  graphdef, params, rest = split_model(build_model(cfg, seed=0))
  rng = np.random.default_rng(0)
  seg = np.repeat(np.array([[1] * 10 + [2] * 6]), 4, 0).astype(np.int32)
  seg[:, 14:] = 0  # a padded tail (the same in every row, so micro-batches weigh alike)
  pos = np.where(seg == 1, np.arange(16), np.arange(16) - 10).astype(np.int32)
  batch = {"tokens": rng.integers(1, 64, size=(4, 16)).astype(np.int32), "segment_ids": seg,
           "positions": np.where(seg > 0, pos, 0).astype(np.int32),
           "loss_mask": target_mask(seg)}
  return cfg, graphdef, params, rest, batch


def _state(cfg, params, rest):
  tx = optim.build_optimizer(cfg.optim, 10, params, param_axes(params))
  return tx, {"params": params, "rest": rest, "opt_state": tx.init(params),
              "step": jnp.int32(0), "rng": jax.random.key_data(jax.random.key(0))}


def test_grad_accumulation_equals_one_batch_and_bias_update(setup):
  cfg, graphdef, params, rest, batch = setup
  outs = {}
  for accum in (1, 2):
    cfg.train.grad_accum = accum
    tx, state = _state(cfg, params, rest)
    step = jax.jit(make_train_step(graphdef, cfg, tx))
    outs[accum] = step(state, batch)
  cfg.train.grad_accum = 1
  (s1, m1), (s2, m2) = outs[1], outs[2]
  # Exact up to float32 summation order: every micro-batch has the same number of targets per depth
  # (accumulation weighs micro-batches by their next-token target count).
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=2e-5)
  for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert int(s1["step"]) == 1 and m1["target_tokens"] == batch["loss_mask"].sum()
  # Router bias: bias += rate * sign(mean load - load), loads from the forward pass before the step.
  model = nnx.merge(graphdef, params, rest)
  out = model(batch["tokens"], batch["segment_ids"], batch["positions"])
  loads = np.asarray(out.router_loads, np.float64)
  new = [np.asarray(m.router_bias[...]) for m in nnx.merge(graphdef, s1["params"], s1["rest"]).moe_modules()]
  old = [np.asarray(m.router_bias[...]) for m in model.moe_modules()]
  assert len(new) == loads.shape[0] == 2  # the MoE layer and the MTP block
  for i in range(len(new)):
    want = old[i] + 0.01 * np.sign(loads[i].mean() - loads[i])
    np.testing.assert_allclose(new[i], want, atol=1e-7)
  # The parameters took AdamW's first step, computed here in float64 from jax.grad of the loss:
  # clip to global norm 1, then p - lr * (g / (|g| + eps) + wd * p) (decay on matrices only).
  from composer_jax.train.step import lm_loss_fn
  oc = cfg.optim
  g = jax.jit(jax.grad(lambda p: lm_loss_fn(nnx.merge(graphdef, p, rest), batch, cfg)[0]))(params)
  g = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
  norm = math.sqrt(sum((x ** 2).sum() for x in g))
  scale = min(1.0, oc.clip_norm / norm)
  moved = 0
  for p0, gi, p1 in zip(jax.tree.leaves(params), g, jax.tree.leaves(s1["params"])):
    p0 = np.asarray(p0, np.float64)
    gc = gi * scale
    upd = gc / (np.abs(gc) + oc.eps) + (oc.weight_decay * p0 if p0.ndim >= 2 else 0.0)
    np.testing.assert_allclose(np.asarray(p1, np.float64), p0 - oc.lr * upd, rtol=0, atol=2e-6)
    moved += int((np.abs(np.asarray(p1, np.float64) - p0) > 0.5 * oc.lr).sum())
  assert moved > 0.5 * sum(x.size for x in g)  # most weights moved by about lr
  assert not np.array_equal(np.asarray(s1["rng"]), np.asarray(jax.random.key_data(jax.random.key(0))))


def test_bits_per_byte_matches_float64_reference():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 6, 10)).astype(np.float32)
  tokens = rng.integers(0, 10, size=(2, 6)).astype(np.int32)
  mask = rng.integers(0, 2, size=(2, 6)).astype(np.int32)
  lengths = rng.integers(0, 4, size=10).astype(np.int32)
  bits, nbytes = bits_per_byte_sums(jnp.asarray(logits), tokens, mask, lengths)
  lg = logits.astype(np.float64)
  logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
  want_bits = want_bytes = 0.0
  for b in range(2):
    for t in range(1, 6):
      if mask[b, t]:
        want_bits -= logp[b, t - 1, tokens[b, t]] / math.log(2)
        want_bytes += lengths[tokens[b, t]]
  np.testing.assert_allclose(float(bits), want_bits, rtol=1e-5)
  assert float(nbytes) == want_bytes


def test_custom_loss_fn_and_rank4_batch_leaves_on_a_mesh(setup):
  """The RL learner's route: build_trainer with its own loss and batch dict on a data=2 mesh.

  A loss equal to the default gives the default step's parameters; an extra [b, s, 2, 3] leaf is
  sharded on its batch dim and reaches the loss (its mean becomes a metric).
  """
  from composer_jax.parallel.mesh import build_mesh
  from composer_jax.train.loop import build_trainer, put_batch
  from composer_jax.train.step import lm_loss_fn
  cfg = load_config("configs/tiny.yaml", SMALL + ["mesh.data=2"])
  mesh = build_mesh(cfg.mesh, jax.devices()[:2])
  batch = dict(setup[4])
  extra = np.arange(4 * 16 * 2 * 3, dtype=np.float32).reshape(4, 16, 2, 3)

  def my_loss(model, b, c):
    loss, metrics, out = lm_loss_fn(model, b, c)
    return loss, {**metrics, "extra_mean": b["extra"].mean()}, out

  ref = build_trainer(cfg, mesh)
  s_ref, _ = ref.step_fn(ref.state, put_batch(ref, batch))
  tr = build_trainer(cfg, mesh, loss_fn=my_loss, batch_keys=tuple(batch) + ("extra",))
  put = put_batch(tr, {**batch, "extra": extra})
  assert put["extra"].sharding.spec[0] == "data" and put["extra"].addressable_shards[0].data.shape == (2, 16, 2, 3)
  s, m = tr.step_fn(tr.state, put)
  assert float(m["extra_mean"]) == extra.mean()
  for a, b in zip(jax.tree.leaves(s_ref["params"]), jax.tree.leaves(s["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

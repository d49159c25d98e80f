"""Layer-by-layer numerics against the float64 NumPy reference in reference.py.

Tolerance: our float32 forward (matmul precision "highest") agrees with float64 to 2e-4 relative
to the largest magnitude of each output — float32 rounding through a few layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import load_config
from composer_jax.model import build_model, layers, routing
from composer_jax.model.moe import dropless_moe
from tests.model import reference as ref

RTOL = 2e-4

OVR = ["model.vocab_size=97", "model.d_model=32", "model.n_layers=3", "model.n_dense_layers=1",
       "model.dense_ffn_dim=48", "model.n_heads=2", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_dim=8", "model.qk_rope_dim=8", "model.v_head_dim=8",
       "model.n_routed_experts=8", "model.n_experts_per_tok=3", "model.moe_ffn_dim=16",
       "model.n_group=4", "model.topk_group=2", "model.routed_scaling_factor=2.5",
       "model.mtp_depths=1", "model.init_std=0.2", "model.yarn_factor=8.0",
       "model.yarn_original_max_position=16", "model.yarn_beta_fast=32", "model.yarn_beta_slow=1",
       "model.yarn_mscale_all_dim=1.0", "data.seq_len=12", "model.max_seq_len=64",
       "rl.max_context=64"]


def close(ours, theirs, rtol=RTOL):
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  err = np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-12)
  assert err <= rtol, f"relative max error {err:.2e} > {rtol:.0e}"


def make(extra=()):
  cfg = load_config("configs/tiny.yaml", OVR + list(extra))
  model = build_model(cfg, seed=3)
  # A non-zero selection bias so that selection and weighting really differ.
  for i, layer in enumerate(model.moe_modules()):
    layer.router_bias.set_value(0.05 * jax.random.normal(jax.random.PRNGKey(10 + i), layer.router_bias.shape))
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model)))
  return cfg, model, params


@pytest.fixture(scope="module")
def setup():
  return make()


def test_rmsnorm(setup):
  cfg, _, _ = setup
  x = np.random.RandomState(0).randn(3, 5, 32)
  w = np.random.RandomState(1).rand(32) + 0.5
  norm = layers.RMSNorm(32, cfg.model)
  norm.scale.set_value(jnp.asarray(w, jnp.float32))
  close(norm(jnp.asarray(x, jnp.float32)), ref.rms(x, w, cfg.model.rms_eps))


@pytest.mark.parametrize("factor", [1.0, 8.0, 40.0])
def test_rope_yarn(setup, factor):
  cfg, _, _ = setup
  import dataclasses
  m = dataclasses.replace(cfg.model, yarn_factor=factor, yarn_original_max_position=32)
  x = np.random.RandomState(0).randn(2, 40, 3, m.qk_rope_dim)
  pos = np.broadcast_to(np.arange(40), (2, 40))
  cos, sin = layers.rope_cos_sin(jnp.asarray(pos), m)
  ours = layers.apply_rope(jnp.asarray(x, jnp.float32), cos, sin)
  theirs = ref.rope(x, pos.astype(np.float64), m)
  # Our pairs stay interleaved, HF's come out de-interleaved: compare in HF's order.
  d = m.qk_rope_dim
  perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
  close(np.asarray(ours)[..., perm], theirs, rtol=1e-5)


def test_yarn_softmax_scale(setup):
  _cfg, _, _ = setup
  # K2 fields: factor 32, mscale_all_dim 1 -> (0.1 ln 32 + 1)^2 / sqrt(192)
  k2 = load_config("configs/kimi-k2.yaml").model
  assert layers.softmax_scale(k2) == pytest.approx((0.1 * np.log(32) + 1) ** 2 / np.sqrt(192), rel=1e-12)


@pytest.mark.parametrize("scoring,n_group", [("sigmoid", 4), ("sigmoid", 1), ("softmax", 2)])
def test_router(setup, scoring, n_group):
  import dataclasses
  cfg = dataclasses.replace(setup[0].model, scoring=scoring, n_group=n_group,
                            topk_group=min(2, n_group))
  rs = np.random.RandomState(2)
  logits = rs.randn(50, 8)
  bias = 0.3 * rs.randn(8)
  ids, w, _ = routing.route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
  for t in range(50):
    rid, rw = ref.route_token(logits[t], bias, cfg)
    assert sorted(np.asarray(ids[t]).tolist()) == sorted(rid.tolist())
    order = np.argsort(np.asarray(ids[t]))
    close(np.asarray(w[t])[order], rw[np.argsort(rid)], rtol=1e-5)


def test_router_replay_uses_given_ids(setup):
  cfg = setup[0].model
  rs = np.random.RandomState(4)
  logits = jnp.asarray(rs.randn(20, 8), jnp.float32)
  forced = jnp.asarray(rs.randint(0, 8, (20, 3)), jnp.int32)
  ids, w, _scores = routing.route(logits, None, cfg, replay_ids=forced)
  np.testing.assert_array_equal(ids, forced)
  s = np.asarray(jax.nn.sigmoid(logits))
  picked = np.take_along_axis(s, np.asarray(forced), -1)
  close(w, picked / picked.sum(-1, keepdims=True) * cfg.routed_scaling_factor, rtol=1e-6)


def test_bias_update_and_aux_loss(setup):
  cfg = setup[0].model
  load = jnp.asarray([0.5, 0.1, 0.1, 0.3, 0.0, 0.0, 0.0, 0.0])
  new = routing.update_router_bias(jnp.zeros(8), load, 0.01)
  np.testing.assert_allclose(new, 0.01 * np.sign(load.mean() - np.asarray(load)))
  # Sequence-wise aux loss, straight from the DeepSeek-V3 definition.
  import dataclasses
  c = dataclasses.replace(cfg, seq_aux_loss_coef=0.01)
  rs = np.random.RandomState(5)
  logits = rs.randn(2 * 6, 8)
  ids, _, scores = routing.route(jnp.asarray(logits, jnp.float32), None, c)
  got = routing.sequence_aux_loss(scores, ids, 2, c)
  s = ref.sigmoid(logits).reshape(2, 6, 8)
  sn = s / s.sum(-1, keepdims=True)
  idn = np.asarray(ids).reshape(2, 6, 3)
  want = 0.0
  for b in range(2):
    f = np.array([(idn[b] == e).sum() for e in range(8)]) * 8 / (3 * 6)
    want += (f * sn[b].mean(0)).sum()
  assert float(got) == pytest.approx(0.01 * want / 2, rel=1e-5)


def test_moe_layer(setup):
  cfg, model, params = setup
  layer = model.layers[1].mlp
  x = np.random.RandomState(6).randn(2, 7, 32)
  y, stats = layer(jnp.asarray(x, jnp.float32))
  want, want_ids = ref.moe(params["layers"][1]["mlp"], x, cfg.model)
  close(y, want)
  got_ids = np.sort(np.asarray(stats.expert_ids).reshape(-1, 3), -1)
  np.testing.assert_array_equal(got_ids, np.sort(want_ids, -1))
  np.testing.assert_allclose(np.asarray(stats.load).sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("q_lora", [24, 0])
def test_mla_with_segments(q_lora):
  cfg, model, params = make([f"model.q_lora_rank={q_lora}"])
  x = np.random.RandomState(7).randn(2, 10, 32)
  seg = np.array([[1] * 4 + [2] * 6, [1] * 7 + [0] * 3])
  pos = np.broadcast_to(np.arange(10), (2, 10))
  cos, sin = layers.rope_cos_sin(jnp.asarray(pos), cfg.model)
  out, _ = model.layers[0].attn(jnp.asarray(x, jnp.float32), cos, sin, jnp.asarray(seg))
  want = ref.mla(params["layers"][0]["attn"], x, pos.astype(np.float64), seg, cfg.model)
  close(out, want)


def test_full_model_and_mtp(setup):
  cfg, model, params = setup
  tokens = np.random.RandomState(8).randint(0, 97, (2, 12))
  out = model(jnp.asarray(tokens))
  logits, mtp = ref.forward(params, tokens, cfg.model)
  close(out.logits, logits)
  assert len(out.mtp_logits) == 1
  close(out.mtp_logits[0], mtp[0])


def test_sorted_dispatch_is_dropless_under_skew(setup):
  _cfg, model, _ = setup
  layer = model.layers[1].mlp
  rs = np.random.RandomState(9)
  x = jnp.asarray(rs.randn(40, 32), jnp.float32)
  ids = jnp.tile(jnp.asarray([[5, 2, 7]], jnp.int32), (40, 1))  # every token to the same experts
  w = jnp.full((40, 3), 1.0 / 3)
  y = dropless_moe(x, ids, w, layer.w_gate[...], layer.w_up[...], layer.w_down[...])
  xn = np.asarray(x, np.float64)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), {"g": layer.w_gate[...], "u": layer.w_up[...],
                                                          "d": layer.w_down[...]})
  want = sum((ref.silu(xn @ p["g"][e]) * (xn @ p["u"][e])) @ p["d"][e] for e in (5, 2, 7)) / 3
  close(y, want)


def test_decode_matches_forward():
  """Prefill + step decode over the latent cache reproduces the full forward (2e-5 relative)."""
  from composer_jax.model import init_cache
  cfg, model, _ = make()
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 14), 0, 97)
  full = model(tokens).logits
  run = nnx.jit(lambda m, t, c: m(t, cache=c))  # one compile for prefill, one for the step
  out = run(model, tokens[:, :9], init_cache(cfg.model, 2, 16))
  logits, cache = [out.logits], out.cache
  for t in range(9, 14):
    o = run(model, tokens[:, t:t + 1], cache)
    cache = o.cache
    logits.append(o.logits)
  close(jnp.concatenate(logits, 1), full, rtol=2e-5)
  assert int(cache.index[0]) == 14
  assert cache.layers[0].c.shape[-1] + cache.layers[0].k_pe.shape[-1] == 24  # kv_lora + rope only


def test_replay_reproduces_logits_and_routing():
  _cfg, model, _ = make()
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 97)
  first = model(tokens, return_routing=True)
  assert first.routed_experts.shape == (2, 2, 12, 3)
  again = model(tokens, routed_experts=first.routed_experts)
  np.testing.assert_array_equal(first.logits, again.logits)


def test_remat_and_bf16_policies_give_same_gradients():
  cfg, model, _ = make()
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, 97)
  from composer_jax.model import lm_loss

  @nnx.jit
  def grads(m):
    def f(mm):
      return lm_loss(mm(tokens), tokens, None, cfg.model)[0]
    return nnx.grad(f)(m)

  g0 = grads(model)
  _cfg_r, model_r, _ = make(["model.remat=full"])
  g1 = grads(model_r)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # bf16 compute (f32 params): routing may flip for a few tokens, so compare the loss (2 %).
  _cfg_b, model_b, _ = make(["model.compute_dtype=bfloat16"])
  fwd = nnx.jit(lambda m: (m(tokens).logits, lm_loss(m(tokens), tokens, None, cfg.model)[0]))
  logits_b, loss_b = fwd(model_b)
  assert logits_b.dtype == jnp.bfloat16
  assert float(loss_b) == pytest.approx(float(fwd(model)[1]), rel=2e-2)


def test_masked_softmax_and_its_vjp():
  """The custom-VJP masked softmax against float64 NumPy: the forward, and the VJP against central
  differences of the float64 forward along random directions (a fully masked row gives zeros both
  ways). Tolerance 1e-6 absolute (values of order 1) and 1e-5 relative (directional derivatives)."""
  from composer_jax.model.mla import masked_softmax
  rng = np.random.default_rng(5)
  s = rng.standard_normal((2, 3, 5, 7)).astype(np.float32) * 4
  mask = rng.random((2, 1, 5, 7)) < 0.6
  mask[0, 0, 2] = False  # a row with no valid key
  g = rng.standard_normal(s.shape).astype(np.float32)
  p, vjp = jax.vjp(lambda x: masked_softmax(x, jnp.asarray(mask)), jnp.asarray(s))
  (ds,) = vjp(jnp.asarray(g))

  def np_softmax(x):
    x = np.where(mask, x, -np.inf)
    e = np.where(mask, np.exp(x - np.max(x, -1, keepdims=True, initial=-1e300)), 0.0)
    return e / np.maximum(e.sum(-1, keepdims=True), 1e-300)

  np.testing.assert_allclose(np.asarray(p), np_softmax(s.astype(np.float64)), atol=1e-6)
  assert not np.asarray(p)[0, :, 2].any()
  eps = 1e-5
  for _ in range(3):
    v = rng.standard_normal(s.shape)
    fd = np.sum(g * (np_softmax(s + eps * v) - np_softmax(s - eps * v))) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(ds, np.float64) * v), fd, rtol=1e-5, atol=1e-6)

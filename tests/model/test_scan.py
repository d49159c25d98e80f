"""Scanned layers (model.scan_layers): the stacked MoE layers run by nnx.scan compute what the loop
of per-layer modules computes, given the same weights (the loop's parameters stacked).

Tolerance: float32, matmul precision "highest"; outputs agree to 1e-5 relative (max |diff| over the
largest magnitude; per-tensor relative L2 for gradients and parameters). Only the order of float32
operations differs (observed ~1e-7); routing choices are compared exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import ConfigError, load_config
from composer_jax.model import (
  abstract_model,
  build_model,
  count_params,
  init_cache,
  lm_loss,
)
from composer_jax.model.scan import STACK, layer_paths
from composer_jax.train.step import make_train_step, split_model

TOL = 1e-5
SMALL = ["model.vocab_size=97", "model.d_model=32", "model.n_layers=4", "model.n_dense_layers=1",
         "model.dense_ffn_dim=48", "model.n_heads=2", "model.q_lora_rank=24", "model.kv_lora_rank=16",
         "model.qk_nope_dim=8", "model.qk_rope_dim=8", "model.v_head_dim=8",
         "model.n_routed_experts=8", "model.n_experts_per_tok=2", "model.moe_ffn_dim=16",
         "model.n_group=4", "model.topk_group=2", "model.mtp_depths=1", "model.init_std=0.2",
         "model.seq_aux_loss_coef=0.01", "model.max_seq_len=64", "data.seq_len=16",
         "data.batch_size=2", "rl.max_context=0"]


def configs(*extra):
  return (load_config("configs/tiny.yaml", SMALL + list(extra)),
          load_config("configs/tiny.yaml", SMALL + ["model.scan_layers=true", *extra]))


def flat(tree) -> dict:
  """{path: float64 array} of an nnx State (Variables or plain arrays as leaves)."""
  get = lambda v: v.get_value() if isinstance(v, nnx.Variable) else v
  return {tuple(p): np.asarray(get(v), np.float64) for p, v in nnx.to_flat_state(tree)}


def to_scan(loop_flat: dict, mcfg) -> dict:
  """Loop-layout leaves -> the scan layout's leaves (the MoE layers' stacked on axis 0)."""
  out = {}
  for path, _ in nnx.to_flat_state(nnx.state(abstract_model(mcfg))):
    paths = layer_paths(path, mcfg.n_dense_layers, mcfg.n_moe_layers)
    if paths[0] not in loop_flat:  # e.g. gradients hold no router bias
      continue
    out[tuple(path)] = (np.stack([loop_flat[p] for p in paths]) if path[0] == STACK
                        else loop_flat[paths[0]])
  return out


def scan_copy(loop_model, mcfg):
  """A scan_layers model holding ``loop_model``'s weights."""
  graphdef, state = nnx.split(abstract_model(mcfg))
  values = to_scan(flat(nnx.state(loop_model)), mcfg)
  for path, var in nnx.to_flat_state(state):
    var.set_value(jnp.asarray(values[tuple(path)], var.dtype))
  return nnx.merge(graphdef, state)


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def max_rel_l2(got: dict, ref: dict) -> float:
  assert got.keys() == ref.keys()
  return max(float(np.linalg.norm(got[k] - ref[k]) / max(np.linalg.norm(ref[k]), 1e-30)) for k in ref)


@pytest.fixture(scope="module")
def pair():
  cfg_loop, cfg_scan = configs()
  loop = build_model(cfg_loop, seed=3)
  for i, moe in enumerate(loop.moe_modules()):  # a non-zero selection bias, as after training
    moe.router_bias.set_value(0.05 * jax.random.normal(jax.random.PRNGKey(10 + i), moe.router_bias.shape))
  return cfg_loop, cfg_scan, loop, scan_copy(loop, cfg_scan.model)


def batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.model.vocab_size, (2, 16)).astype(np.int32)
  seg = np.array([[1] * 10 + [2] * 6, [1] * 13 + [0] * 3], np.int32)
  pos = np.where(seg == 2, np.arange(16) - 10, np.arange(16)).astype(np.int32) * (seg > 0)
  return {"tokens": tokens, "segment_ids": seg, "positions": pos,
          "loss_mask": (seg > 0).astype(np.float32)}


def test_layout_and_counts(pair):
  cfg_loop, cfg_scan, loop, scan = pair
  assert len(scan.layers) == 1 and len(loop.layers) == 4
  w = getattr(scan, STACK).mlp.w_gate
  assert w.shape == (3, 8, 32, 16) and w.get_metadata()["axes"] == ("layers", "exp", "exp_embed", "exp_mlp")
  assert count_params(cfg_scan) == count_params(cfg_loop)
  assert [n for _, n in scan.moe_groups()] == [3, 0]  # the stack, then the MTP block
  with pytest.raises(ConfigError, match="model.scan_layers=true scans the MoE layers"):
    load_config("configs/tiny.yaml", SMALL + ["model.scan_layers=true", "model.n_dense_layers=4"])


def test_forward_matches_loop(pair):
  cfg_loop, _, loop, scan = pair
  b = batch(cfg_loop)
  fwd = nnx.jit(lambda m, t, s, p: m(t, s, p, return_routing=True))
  ref, got = (fwd(m, b["tokens"], b["segment_ids"], b["positions"]) for m in (loop, scan))
  assert rel(got.logits, ref.logits) <= TOL
  assert rel(got.mtp_logits[0], ref.mtp_logits[0]) <= TOL
  np.testing.assert_array_equal(got.routed_experts, ref.routed_experts)
  assert got.routed_experts.shape == (3, 2, 16, 2)
  assert got.router_loads.shape == ref.router_loads.shape == (4, 8)  # 3 stacked + the MTP block
  assert rel(got.router_loads, ref.router_loads) <= TOL
  assert float(ref.aux_loss) > 0 and rel(got.aux_loss, ref.aux_loss) <= TOL


def _replay_ids(cfg, seed=1):
  """Recorded expert ids [n_moe, b, s, k], distinct per token, some tokens unrecorded (-1)."""
  m = cfg.model
  keys = jax.random.split(jax.random.PRNGKey(seed), m.n_moe_layers)
  ids = jnp.stack([jax.random.permutation(k, jnp.broadcast_to(jnp.arange(m.n_routed_experts), (2, 16, 8)),
                                          axis=-1, independent=True)[..., : m.n_experts_per_tok]
                   for k in keys])
  return ids.at[:, 0, :3].set(-1)


def _grads(model, cfg, b, replay):
  graphdef, params, rest = split_model(model)

  def loss_fn(params):
    out = nnx.merge(graphdef, params, rest)(b["tokens"], b["segment_ids"], b["positions"],
                                            routed_experts=replay, return_live_routing=True)
    loss = lm_loss(out, b["tokens"], b["loss_mask"], cfg.model, b["segment_ids"])[0]
    return loss, out.live_routing

  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)


def test_replay_and_gradients_with_remat(pair):
  """Router replay goes into the scan with the layers; the remat policy wraps the scanned body;
  loss, live routing and every gradient equal the loop's (no remat) to 1e-5."""
  cfg_loop, _, loop, _ = pair
  _, cfg_scan = configs("model.remat=full")
  scan = scan_copy(loop, cfg_scan.model)
  b, replay = batch(cfg_loop), _replay_ids(cfg_loop)
  (l_ref, live_ref), g_ref = _grads(loop, cfg_loop, b, replay)
  (l_got, live_got), g_got = _grads(scan, cfg_scan, b, replay)
  assert rel(l_got, l_ref) <= TOL
  np.testing.assert_array_equal(live_got, live_ref)
  assert max_rel_l2(flat(g_got), to_scan(flat(g_ref), cfg_scan.model)) <= TOL
  # the checkpoint (remat) is inside the scan's body, not around the whole stack
  graphdef, params, rest = split_model(scan)
  jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p, rest)(b["tokens"]).logits)(params)
  assert _scans_of_remat(jaxpr.jaxpr) == [3]  # one scan of 3 layers, each body a checkpoint


def _scans_of_remat(jaxpr) -> list[int]:
  """Lengths of the scans (at any depth) whose body's own equations include a checkpoint."""
  found = []
  for e in jaxpr.eqns:
    if e.primitive.name == "scan" and any(q.primitive.name.startswith("remat")
                                          for q in e.params["jaxpr"].jaxpr.eqns):
      found.append(e.params["length"])
    for v in e.params.values():
      sub = getattr(v, "jaxpr", v)
      if hasattr(sub, "eqns"):
        found += _scans_of_remat(sub)
  return found


# AdamW's variant is slow-marked (35-52 s on 2 cores): Muon's runs the same scan-vs-loop step.
@pytest.mark.parametrize("opt", [pytest.param("adamw", marks=pytest.mark.slow), "muon"])
def test_train_step_bias_update_and_qk_clip(pair, opt):
  """One optimizer step with the aux-loss-free bias update and QK-clip (max logits sown inside the
  scan, popped per layer, clipping the stacked weights row by row) lands on the loop's state; the
  leading layer axis is a batch axis to Muon and no matrix dim to weight decay (norm scales)."""
  from composer_jax.train import optim
  from composer_jax.train.step import param_axes
  extra = ("optim.qk_clip=0.5", "model.bias_update_rate=0.01", "optim.warmup_steps=0",
           f"optim.name={opt}")
  cfgs = configs(*extra)
  loop = pair[2]
  out = []
  for cfg, model in zip(cfgs, (loop, scan_copy(loop, cfgs[1].model))):
    graphdef, params, rest = split_model(model)
    tx = optim.build_optimizer(cfg.optim, 10, params, param_axes(params))
    state = {"params": params, "rest": rest, "opt_state": tx.init(params), "step": jnp.int32(0),
             "rng": jax.random.key_data(jax.random.key(0))}
    out.append(jax.jit(make_train_step(graphdef, cfg, tx))(state, batch(cfg)))
  (s_ref, m_ref), (s_got, m_got) = out
  assert float(m_ref["max_attn_logit"]) > 0.5  # the clip really rescales some heads
  assert rel(m_got["max_attn_logit"], m_ref["max_attn_logit"]) <= TOL
  assert rel(m_got["loss"], m_ref["loss"]) <= TOL
  mcfg = cfgs[1].model
  assert max_rel_l2(flat(s_got["params"]), to_scan(flat(s_ref["params"]), mcfg)) <= TOL
  bias_ref, bias_got = to_scan(flat(s_ref["rest"]), mcfg), flat(s_got["rest"])
  before = to_scan(flat(nnx.state(loop, nnx.Not(nnx.Param))), mcfg)
  for k in bias_got:  # every layer moved by its own loads (+-rate per expert)
    np.testing.assert_allclose(bias_got[k], bias_ref[k], atol=1e-7)
    assert np.allclose(np.abs(bias_got[k] - before[k]), 0.01, atol=1e-6), k


def test_prefill_and_decode_equal_the_full_forward(pair):
  """The scanned decode over the stacked cache: a ragged prefill then decode steps give each row's
  full-forward logits (and the loop model's decode)."""
  from tests.model.test_decode import _ragged_run
  cfg_loop, cfg_scan, loop, scan = pair
  seqs = [np.asarray(jax.random.randint(jax.random.PRNGKey(20 + r), (16,), 0, 97)) for r in range(3)]
  lens = [5, 9, 2]
  got, cache, pos = _ragged_run(scan, cfg_scan, seqs, lens, steps=4, view=16)
  ref, _, _ = _ragged_run(loop, cfg_loop, seqs, lens, steps=4, view=16)
  assert len(cache.layers) == 2 and cache.layers[1].c.shape == (3, 3, 32, 16)
  np.testing.assert_array_equal(np.asarray(cache.index), pos)
  fwd = nnx.jit(lambda m, t: m(t[None], mtp=False).logits[0])
  for r in range(3):
    full = fwd(scan, jnp.asarray(seqs[r][: pos[r]], jnp.int32))
    assert rel(got[r], full) <= 2e-5
    assert rel(got[r], ref[r]) <= TOL
  with pytest.raises(ValueError, match="model.scan_layers=true"):
    scan(jnp.ones((1, 2), jnp.int32), cache=init_cache(cfg_loop.model, 1, 8))


def test_scanned_decode_updates_the_stacked_cache_in_place(pair):
  """A donated decode step carries the whole stacked cache through the scan and writes each
  layer's slice in place: XLA's temporaries stay far below the cache (no per-step copy of it)."""
  _, cfg_scan, _, scan = pair
  graphdef, state = nnx.split(scan)
  cache = init_cache(cfg_scan.model, 4, 2048).with_view(16)
  step = jax.jit(lambda st, c, t: nnx.merge(graphdef, st)(t, cache=c, mtp=False).cache,
                 donate_argnums=(1,))
  mem = step.lower(state, cache, jnp.ones((4, 1), jnp.int32)).compile().memory_analysis()
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  assert mem.alias_size_in_bytes >= cache_bytes and mem.temp_size_in_bytes < cache_bytes / 8


def test_loop_checkpoint_into_a_scan_run_is_refused_in_one_line(pair, tmp_path):
  from composer_jax.train.checkpoint import Checkpointer, IncompatibleCheckpoint
  _, cfg_scan, loop, scan = pair
  ck = Checkpointer(str(tmp_path), async_save=False)
  _, params, rest = split_model(loop)
  ck.save(1, {"params": params, "rest": rest}, None, {"step": 1})
  ck.wait()
  _, params, rest = split_model(scan)
  with pytest.raises(IncompatibleCheckpoint) as e:
    ck.restore_latest({"params": params, "rest": rest}, config=cfg_scan.to_dict())
  msg = str(e.value)
  assert "\n" not in msg and "written with model.scan_layers=false" in msg
  assert "this run has model.scan_layers=true" in msg
  ck.close()


def test_hf_round_trip_of_a_scanned_model(tmp_path):
  """save_pretrained writes a scanned model per layer (the released layout): transformers'
  DeepseekV3 reads it to the same logits; from_pretrained stacks it back bit-exactly, also
  straight onto a mesh, and a loop config reads the same folder."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from composer_jax.config import MeshConfig
  from composer_jax.hf import from_pretrained, save_pretrained
  from composer_jax.parallel.mesh import build_mesh
  from composer_jax.parallel.rules import make_rules, spec_for, variable_axes
  from tests.hf.helpers import leaves, logits, our_model
  ours = our_model(seed=1, scan_layers=True, n_layers=4)
  path = save_pretrained(ours, str(tmp_path))
  tokens = np.random.default_rng(0).integers(0, 96, (2, 12))
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = hf(torch.from_numpy(tokens).long()).logits.float().numpy()
  mine = logits(ours, tokens)
  assert np.abs(mine).max() > 0.5 and np.abs(theirs - mine).max() <= 1e-4
  back = from_pretrained(path, cfg=ours.cfg)
  want = leaves(ours)
  for k, v in leaves(back).items():
    np.testing.assert_array_equal(v, want[k], err_msg=str(k))
  assert rel(logits(from_pretrained(path), tokens), mine) <= TOL  # the loop layout, same folder
  mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
  sharded = from_pretrained(path, mesh=mesh, cfg=ours.cfg)
  for p, var in nnx.to_flat_state(nnx.state(sharded)):
    x = var.get_value()
    assert x.sharding.spec == spec_for(variable_axes(var), x.shape, mesh, make_rules()), p
    np.testing.assert_array_equal(np.asarray(x), want[tuple(p)], err_msg=str(p))


def test_sharded_scan_matches_single_device_loop():
  """3 AdamW steps of the scanned model on fsdp 2 x expert 2 x tensor 2 (8 fake devices) equal the
  loop model's on one device: losses, first-step gradients and final parameters to 1e-5."""
  from tests.parallel.harness import initial_state, make_batches, tiny_config, train
  cfg_loop = tiny_config("model.n_layers=3", "model.mtp_depths=0")
  cfg_scan = tiny_config("model.n_layers=3", "model.mtp_depths=0", "model.scan_layers=true")
  graphdef, params, rest = init = initial_state(cfg_loop)
  scan = scan_copy(nnx.merge(graphdef, params, rest), cfg_scan.model)
  batches = make_batches(cfg_loop)
  ref = train(cfg_loop, None, init, batches)
  got = train(cfg_scan, {"fsdp": 2, "expert": 2, "tensor": 2}, nnx.split(scan, nnx.Param, ...), batches)
  np.testing.assert_allclose(got["losses"], ref["losses"], rtol=TOL)
  as_flat = lambda d: {tuple(k.key for k in p): v
                       for p, v in jax.tree_util.tree_leaves_with_path(d)}
  for key in ("grads", "params"):
    assert max_rel_l2(as_flat(got[key]), to_scan(as_flat(ref[key]), cfg_scan.model)) <= TOL, key

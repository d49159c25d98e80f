"""save_pretrained / from_pretrained without torch: bit-exact round trips, sharded index, FP8 block
dequantization, the fused expert layout, mesh placement and bad checkpoints."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from composer_jax.config import ConfigError, MeshConfig
from composer_jax.hf import dequantize_fp8, from_pretrained, save_pretrained
from composer_jax.hf.tensors import INDEX
from composer_jax.parallel.mesh import build_mesh
from composer_jax.parallel.rules import make_rules, spec_for, variable_axes
from tests.hf.helpers import hf_tensors, leaves, our_model


def assert_same_leaves(a, b):
  la, lb = leaves(a), leaves(b)
  assert la.keys() == lb.keys()
  for k in la:
    assert la[k].dtype == lb[k].dtype, k
    np.testing.assert_array_equal(la[k], lb[k], err_msg=str(k))


@pytest.fixture(scope="module")
def model():
  return our_model(seed=0)  # float32, q low-rank, one MTP depth


@pytest.mark.parametrize("changes", [
    {},
    {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"},
    {"q_lora_rank": 0, "tie_embeddings": True, "mtp_depths": 0, "n_shared_experts": 0},
], ids=["f32_mtp", "bf16", "direct_q_tied"])
def test_round_trip_bit_exact(changes, tmp_path):
  m = our_model(seed=2, **changes)
  back = from_pretrained(save_pretrained(m, str(tmp_path)))
  assert back.cfg == m.cfg
  assert_same_leaves(m, back)


def test_released_layout(model, tmp_path):
  t = hf_tensors(save_pretrained(model, str(tmp_path)))
  cfg = model.cfg
  assert t["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (cfg.moe_ffn_dim, cfg.d_model)
  np.testing.assert_array_equal(t["model.layers.2.mlp.experts.3.down_proj.weight"],
                                np.asarray(model.layers[2].mlp.w_down.get_value())[3].T)
  np.testing.assert_array_equal(t["model.layers.0.self_attn.q_b_proj.weight"],
                                np.asarray(model.layers[0].attn.q_b.w.get_value()).reshape(24, -1).T)
  mtp = f"model.layers.{cfg.n_layers}."  # DeepSeek-V3 stores MTP depth 0 as one more layer
  np.testing.assert_array_equal(t[mtp + "eh_proj.weight"], np.asarray(model.mtp[0].proj.w.get_value()).T)
  np.testing.assert_array_equal(t[mtp + "embed_tokens.weight"], t["model.embed_tokens.weight"])
  np.testing.assert_array_equal(t[mtp + "shared_head.head.weight"], t["lm_head.weight"])
  assert t[mtp + "mlp.gate.e_score_correction_bias"].dtype == np.float32


def test_sharded_index(model, tmp_path):
  path = save_pretrained(model, str(tmp_path), max_shard_bytes=20_000)
  with open(os.path.join(path, INDEX)) as f:
    index = json.load(f)
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert not os.path.exists(os.path.join(path, "model.safetensors"))
  for file in files:  # every shard respects the bound unless one tensor alone exceeds it
    with safe_open(os.path.join(path, file), framework="np") as f:
      sizes = [f.get_tensor(k).nbytes for k in f.keys()]  # noqa: SIM118
    assert sum(sizes) <= 20_000 or len(sizes) == 1
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in hf_tensors(path).values())
  assert_same_leaves(model, from_pretrained(path))
  # Re-saving unsharded into the same folder leaves no stale shards behind.
  save_pretrained(model, path)
  assert sorted(f for f in os.listdir(path) if "safetensors" in f) == ["model.safetensors"]
  # An index naming a missing shard fails with one line.
  save_pretrained(model, path, max_shard_bytes=20_000)
  os.remove(os.path.join(path, files[-1]))
  with pytest.raises(ConfigError, match="names model-"):
    from_pretrained(path)


# -- FP8 ----------------------------------------------------------------------------------------------


def quantize_fp8(w: np.ndarray, block: tuple[int, int]):
  """Block-wise e4m3 quantization as DeepSeek-V3 ships it: scale = amax / 448 per block."""
  rows, cols = w.shape
  nb = (-(-rows // block[0]), -(-cols // block[1]))
  scale = np.zeros(nb, np.float32)
  q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for i in range(nb[0]):
    for j in range(nb[1]):
      sl = np.s_[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
      scale[i, j] = max(np.abs(w[sl]).max(), 1e-12) / 448.0
      q[sl] = (w[sl] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
  return q, scale


def reference_dequant(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """Independent float64 loop over blocks, rounded to float32 at the end."""
  out = np.zeros(q.shape, np.float64)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      sl = np.s_[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
      out[sl] = q[sl].astype(np.float64) * np.float64(scale[i, j])
  return out.astype(np.float32)


def test_dequantize_fp8_ragged_blocks():
  # Exact: an e4m3 value (4 significant bits) times a float32 scale (24) is exact in float64, so
  # float32(float64 product) is the correctly rounded float32 product that NumPy computes.
  w = np.random.default_rng(0).normal(0, 0.05, (300, 200)).astype(np.float32)
  q, scale = quantize_fp8(w, (128, 128))
  assert scale.shape == (3, 2)  # 300 = 128+128+44 rows, 200 = 128+72 columns: ragged edges
  got = dequantize_fp8(q, scale)
  np.testing.assert_array_equal(got, reference_dequant(q, scale, (128, 128)))
  assert np.abs(got - w).max() <= 0.0625 * np.abs(w).max()  # e4m3 keeps ~3 mantissa bits
  with pytest.raises(ConfigError, match="weight_scale_inv of shape"):
    dequantize_fp8(q, scale[:2])


def test_fp8_checkpoint(model, tmp_path):
  """Every linear weight except the router stored as e4m3 with 16x24 blocks (ragged for these
  shapes, given by quantization_config.weight_block_size), as DeepSeek-V3 / Kimi K2 ship."""
  src = save_pretrained(model, str(tmp_path / "f32"))
  block = (16, 24)
  tensors, expected = {}, {}
  for name, w in hf_tensors(src).items():
    if "_proj" in name and name.endswith(".weight") and w.ndim == 2:
      q, s = quantize_fp8(w, block)
      tensors[name], tensors[name + "_scale_inv"] = q, s
      expected[name] = reference_dequant(q, s, block)
    else:
      tensors[name] = w
  dst = tmp_path / "fp8"
  dst.mkdir()
  save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f:
    hf = json.load(f)
  hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(block)}
  (dst / "config.json").write_text(json.dumps(hf))
  loaded = from_pretrained(str(dst))
  assert loaded.cfg.param_dtype == "float32"
  back = hf_tensors(save_pretrained(loaded, str(tmp_path / "back")))
  assert len(expected) > 40
  for name, want in expected.items():
    np.testing.assert_array_equal(back[name], want, err_msg=name)
  # Spot checks through our own layout (transposed / stacked per expert).
  np.testing.assert_array_equal(np.asarray(loaded.layers[0].attn.kv_a.w.get_value()),
                                expected["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].T)
  np.testing.assert_array_equal(np.asarray(loaded.layers[1].mlp.w_up.get_value())[5],
                                expected["model.layers.1.mlp.experts.5.up_proj.weight"].T)
  # A weight without its scale cannot be dequantized.
  del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
  save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ConfigError, match="weight_scale_inv"):
    from_pretrained(str(dst))


# -- other layouts, placement, errors -----------------------------------------------------------------


def test_fused_expert_layout(model, tmp_path):
  """transformers' in-memory layout: experts.gate_up_proj [E, 2f, d] (gate rows first) and
  experts.down_proj [E, d, f]."""
  src = save_pretrained(model, str(tmp_path / "a"))
  t = hf_tensors(src)
  fused = {k: v for k, v in t.items() if ".experts." not in k}
  for prefix in {k.split("experts.")[0] for k in t if ".experts." in k}:
    n = model.cfg.n_routed_experts
    gate = [t[f"{prefix}experts.{e}.gate_proj.weight"] for e in range(n)]
    up = [t[f"{prefix}experts.{e}.up_proj.weight"] for e in range(n)]
    fused[prefix + "experts.gate_up_proj"] = np.stack([np.concatenate(p) for p in zip(gate, up)])
    fused[prefix + "experts.down_proj"] = np.stack(
        [t[f"{prefix}experts.{e}.down_proj.weight"] for e in range(n)])
  dst = tmp_path / "b"
  dst.mkdir()
  save_file(fused, str(dst / "model.safetensors"))
  (dst / "config.json").write_text(open(os.path.join(src, "config.json")).read())
  assert_same_leaves(model, from_pretrained(str(dst)))


def test_mesh_placement(model, tmp_path):
  mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
  path = save_pretrained(model, str(tmp_path))
  sharded = from_pretrained(path, mesh=mesh)
  rules = make_rules()
  for p, var in nnx.to_flat_state(nnx.state(sharded)):
    x = var.get_value()
    assert x.sharding.spec == spec_for(variable_axes(var), x.shape, mesh, rules), p
  assert sharded.layers[1].mlp.w_gate.get_value().sharding.spec[0] == "expert"
  assert_same_leaves(model, sharded)


def test_dtype_override(model, tmp_path):
  """dtype="bfloat16" rounds each float32 weight to nearest bfloat16; the router stays float32."""
  bf16 = from_pretrained(save_pretrained(model, str(tmp_path)), dtype="bfloat16")
  assert bf16.cfg.param_dtype == bf16.cfg.compute_dtype == "bfloat16"
  ref = leaves(model)
  for path, value in leaves(bf16).items():
    want = ref[path]
    if path[-1] not in ("router", "router_bias"):
      want = want.astype(ml_dtypes.bfloat16)
    assert value.dtype == want.dtype, path
    np.testing.assert_array_equal(value, want, err_msg=str(path))


def test_missing_mtp_weights_warn(tmp_path):
  path = save_pretrained(our_model(seed=3, mtp_depths=0), str(tmp_path))
  cfg_file = os.path.join(path, "config.json")
  hf = json.load(open(cfg_file))
  hf["num_nextn_predict_layers"] = 1  # what transformers writes for a model without MTP modules
  json.dump(hf, open(cfg_file, "w"))
  with pytest.warns(UserWarning, match="MTP"):
    assert from_pretrained(path).cfg.mtp_depths == 0


def test_bad_checkpoints(model, tmp_path):
  path = save_pretrained(model, str(tmp_path / "ok"))
  t = hf_tensors(path)
  config = open(os.path.join(path, "config.json")).read()

  def write(tensors, name):
    d = tmp_path / name
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(config)
    return str(d)

  cases = {
      "missing": ({k: v for k, v in t.items() if "layers.2.self_attn.o_proj" not in k}, "is missing"),
      "extra": ({**t, "model.layers.9.mlp.gate.weight": t["model.layers.1.mlp.gate.weight"]},
                "not used"),
      "shape": ({**t, "model.norm.weight": np.ones(7, np.float32)}, "has shape"),
  }
  for name, (tensors, match) in cases.items():
    with pytest.raises(ConfigError, match=match) as e:
      from_pretrained(write(tensors, name))
    assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="no config.json"):
    from_pretrained(str(tmp_path))

"""Rule errors are one line; parameters are created on their shardings; the pod plan is arithmetic."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import ConfigError, MeshConfig, load_config
from composer_jax.model import build_model
from composer_jax.parallel.mesh import build_mesh, resolve_axis_sizes
from composer_jax.parallel.rules import make_rules, spec_for
from composer_jax.train.plan import format_plan, sharding_plan


def _one_line(excinfo):
  msg = str(excinfo.value)
  assert "\n" not in msg and msg
  return msg


def test_two_dims_on_one_mesh_axis():
  mesh = build_mesh(MeshConfig(data=1, fsdp=8))
  rules = make_rules({"vocab": "fsdp"})  # embed is on fsdp already
  with pytest.raises(ConfigError) as e:
    spec_for(("vocab", "embed"), (2048, 128), mesh, rules, what="param embed")
  assert "fsdp" in _one_line(e)


def test_non_divisible_size():
  mesh = build_mesh(MeshConfig(data=1, fsdp=8))
  with pytest.raises(ConfigError) as e:
    spec_for(("embed", None), (100, 4), mesh, make_rules(), what="param w")
  assert "100" in _one_line(e)


def test_mesh_bigger_than_devices():
  with pytest.raises(ConfigError) as e:
    build_mesh(MeshConfig(data=4, expert=4))
  assert "16" in _one_line(e)
  with pytest.raises(ConfigError) as e:
    load_config("configs/tiny.yaml", ["mesh.expert=3"])  # 16 experts do not split 3 ways
  _one_line(e)
  with pytest.raises(ConfigError) as e:
    make_rules({"embed": "pipeline"})
  _one_line(e)


def test_params_created_on_their_shardings():
  cfg = load_config("configs/tiny.yaml", ["model.n_layers=2", "mesh.data=1", "mesh.fsdp=2",
                                          "mesh.expert=2", "mesh.tensor=2"])
  mesh = build_mesh(cfg.mesh)
  sharded, plain = nnx.state(build_model(cfg, mesh)), nnx.state(build_model(cfg))
  w = sharded["layers"][1]["mlp"]["w_gate"][...]
  assert w.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
  assert w.addressable_shards[0].data.shape == (8, 64, 32)
  # The same draws: equal to the last bits or so (another RNG stream would differ everywhere). Bit
  # equality holds under XLA's default CPU compile; the tests compile at LLVM -O0 (conftest.py), where
  # the two programs' float ops (erfinv of the truncated normal) may contract differently.
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def test_embedding_lookup_moves_the_table_not_the_batch():
  """FSDP shards the table's d. Looking rows up in the d-sharded table gave embeddings sharded on d,
  and XLA then made them batch-sharded by all-gathering the whole global batch's embeddings onto
  every device (its "involuntary full rematerialization"; at pod scale, global batch x sequence x
  d on each chip). The lookup now gathers the table first: on data=4 x fsdp=2 the compiled lookup
  holds no collective whose output spans the global batch, and its values equal one device's."""
  from composer_jax.parallel.rules import activate
  cfg = load_config("configs/tiny.yaml", ["model.n_layers=2", "mesh.data=4", "mesh.fsdp=2"])
  mesh, rules = build_mesh(cfg.mesh), make_rules(cfg.mesh.rules)
  graphdef, state = nnx.split(build_model(cfg, mesh))
  assert state["embed"][...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 64)).astype(np.int32)
  batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
  lookup = jax.jit(lambda st, t: nnx.merge(graphdef, st).embed_tokens(t))
  with activate(mesh, rules):
    hlo = lookup.lower(state, batch).compile().as_text()
    got = lookup(state, batch)
  big = [ln for ln in hlo.splitlines()
         if any(f" {op}(" in ln for op in ("all-gather", "all-to-all", "collective-permute"))
         and "[8,64," in ln.split("=")[1].split(" ")[1]]
  assert not big, big
  want = np.asarray(state["embed"][...])[tokens]
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.asarray(got).dtype))


def test_plan_bytes_match_arithmetic():
  cfg = load_config("configs/tiny.yaml", ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"])
  plan = sharding_plan(cfg)
  assert plan["n_devices"] == 8 and plan["optimizer"].startswith("AdamW")
  row = next(r for r in plan["params"] if r["name"] == "layers.1.mlp.w_gate")
  assert row["spec"] == [["expert"], ["fsdp"], []]
  assert row["param_bytes"] == (16 // 4) * (128 // 2) * 64 * 4 and row["opt_bytes"] == 2 * row["param_bytes"]
  bias = next(r for r in plan["params"] if r["name"].endswith("router_bias"))
  assert bias["opt_bytes"] == 0  # not a trained parameter
  total = sum(r["param_bytes"] for r in plan["params"])
  assert plan["totals"]["param_bytes_per_device"] == total
  assert "layers.*.mlp.w_gate" in format_plan(plan)


def test_plan_for_a_pod_needs_no_devices():
  cfg = load_config("configs/kimi-k2.yaml", ["mesh.fsdp=64", "mesh.expert=8", "optim.qk_clip=0",
                                             "model.scan_layers=false"])  # per-layer rows
  plan = sharding_plan(cfg, n_devices=512)
  assert plan["mesh"]["fsdp"] == 64 and plan["mesh"]["expert"] == 8
  row = next(r for r in plan["params"] if r["name"] == "layers.5.mlp.w_up")
  assert row["param_bytes"] == (384 // 8) * (7168 // 64) * 2048 * 2  # bf16
  assert resolve_axis_sizes(cfg.mesh, 512)["data"] == 1

"""The memory plan counts the optimizer state the optimizer really allocates."""

from __future__ import annotations

import jax
import numpy as np

from composer_jax.config import load_config
from composer_jax.train.plan import sharding_plan
from tests.train.test_step import SMALL

MESH = SMALL + ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"]


def test_plan_matches_the_trainers_allocation_on_device_0():
  """bf16 params, Muon, float32 master: the plan's optimizer bytes per device equal the bytes of
  the trainer's real optimizer state on device 0 (8 fake devices), and per element by hand:
  Muon matrix = 4 (master) + 4 (momentum) = 4x its bf16 bytes; AdamW vector = 4 + 8 = 6x."""
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from composer_jax.model.build import abstract_model
  from composer_jax.parallel.mesh import build_mesh
  from composer_jax.parallel.rules import make_rules, state_shardings
  from composer_jax.train import optim
  from composer_jax.train.step import param_axes
  cfg = load_config("configs/tiny.yaml", MESH + ["model.param_dtype=bfloat16", "optim.name=muon",
                                                 "optim.qk_clip=0"])
  plan = sharding_plan(cfg, n_devices=8)
  assert "master" in plan["optimizer"]
  row = next(r for r in plan["params"] if r["name"] == "layers.1.mlp.w_gate")
  assert row["dtype"] == "bfloat16" and row["opt_bytes"] == 4 * row["param_bytes"]
  norm = next(r for r in plan["params"] if r["name"] == "norm.scale")
  assert norm["opt_bytes"] == 6 * norm["param_bytes"]
  # The trainer's allocation (build_trainer's steps), on zero weights to skip the random init.
  mesh = build_mesh(cfg.mesh)
  model = abstract_model(cfg)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  zeros = lambda t: jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), t)
  sh = {"params": state_shardings(params, mesh, make_rules({}))}
  real = {k: jax.device_put(zeros(t), state_shardings(t, mesh, make_rules({})))
          for k, t in (("params", params), ("rest", rest))}
  tx = optim.build_optimizer(cfg.optim, cfg.train.steps, params, param_axes(params))
  o_sh = optim.state_shardings(tx, params, sh["params"], NamedSharding(mesh, P()))
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(real["params"])
  dev = jax.devices()[0]

  def on_dev0(tree):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == dev)

  t = plan["totals"]
  assert on_dev0(opt_state) == t["opt_bytes_per_device"]
  assert on_dev0(real["params"]) + on_dev0(real["rest"]) == t["param_bytes_per_device"]
  assert sum(x.nbytes for x in jax.tree.leaves(opt_state)) == t["opt_global_bytes"]
  np.testing.assert_equal(plan["mesh"]["expert"], 4)

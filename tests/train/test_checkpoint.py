"""Orbax checkpoints: keep-N, restore onto a different mesh, fallback past a corrupt latest step."""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import OptimConfig
from composer_jax.train import optim
from composer_jax.train.checkpoint import Checkpointer, find_checkpoint


def _state(mesh):
  params = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x"))),
            "b": jnp.linspace(0.0, 1.0, 4)}
  tx = optim.build_optimizer(OptimConfig(name="muon"), 10, params,
                             {"w": ("embed", "mlp"), "b": ("norm",)})
  opt = tx.init(params)
  _, opt = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), opt, params)
  return {"params": params, "opt_state": opt,
          "misc": {"step": jnp.int32(3), "rng": jax.random.key_data(jax.random.key(7))}}


def _targets(state, mesh, spec):
  def one(x):
    s = spec if x.ndim == 2 else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
  return jax.tree.map(one, state)


def test_keep_n_and_restore_on_another_mesh(tmp_path):
  m8 = Mesh(np.array(jax.devices()[:8]), ("x",))
  state = _state(m8)
  ck = Checkpointer(str(tmp_path), keep=2, every=2)
  assert ck.should_save(4, 9) and ck.should_save(9, 9) and not ck.should_save(3, 9)
  for step in (2, 4, 6):
    ck.save(step, state, {"next_index": step}, {"step": step})
  ck.wait()
  assert ck.steps() == [4, 6]
  m24 = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  step, out = ck.restore_latest(_targets(state, m24, P("b", "a")))
  assert step == 6 and out["data"] == {"next_index": 6} and out["meta"] == {"step": 6}
  assert out["params"]["w"].sharding.spec == P("b", "a")
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves({k: out[k] for k in state})):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ck.close()


def test_corrupt_latest_falls_back_with_one_line(tmp_path):
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  state = _state(mesh)
  ck = Checkpointer(str(tmp_path), keep=3)
  ck.save(1, state, {}, {"step": 1})
  state2 = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, state)
  ck.save(2, state2, {}, {"step": 2})
  ck.wait()
  for f in glob.glob(os.path.join(str(tmp_path), "2", "params", "**", "*"), recursive=True):
    if os.path.isfile(f):
      with open(f, "wb") as fh:
        fh.write(b"\x00garbage")
  lines = []
  step, out = ck.restore_latest(_targets(state, mesh, P("x")), log=lines.append)
  assert step == 1 and len(lines) == 1 and "step 2" in lines[0] and "falling back to step 1" in lines[0]
  np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(state["params"]["w"]))
  # An interrupted save leaves only a temporary directory, which is not a step.
  os.makedirs(os.path.join(str(tmp_path), "3.orbax-checkpoint-tmp-123"))
  assert ck.steps() == [1, 2]
  ck.close()


def test_find_checkpoint(tmp_path):
  (tmp_path / "run" / "checkpoints" / "10").mkdir(parents=True)
  run = str(tmp_path / "run")
  assert find_checkpoint(run) == (os.path.join(run, "checkpoints"), None)
  assert find_checkpoint(os.path.join(run, "checkpoints", "10")) == (os.path.join(run, "checkpoints"), 10)


def test_incompatible_checkpoint_stops_with_one_line_naming_the_array(tmp_path):
  """A readable checkpoint whose shapes differ is not 'corrupt': no fallback, no fresh start."""
  import pytest

  from composer_jax.train.checkpoint import IncompatibleCheckpoint
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  state = _state(mesh)
  ck = Checkpointer(str(tmp_path), keep=3)
  ck.save(1, state, {}, {"step": 1, "config": {"model": {"d_model": 8, "n_layers": 2}}})
  ck.save(2, state, {}, {"step": 2, "config": {"model": {"d_model": 8, "n_layers": 2}}})
  ck.wait()
  bigger = dict(state, params={"w": jnp.zeros((16, 8)), "b": state["params"]["b"]})
  lines = []
  with pytest.raises(IncompatibleCheckpoint) as e:
    ck.restore_latest(_targets(bigger, mesh, P("x")), log=lines.append,
                      config={"model": {"d_model": 16, "n_layers": 2}})
  msg = str(e.value)
  assert "\n" not in msg and not lines
  assert "step 2" in msg and "params.w is [8, 8] float32 there, [16, 8] float32 here" in msg
  assert "model.d_model 8 there, 16 here" in msg and "n_layers" not in msg
  # A tree that gained an array (e.g. a float32 master copy) is incompatible too.
  more = dict(state, params={**state["params"], "extra": jnp.zeros(3)})
  with pytest.raises(IncompatibleCheckpoint, match="params.extra exists only here"):
    ck.restore_latest(_targets(more, mesh, P("x")))
  ck.close()

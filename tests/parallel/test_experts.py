"""Expert-parallel MoE against a float64 NumPy reference; the CPU exchange against ragged semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from composer_jax.config import MeshConfig, ModelConfig
from composer_jax.model.moe import dropless_moe
from composer_jax.parallel.experts import expert_parallel_moe, padded_ragged_all_to_all
from composer_jax.parallel.mesh import build_mesh
from composer_jax.parallel.rules import activate, make_rules

T, K, E, D, F = 64, 2, 16, 16, 8
CFG = ModelConfig(d_model=D, moe_ffn_dim=F, n_routed_experts=E, n_experts_per_tok=K)


def numpy_moe(x, ids, w, wg, wu, wd):
  x, w, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, w, wg, wu, wd))
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j, e in enumerate(np.asarray(ids)[t]):
      g, u = x[t] @ wg[e], x[t] @ wu[e]
      out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
  return out


def inputs(skewed: bool, seed: int = 0):
  r = np.random.default_rng(seed)
  ids = np.zeros((T, K), np.int32) if skewed else r.integers(0, E, (T, K)).astype(np.int32)
  f = lambda *s: jnp.asarray(r.normal(size=s) / 3, jnp.float32)
  return f(T, D), jnp.asarray(ids), jnp.asarray(r.random((T, K)), jnp.float32), \
      f(E, D, F), f(E, D, F), f(E, F, D)


MESHES = [{"expert": 8}, {"data": 2, "expert": 4}, {"fsdp": 2, "expert": 2, "tensor": 2}]


CASES = [(MESHES[0], False, "all_to_all"), (MESHES[0], True, "all_to_all"),
         (MESHES[0], True, "all_gather"), (MESHES[1], True, "all_to_all"),
         (MESHES[2], False, "all_to_all"), (MESHES[2], False, "all_gather")]


@pytest.mark.parametrize("axes,skewed,strategy", CASES,
                         ids=lambda c: "_".join(f"{k}{v}" for k, v in c.items())
                         if isinstance(c, dict) else str(c))
def test_matches_numpy_and_dropless(axes, skewed, strategy):
  """Skewed = every (token, slot) on expert 0: one rank receives all 128 rows, none are dropped."""
  args = inputs(skewed)
  mesh = build_mesh(MeshConfig(**{"data": 1, **axes}))
  loss = lambda fn: lambda *a: (fn(*a) ** 2).sum()
  ep = lambda *a: expert_parallel_moe(*a, cfg=CFG, mesh=mesh, strategy=strategy)
  with activate(mesh, make_rules()):
    y = jax.jit(ep)(*args)
    g = jax.jit(jax.grad(loss(ep), argnums=(0, 2, 3, 4, 5)))(*args)
  np.testing.assert_allclose(np.asarray(y, np.float64), numpy_moe(*args), rtol=1e-5, atol=1e-5)
  ref = jax.grad(loss(lambda *a: dropless_moe(*a)), argnums=(0, 2, 3, 4, 5))(*args)
  for a, b in zip(g, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def numpy_ragged(operands, outputs, in_off, send, out_off, recv):
  """ragged_all_to_all's definition: sender i's chunk j lands on receiver j at out_off[i][j]."""
  res = [o.copy() for o in outputs]
  n = len(operands)
  for i in range(n):
    for j in range(n):
      chunk = operands[i][in_off[i][j]: in_off[i][j] + send[i][j]]
      res[j][out_off[i][j]: out_off[i][j] + len(chunk)] = chunk
      assert recv[j][i] == send[i][j]
  return res


def test_padded_exchange_has_ragged_semantics():
  n, rows = 8, 12
  r = np.random.default_rng(1)
  send = r.multinomial(rows, np.ones(n) / n, size=n).astype(np.int32)  # send[i][j]
  in_off = np.cumsum(send, 1) - send
  out_off = (np.cumsum(send, 0) - send)  # receivers pack senders in order
  recv = send.T.copy()
  ops = r.normal(size=(n, rows, 3)).astype(np.float32)
  outs = np.full((n, n * rows, 3), -1.0, np.float32)  # untouched slots keep the output's value
  want = np.stack(numpy_ragged(list(ops), list(outs), in_off, send, out_off, recv))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("x",))
  put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P("x")))
  ops, outs, in_off, send, out_off, recv = map(put, (ops, outs, in_off, send, out_off, recv))
  f = jax.shard_map(lambda *a: padded_ragged_all_to_all(*(v[0] for v in a), axis_name="x")[None],
                    mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  got = jax.jit(f)(ops, outs, in_off, send, out_off, recv)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_gpu_path_lowers_with_ragged_all_to_all():
  """The GPU/TPU program (forward and backward) traces and lowers with the ragged primitive."""
  args = inputs(False)
  mesh = build_mesh(MeshConfig(data=1, expert=8))
  fn = lambda *a: (expert_parallel_moe(*a, cfg=CFG, mesh=mesh, backend="gpu") ** 2).sum()
  with activate(mesh, make_rules()):
    text = jax.jit(jax.grad(fn, argnums=(0, 3))).lower(*args).as_text()
  assert text.count("ragged_all_to_all") >= 4  # dispatch + combine, and both transposes

"""Load-balanced context-parallel attention against a float64 NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import MeshConfig
from composer_jax.parallel.context import (
  context_attention,
  dense_attention,
  zigzag_halves,
)
from composer_jax.parallel.mesh import build_mesh
from composer_jax.parallel.rules import activate, make_rules

B, S, H = 4, 32, 4
SCALE = 0.3


def numpy_attention(qn, qp, kn, kp, v, seg):
  qn, qp, kn, kp, v = (np.asarray(a, np.float64) for a in (qn, qp, kn, kp, v))
  seg = np.asarray(seg)
  s = (np.einsum("bqhd,bkhd->bhqk", qn, kn) + np.einsum("bqhd,bkd->bhqk", qp, kp)) * SCALE
  idx = np.arange(S)
  mask = (idx[:, None] >= idx[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
  s = np.where(mask[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


def inputs():
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  seg = np.where(np.arange(S)[None] < r.integers(3, S - 3, (B, 1)), 1, 2).astype(np.int32)
  seg[0, -4:] = 0  # padding: attends within the padding, as the model's mask does
  return f(B, S, H, 8), f(B, S, H, 4), f(B, S, H, 8), f(B, S, 4), f(B, S, H, 6), jnp.asarray(seg)


def test_zigzag_balances_causal_work():
  for n in (2, 4, 8):
    halves = zigzag_halves(n)
    assert sorted(h for pair in halves for h in pair) == list(range(2 * n))
    assert {a + 1 + b + 1 for a, b in halves} == {2 * n + 1}  # key blocks per device


@pytest.mark.parametrize("axes", [{"context": 2}, {"data": 2, "context": 4}, {"context": 8},
                                  {"data": 2, "context": 2, "tensor": 2}],
                         ids=lambda a: "_".join(f"{k}{v}" for k, v in a.items()))
def test_matches_numpy(axes):
  qn, qp, kn, kp, v, seg = inputs()
  mesh = build_mesh(MeshConfig(**{"data": 1, **axes}))
  fn = lambda *a: context_attention(*a, seg, SCALE)
  with activate(mesh, make_rules()):
    out = jax.jit(fn)(qn, qp, kn, kp, v)
    g = jax.jit(jax.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 1, 2, 3, 4)))(qn, qp, kn, kp, v)
  np.testing.assert_allclose(np.asarray(out, np.float64), numpy_attention(qn, qp, kn, kp, v, seg),
                             rtol=1e-5, atol=1e-5)
  ref = jax.grad(lambda *a: (dense_attention(*a, seg, SCALE) ** 2).sum(), argnums=(0, 1, 2, 3, 4))(
      qn, qp, kn, kp, v)
  for a, b in zip(g, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))

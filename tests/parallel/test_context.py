"""Load-balanced context-parallel attention (latent gathered, K/V expanded per device) against a
float64 NumPy reference."""

from __future__ import annotations

import functools
import re

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


R, DN, DV = 12, 8, 6


def numpy_attention(qn, qp, c, kp, w, seg):
  qn, qp, c, kp, w = (np.asarray(a, np.float64) for a in (qn, qp, c, kp, w))
  kv = np.einsum("bsr,rhd->bshd", c, w)
  kn, v = kv[..., :DN], kv[..., DN:]
  seg = np.asarray(seg)
  s = (np.einsum("bqhd,bkhd->bhqk", qn, kn) + np.einsum("bqhd,bkd->bhqk", qp, kp)) * SCALE
  idx = np.arange(S)
  mask = ((idx[:, None] >= idx[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
          & (seg[:, :, None] != 0))  # padding (id 0) attends to nothing: a zero output
  s = np.where(mask[:, None], s, -np.inf)
  top = np.where(mask.any(-1)[:, None, :, None], s, -np.inf).max(-1, keepdims=True)
  p = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bhqk,bkhd->bqhd", p, v), s.max(axis=(0, 2, 3))


def inputs():
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  seg = np.where(np.arange(S)[None] < r.integers(3, S - 3, (B, 1)), 1, 2).astype(np.int32)
  seg[0, -4:] = 0  # padding: attends to nothing, as the model's mask says
  w = f(R, H, DN + DV) * 0.3
  return f(B, S, H, DN), f(B, S, H, 4), f(B, S, R), f(B, S, 4), w, jnp.asarray(seg)


def reference(qn, qp, c, kp, w, seg):
  kv = jnp.einsum("bsr,rhd->bshd", c, w)
  return dense_attention(qn, qp, kv[..., :DN], kp, kv[..., DN:], seg, SCALE)


def test_zigzag_balances_causal_work():
  for n in (2, 4, 8):
    halves = zigzag_halves(n)
    assert sorted(h for pair in halves for h in pair) == list(range(2 * n))
    assert {a + 1 + b + 1 for a, b in halves} == {2 * n + 1}  # key blocks per device


@pytest.mark.parametrize("axes", [{"context": 2}, {"data": 2, "context": 4}, {"context": 8},
                                  {"data": 2, "context": 2, "tensor": 2}],
                         ids=lambda a: "_".join(f"{k}{v}" for k, v in a.items()))
def test_matches_numpy(axes):
  qn, qp, c, kp, w, seg = inputs()
  mesh = build_mesh(MeshConfig(**{"data": 1, **axes}))
  fn = lambda *a: context_attention(*a, seg, SCALE)
  args = (qn, qp, c, kp, w)
  with activate(mesh, make_rules()):
    out, top = jax.jit(lambda *a: context_attention(*a, seg, SCALE, with_max_logit=True))(*args)
    g = jax.jit(jax.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 1, 2, 3, 4)))(*args)
  want, want_top = numpy_attention(*args, seg)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(top, np.float64), want_top, rtol=1e-5)  # QK-clip statistic
  ref = jax.grad(lambda *a: (reference(*a, seg) ** 2).sum(), argnums=(0, 1, 2, 3, 4))(*args)
  for a, b in zip(g, ref):  # includes kv_b's gradient, summed over the devices
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("axes,rows", [({"context": 8}, None), ({"context": 8}, 1),
                                       ({"data": 2, "context": 2, "tensor": 2}, None)],
                         ids=lambda a: "_".join(f"{k}{v}" for k, v in a.items()) if isinstance(a, dict)
                         else f"rows{a}")
def test_blockwise_core_matches_numpy(axes, rows):
  """The model's blockwise kernel inside the balanced split (block 4: several tiles per half-chunk
  where the half-chunk allows), output, max logit and gradients; with one visit plan for the batch
  and with one per row (model.attention_rows, as the model hands it in)."""
  from composer_jax.model.attention import blockwise_core
  qn, qp, c, kp, w, seg = inputs()
  mesh = build_mesh(MeshConfig(**{"data": 1, **axes}))
  core = functools.partial(blockwise_core, rows=rows)
  fn = lambda *a: context_attention(*a, seg, SCALE, with_max_logit=True, core=core, block=4)
  args = (qn, qp, c, kp, w)
  with activate(mesh, make_rules()):
    out, top = jax.jit(fn)(*args)
    g = jax.jit(jax.grad(lambda *a: (fn(*a)[0] ** 2).sum(), argnums=(0, 1, 2, 3, 4)))(*args)
  want, want_top = numpy_attention(*args, seg)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(top, np.float64), want_top, rtol=1e-5)
  ref = jax.grad(lambda *a: (reference(*a, seg) ** 2).sum(), argnums=(0, 1, 2, 3, 4))(*args)
  for a, b in zip(g, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_gathers_the_latent_not_expanded_kv():
  """The only all-gathers inside the context shard_map move [b, s/n, r] / [b, s/n, rope] latents."""
  qn, qp, c, kp, w, seg = inputs()
  mesh = build_mesh(MeshConfig(data=1, context=4))
  with activate(mesh, make_rules()):
    hlo = jax.jit(lambda *a: context_attention(*a, seg, SCALE)).lower(qn, qp, c, kp, w).as_text()
  gathers = [ln for ln in hlo.splitlines() if "all_gather" in ln]
  assert gathers
  for ln in gathers:  # rank 3 [b, s, r | rope] or rank 2 [b, s] (segment ids): never [b, s, h, d]
    assert re.fullmatch(r" ?tensor<\d+x\d+(x\d+)?x(f32|i32)>", ln.split("->")[-1]), ln


def test_falls_back_to_local_attention_without_context_axis():
  qn, qp, c, kp, w, seg = inputs()
  seen = []
  local = lambda *a: seen.append(1) or dense_attention(*a, SCALE)
  out = context_attention(qn, qp, c, kp, w, seg, SCALE, local=local)
  assert seen
  np.testing.assert_allclose(np.asarray(out, np.float64), numpy_attention(qn, qp, c, kp, w, seg)[0],
                             rtol=1e-5, atol=1e-5)

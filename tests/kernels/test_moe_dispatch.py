"""The MoE's top-k dispatch straight into the block layout (kernels.gmm_layout.gather_tokens /
pair_maps) and the whole dropless expert layer: forward and every gradient against a dense float64
NumPy reference that runs every token through every expert it picked, one pair at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model.moe import dropless_moe

T, K, D, F, E = 40, 3, 16, 24, 6


def _np_moe(x, ids, wts, wg, wu, wd):
  x, wts, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wts, wg, wu, wd))
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(ids.shape[1]):
      e = ids[t, j]
      g, u = x[t] @ wg[e], x[t] @ wu[e]
      y[t] += wts[t, j] * ((g / (1 + np.exp(-g))) * u) @ wd[e]
  return y


def _np_grads(x, ids, wts, wg, wu, wd, ct, eps=1e-6):
  """d<ct, moe> by central differences in float64 (the layer is smooth in every input)."""
  args = [np.asarray(a, np.float64) for a in (x, wts, wg, wu, wd)]
  out = []
  for i, a in enumerate(args):
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
      hi = [b.copy() for b in args]
      lo = [b.copy() for b in args]
      hi[i][idx] += eps
      lo[i][idx] -= eps
      fh = np.sum(ct * _np_moe(hi[0], ids, *hi[1:]))
      fl = np.sum(ct * _np_moe(lo[0], ids, *lo[1:]))
      g[idx] = (fh - fl) / (2 * eps)
    out.append(g)
  return out


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(7)
  x = rng.standard_normal((T, D)).astype(np.float32)
  # skewed: expert 0 takes most pairs, expert 4 none (an empty group in the middle)
  ids = np.stack([rng.choice([0, 1, 2, 3, 5], size=K, replace=False, p=[.6, .1, .1, .1, .1])
                  for _ in range(T)]).astype(np.int32)
  wts = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
  wg, wu = (rng.standard_normal((E, D, F)).astype(np.float32) * 0.3 for _ in range(2))
  wd = rng.standard_normal((E, F, D)).astype(np.float32) * 0.3
  ct = rng.standard_normal((T, D)).astype(np.float32)
  return x, ids, wts, wg, wu, wd, ct


@pytest.fixture(scope="module")
def reference(case):
  x, ids, wts, wg, wu, wd, ct = case
  # finite differences are O(params) forward passes: check a slice of each weight, all of x / wts
  small = (x[:6], ids[:6], wts[:6], wg, wu, wd, ct[:6])
  return _np_moe(x, ids, wts, wg, wu, wd), small, _np_grads(*small)


@pytest.mark.parametrize("impl", ["sorted", "xla", "interpret"])
def test_dropless_moe_matches_reference(case, reference, impl):
  x, ids, wts, wg, wu, wd, _ = case
  want, small, grads = reference
  run = jax.jit(lambda *a: dropless_moe(*a, impl=impl))
  y = run(jnp.asarray(x), jnp.asarray(ids), *(jnp.asarray(a) for a in (wts, wg, wu, wd)))
  # Tolerance: float32 products of O(1) values, relative to the output's magnitude.
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

  sx, sids, swts, swg, swu, swd, sct = small
  f = lambda a, w, g, u, dd: jnp.sum(jnp.asarray(sct) * dropless_moe(
      a, jnp.asarray(sids), w, g, u, dd, impl=impl))
  got = jax.jit(jax.grad(f, argnums=tuple(range(5))))(
      *(jnp.asarray(a) for a in (sx, swts, swg, swu, swd)))
  for name, g, r in zip(("x", "weights", "w_gate", "w_up", "w_down"), got, grads):
    np.testing.assert_allclose(np.asarray(g), r, rtol=1e-3, atol=1e-3 * np.abs(r).max(),
                               err_msg=name)

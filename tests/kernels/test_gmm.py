"""Grouped matmul backends vs a float64 NumPy reference; gradients vs jax.grad of the plain-JAX
definition; the low-precision recipes vs products of reference-quantized operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from composer_jax.kernels import gmm, gmm_reference, tgmm

from tests.kernels.kernels_ref import ref_mxfp8_dequant, ref_nvfp4

# (impl, interpret_target): every backend, the Pallas ones in (GPU-style and TPU) interpret mode
BACKENDS = [("xla", "gpu"), ("sorted", "gpu"), ("interpret", "gpu"), ("interpret", "tpu")]

# m, k, n, group sizes: uneven, empty groups (first / middle / last), rows past the groups' sum
CASES = [
    (100, 64, 48, [30, 0, 41, 7, 12]),
    (72, 32, 64, [0, 0, 72]),
    (64, 48, 32, [13, 25, 0, 9, 0, 0]),
]


def _fwd_bwd(f):
  """jit(x, w, ct -> (f(x, w), dx, dw)): one compile instead of op-by-op dispatch."""
  def run(a, b, c):
    y, vjp = jax.vjp(f, a, b)
    return (y, *vjp(c))
  return jax.jit(run)


def _np_gmm(x, w, sizes):
  out = np.zeros((x.shape[0], w.shape[2]))
  s = 0
  for i, c in enumerate(sizes):
    out[s:s + c] = x[s:s + c].astype(np.float64) @ w[i].astype(np.float64)
    s += c
  return out


def _np_tgmm(x, gr, sizes):
  out = np.zeros((len(sizes), x.shape[1], gr.shape[1]))
  s = 0
  for i, c in enumerate(sizes):
    out[i] = x[s:s + c].astype(np.float64).T @ gr[s:s + c].astype(np.float64)
    s += c
  return out


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  out = []
  for m, k, n, sizes in CASES:
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    ct = rng.standard_normal((m, n)).astype(np.float32)
    out.append((x, w, np.array(sizes, np.int32), ct))
  return out


@pytest.mark.parametrize("impl,target", BACKENDS)
def test_gmm_forward_and_tgmm(data, impl, target):
  kw = {"impl": impl, "block_rows": 16, "interpret_target": target}
  # TPU interpret mode simulates DMAs and is slow on CPU: one case (uneven + empty groups) there
  for x, w, sizes, ct in (data[:1] if target == "tpu" else data):
    y = jax.jit(lambda a, b, s: gmm(a, b, s, **kw))(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(y), _np_gmm(x, w, sizes), rtol=1e-5, atol=1e-4)
    t = jax.jit(lambda a, c, s: tgmm(a, c, s, **kw))(jnp.asarray(x), jnp.asarray(ct),
                                                     jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(t), _np_tgmm(x, ct, sizes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl,target", BACKENDS)
def test_gmm_gradients(data, impl, target):
  x, w, sizes, ct = data[0]
  args = (jnp.asarray(x), jnp.asarray(w))
  gs = jnp.asarray(sizes)
  f = lambda a, b: gmm(a, b, gs, impl=impl, block_rows=16, interpret_target=target)
  _, dx, dw = _fwd_bwd(f)(*args, jnp.asarray(ct))
  _, rx, rw = _fwd_bwd(lambda a, b: gmm_reference(a, b, gs))(*args, jnp.asarray(ct))
  for got, want in [(dx, rx), (dw, rw)]:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  # and against float64 NumPy: dlhs = ct @ w^T per group, drhs = tgmm(x, ct)
  np.testing.assert_allclose(np.asarray(dx), _np_gmm(ct, np.swapaxes(w, 1, 2), sizes),
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dw), _np_tgmm(x, ct, sizes), rtol=1e-5, atol=1e-4)


def test_bf16_inputs_and_jit(data):
  x, w, sizes, _ = data[0]
  xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  f = jax.jit(lambda a, b, s: gmm(a, b, s, impl="sorted"))
  y = f(xb, wb, jnp.asarray(sizes))
  assert y.dtype == jnp.bfloat16
  want = _np_gmm(np.asarray(xb, np.float32), np.asarray(wb, np.float32), sizes)
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=5e-2)
  y32 = gmm(xb, wb, jnp.asarray(sizes), impl="sorted", preferred_element_type=jnp.float32)
  assert y32.dtype == jnp.float32


def test_bad_input_messages(data):
  x, w, sizes, _ = data[0]
  with pytest.raises(ValueError, match="impl="):
    gmm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), impl="cuda")
  with pytest.raises(ValueError, match="multiples of 128"):
    gmm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), precision="fp8_block")


def _group_padded_mx(a, sizes, elem):
  """Reference quantization along the token axis: each group's rows padded to 32-row blocks."""
  out = np.zeros(a.shape)
  s = 0
  for c in sizes:
    if c == 0:
      continue
    rows = -(-c // 32) * 32
    blk = np.zeros((rows, a.shape[1]), np.float32)
    blk[:c] = a[s:s + c]
    out[s:s + c] = ref_mxfp8_dequant(blk, elem, axis=0)[:c]
    s += c
  return out


@pytest.mark.parametrize("impl,target", [("sorted", "gpu"), ("interpret", "gpu")])
def test_mxfp8_gmm_matches_reference_quantization(impl, target):
  rng = np.random.default_rng(1)
  m, k, n, sizes = 96, 64, 32, np.array([40, 0, 33, 20], np.int32)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((4, k, n)) * 0.1).astype(np.float32)
  ct = rng.standard_normal((m, n)).astype(np.float32)
  f = lambda a, b: gmm(a, b, jnp.asarray(sizes), impl=impl, precision="mxfp8",
                       interpret_target=target)
  y, dx, dw = _fwd_bwd(f)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ct))
  # forward: E4M3 operands with blocks along k
  want = _np_gmm(ref_mxfp8_dequant(x, "e4m3", -1), ref_mxfp8_dequant(w, "e4m3", 1), sizes)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
  # dgrad: E5M2 gradient and E4M3 weight, both with blocks along n
  want_dx = _np_gmm(ref_mxfp8_dequant(ct, "e5m2", -1),
                    np.swapaxes(ref_mxfp8_dequant(w, "e4m3", 2), 1, 2), sizes)
  np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
  # wgrad: blocks along tokens, per group
  want_dw = _np_tgmm(_group_padded_mx(x, sizes, "e4m3"), _group_padded_mx(ct, sizes, "e5m2"), sizes)
  np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5)
  # and the quantized products stay close to the exact ones
  exact = _np_gmm(x, w, sizes)
  assert np.abs(np.asarray(y) - exact).max() < 0.1 * np.abs(exact).max()


def _nvfp4_dq(a, axis):
  """NVFP4 quantize-dequantize along ``axis`` with the reference quantizer (one tensor scale)."""
  at = np.moveaxis(a, axis, -1)
  flat = at.reshape(-1, at.shape[-1])
  q, sb, st = ref_nvfp4(flat)
  d = q.astype(np.float64) * np.repeat(sb.astype(np.float64), 16, axis=1) * np.float64(st)
  return np.moveaxis(d.reshape(at.shape), -1, axis)


def _group_padded_nvfp4(a, sizes, rows=16):
  """NVFP4 along the token axis of the padded layout: each group padded to 16-row blocks, one
  tensor scale for the whole (padded) operand, as the grouped matmul quantizes it."""
  padded = [-(-c // rows) * rows for c in sizes]
  lay = np.zeros((sum(padded), a.shape[1]), np.float32)
  s = p = 0
  for c, pc in zip(sizes, padded):
    lay[p:p + c] = a[s:s + c]
    s, p = s + c, p + pc
  dq = _nvfp4_dq(lay, 0)
  out = np.zeros(a.shape)
  s = p = 0
  for c, pc in zip(sizes, padded):
    out[s:s + c] = dq[p:p + c]
    s, p = s + c, p + pc
  return out


def test_nvfp4_gmm_matches_reference_quantization():
  """NVFP4 (E2M1 in 16-element blocks, E4M3 block scales, a float32 tensor scale) forward and both
  gradients = float64 products of reference-quantized operands (1e-5: only float32 accumulation
  order and the float32 scale product differ)."""
  rng = np.random.default_rng(2)
  m, k, n, sizes = 160, 128, 128, np.array([70, 0, 90], np.int32)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((3, k, n)) * 0.1).astype(np.float32)
  ct = rng.standard_normal((m, n)).astype(np.float32)
  f = lambda a, b: gmm(a, b, jnp.asarray(sizes), impl="sorted", precision="nvfp4")
  y, dx, dw = _fwd_bwd(f)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ct))
  want = _np_gmm(_nvfp4_dq(x, -1), _nvfp4_dq(w, 1), sizes)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
  want_dx = _np_gmm(_nvfp4_dq(ct, -1), np.swapaxes(_nvfp4_dq(w, 2), 1, 2), sizes)
  np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
  want_dw = _np_tgmm(_group_padded_nvfp4(x, sizes), _group_padded_nvfp4(ct, sizes), sizes)
  np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5)
  # FP4 is coarse: the product moves, by about its quantization noise (measured ~0.13 relative).
  rel = np.linalg.norm(np.asarray(y) - _np_gmm(x, w, sizes)) / np.linalg.norm(_np_gmm(x, w, sizes))
  assert 0.05 < rel < 0.25, rel


@pytest.mark.parametrize("precision,tol", [("fp8_block", 0.08)])
def test_other_recipes_close_to_exact(precision, tol):
  rng = np.random.default_rng(2)
  m, k, n, sizes = 160, 128, 128, np.array([70, 0, 90], np.int32)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((3, k, n)) * 0.1).astype(np.float32)
  ct = rng.standard_normal((m, n)).astype(np.float32)
  f = lambda a, b: gmm(a, b, jnp.asarray(sizes), impl="sorted", precision=precision)
  y, dx, dw = _fwd_bwd(f)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ct))
  for got, want in [(y, _np_gmm(x, w, sizes)), (dx, _np_gmm(ct, np.swapaxes(w, 1, 2), sizes)),
                    (dw, _np_tgmm(x, ct, sizes))]:
    rel = np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want)
    assert 0 < rel < tol, rel  # quantized (not exact), but within the format's noise


def test_fp8_block_kernel_matches_dequantized_path():
  """The true-FP8 Pallas kernel (E4M3 operands, float32 1x128 / 128x128 scales applied per k slice)
  computes the same products as the dequantized recipe, fwd and dgrad."""
  rng = np.random.default_rng(3)
  m, k, n, sizes = 200, 256, 128, jnp.asarray([120, 0, 60])
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, k, n)) * 0.1, jnp.float32)
  ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  got = _fwd_bwd(lambda a, b: gmm(a, b, sizes, impl="interpret", precision="fp8_block"))(x, w, ct)
  want = _fwd_bwd(lambda a, b: gmm(a, b, sizes, impl="sorted", precision="fp8_block"))(x, w, ct)
  for g_, w_ in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=1e-5, atol=1e-4)


def _sorted_matches_numpy(sizes, bm, rng, past=9):
  """The sorted (CPU) gmm over ``sizes`` groups plus ``past`` rows past them: forward and both
  gradients against float64 NumPy."""
  m = int(sizes.sum()) + past
  x = rng.standard_normal((m, 24)).astype(np.float32)
  w = rng.standard_normal((len(sizes), 24, 40)).astype(np.float32)
  ct = rng.standard_normal((m, 40)).astype(np.float32)
  f = lambda a, b: gmm(a, b, jnp.asarray(sizes), impl="sorted", block_rows=bm)
  y, dx, dw = _fwd_bwd(f)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ct))
  used = np.concatenate([np.ones(int(sizes.sum())), np.zeros(past)])[:, None]
  np.testing.assert_allclose(np.asarray(y), _np_gmm(x, w, sizes), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dx), _np_gmm(ct, np.swapaxes(w, 1, 2), sizes) * used,
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dw), _np_tgmm(x, ct, sizes), rtol=1e-5, atol=2e-4)


def test_sorted_chunks_cover_every_level():
  """Groups spanning several top-size chunks plus every smaller power-of-two chunk, an empty group,
  a one-row group, and rows past the groups: the CPU loop's chunking against float64 NumPy."""
  from composer_jax.kernels import gmm_sorted
  rng = np.random.default_rng(3)
  bm = 16
  top = gmm_sorted.MAX_CHUNK_ROWS
  sizes = np.array([2 * top + 15 * bm + 3, 0, 1, bm, top - 1, 5 * bm], np.int32)  # 7 + 1 + ... blocks
  _sorted_matches_numpy(sizes, bm, rng)


def test_sorted_chunks_when_one_top_chunk_is_most_of_the_rows():
  """Few rows (a prefill's): the top chunk is over half the padded rows, so a group holds at most
  one and the CPU loop takes it in a cond (gmm_sorted._over_chunks). One group with a top chunk and
  the rest, the others smaller or empty: against float64 NumPy, forward and both gradients."""
  from composer_jax.kernels import gmm_layout, gmm_sorted
  rng = np.random.default_rng(4)
  bm = 16
  sizes = np.array([300, 0, 1, 17, 40], np.int32)
  rows = gmm_layout.make_layout(jnp.asarray(sizes), int(sizes.sum()) + 9, bm).src.shape[0]
  top = bm << gmm_sorted._levels(bm, rows)
  assert 2 * top > rows and sizes[0] >= top  # the cond path, taken once
  _sorted_matches_numpy(sizes, bm, rng)


def _blockwise_magnitudes(rng, shape, axis):
  """Random data whose 32-blocks along ``axis`` differ by up to 2^±12 (and per column for 3-D
  weights): a kernel applying a scale to the wrong k slice or column is off by orders of magnitude."""
  a = rng.standard_normal(shape)
  nblk = shape[axis] // 32
  bshape = [1] * len(shape)
  bshape[axis] = nblk
  if len(shape) == 3:
    bshape[3 - axis] = shape[3 - axis]  # also vary along the other matrix axis
  e = rng.integers(-12, 13, size=bshape).astype(np.float64)
  return (a * np.repeat(np.exp2(e), 32, axis=axis)).astype(np.float32)


@pytest.fixture(scope="module")
def mx_kernel_run():
  """mxfp8 forward + both gradients on the FP8 GPU kernel (interpret mode) and on the dequantized
  sorted path; uneven groups, empty first / middle / last groups, rows past the groups."""
  rng = np.random.default_rng(5)
  m, k, n, sizes = 150, 96, 160, np.array([0, 61, 0, 70, 0], np.int32)
  x = _blockwise_magnitudes(rng, (m, k), 1)
  w = _blockwise_magnitudes(rng, (5, k, n), 1) * np.float32(0.1)
  ct = _blockwise_magnitudes(rng, (m, n), 1)
  args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(ct))
  gs = jnp.asarray(sizes)

  def f(impl):
    return lambda a, b: gmm(a, b, gs, impl=impl, precision="mxfp8", block_rows=32)

  jaxpr = str(jax.make_jaxpr(_fwd_bwd(f("interpret")))(*args))
  got = [np.asarray(a) for a in _fwd_bwd(f("interpret"))(*args)]
  want = [np.asarray(a) for a in _fwd_bwd(f("sorted"))(*args)]
  return x, w, ct, sizes, jaxpr, got, want


def test_mxfp8_kernel_matches_dequantized_path(mx_kernel_run):
  """The FP8 GPU kernel (E4M3/E5M2 elements, E8M0 scales per 32 along k applied to each k=32 slice's
  float32 product) multiplies exactly the fake-quant values: equal to float32 accumulation order."""
  *_, jaxpr, got, want = mx_kernel_run
  assert jaxpr.count("gmm_fp8_gpu") == 2  # forward and dgrad on the kernel; wgrad dequantized
  for g_, w_ in zip(got, want, strict=True):
    np.testing.assert_allclose(g_, w_, rtol=1e-5, atol=1e-5 * np.abs(w_).max())


def test_mxfp8_kernel_matches_float64_reference(mx_kernel_run):
  """Kernel fwd and dgrad vs float64 NumPy products of ml_dtypes-quantized operands."""
  x, w, ct, sizes, _, got, _ = mx_kernel_run
  want_y = _np_gmm(ref_mxfp8_dequant(x, "e4m3", -1), ref_mxfp8_dequant(w, "e4m3", 1), sizes)
  want_dx = _np_gmm(ref_mxfp8_dequant(ct, "e5m2", -1),
                    np.swapaxes(ref_mxfp8_dequant(w, "e4m3", 2), 1, 2), sizes)
  for g_, w_ in [(got[0], want_y), (got[1], want_dx)]:
    np.testing.assert_allclose(g_, w_, rtol=1e-5, atol=1e-5 * np.abs(w_).max())


def test_e8m0_decode_matches_ml_dtypes():
  """Every E8M0 code decodes to exactly its power of two (2^-127 to the float32 subnormal), 0xFF to
  NaN."""
  import ml_dtypes
  from composer_jax.kernels.gmm import _e8m0_to_f32
  codes = np.arange(256, dtype=np.uint8)
  got = np.asarray(_e8m0_to_f32(jnp.asarray(codes.view(ml_dtypes.float8_e8m0fnu))))
  want = np.exp2(codes.astype(np.float64) - 127)
  np.testing.assert_array_equal(got[:255], want[:255].astype(np.float32))
  assert want[0] > 0 and np.isnan(got[255])

"""Independent NumPy + ml_dtypes references for the quantizers (shared by the kernel tests).

MX scale exponents come from float64 log2 (the implementation uses integer bit arithmetic) and
elements are rounded by ml_dtypes' float64 casts; NVFP4 / FP8-block follow the stated float32 recipe
with NumPy float32 arithmetic (inputs flushed to zero when subnormal).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32_TINY = np.float32(2.0 ** -126)


def ref_mxfp8(x, elem="e4m3", rounding="floor"):
  """[r, c] float32 -> (elements, E8M0 scales [r, c/32]); vectorised over blocks."""
  dtype, emax, maxn = {"e4m3": (ml_dtypes.float8_e4m3fn, 8, 448.0),
                       "e5m2": (ml_dtypes.float8_e5m2, 15, 57344.0)}[elem]
  xb = x.astype(np.float64).reshape(x.shape[0], -1, 32)
  bad = ~np.all(np.isfinite(xb), axis=-1)
  amax = np.max(np.abs(np.where(np.isfinite(xb), xb, 0.0)), axis=-1)
  safe = np.where(amax > 0, amax, 1.0)
  if rounding == "floor":
    e = np.floor(np.log2(safe)) - emax
  else:
    e = np.ceil(np.log2(safe / maxn))
  e = np.clip(np.where(amax == 0, -127, e), -127, 127)
  q = np.clip(xb * np.exp2(-e)[..., None], -maxn, maxn)
  q = np.where(bad[..., None], np.nan, q).astype(dtype)
  scale = np.where(bad, 255, e + 127).astype(np.uint8)
  return q.reshape(x.shape), scale.view(ml_dtypes.float8_e8m0fnu)


def _ref_daz(x):
  x = x.astype(np.float32).copy()
  x[np.abs(x) < F32_TINY] = 0.0
  return x


def ref_nvfp4(x):
  """NVFP4 in float32 steps: s_t = amax_t * f32(1/2688) (>= 2^-117), s_b = E4M3(amax_b / (6 s_t)),
  q = E2M1(V / (s_b s_t)); non-finite blocks: NaN scale, zero elements."""
  x = _ref_daz(x)
  fin = np.abs(x[np.isfinite(x)])
  amax_t = np.float32(fin.max() if fin.size else 0.0)
  s_t = max(np.float32(amax_t * np.float32(1.0 / 2688.0)), np.float32(2.0 ** -117))
  xb = x.reshape(x.shape[0], -1, 16)
  bad = ~np.all(np.isfinite(xb), axis=-1)
  with np.errstate(invalid="ignore", divide="ignore"):
    want = (np.max(np.abs(xb), axis=-1) / np.float32(np.float32(6.0) * s_t)).astype(np.float32)
    sb = np.minimum(want, np.float32(448.0)).astype(ml_dtypes.float8_e4m3fn)
    d = (sb.astype(np.float32) * s_t).astype(np.float32)
    q = np.clip(xb / d[..., None], np.float32(-6), np.float32(6))
  q = np.where((d > 0)[..., None] & ~bad[..., None], q, 0.0).astype(ml_dtypes.float4_e2m1fn)
  sb = np.where(bad, np.float32(np.nan), sb.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
  return q.reshape(x.shape), sb, s_t


def ref_fp8_blocks(x, br, bc):
  """float32 scale max(amax * f32(1/448), 2^-126) per br x bc block, E4M3 elements."""
  x = _ref_daz(x)
  r, c = x.shape
  xb = x.reshape(r // br, br, c // bc, bc)
  bad = ~np.all(np.isfinite(xb), axis=(1, 3))
  with np.errstate(invalid="ignore"):
    amax = np.max(np.abs(xb), axis=(1, 3))
    s = np.maximum((amax * np.float32(1.0 / 448.0)).astype(np.float32), F32_TINY)
  s = np.where(bad, np.float32(np.nan), s).astype(np.float32)
  with np.errstate(invalid="ignore"):
    q = np.clip(xb / s[:, None, :, None], -448, 448)
  q = np.where(bad[:, None, :, None], np.nan, q).astype(ml_dtypes.float8_e4m3fn)
  return q.reshape(x.shape), s


def ref_mxfp8_dequant(x, elem="e4m3", axis=-1):
  """Quantize-dequantize along ``axis`` (float64 values) with the reference quantizer."""
  xt = np.moveaxis(x, axis, -1)
  if xt.size == 0:
    return xt.astype(np.float64)
  flat = xt.reshape(-1, xt.shape[-1])
  q, s = ref_mxfp8(flat, elem)
  d = q.astype(np.float64) * np.repeat(s.astype(np.float64), 32, axis=1)
  return np.moveaxis(d.reshape(xt.shape), -1, axis)

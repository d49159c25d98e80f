"""Block-scaled low-precision formats, pure JAX (the reference the Pallas kernels are checked against).

* MXFP8 (OCP Microscaling v1.0): blocks of 32 along ``axis`` share an E8M0 power-of-two scale
  X = 2^(floor(log2 amax) - emax_elem); elements E4M3 (or E5M2 for gradients) = RNE(V / X) clamped to
  ± max normal. All-zero blocks get the smallest scale 2^-127. The exponent arithmetic is done on the
  float32 bit patterns, so float32 subnormal inputs are exact even where the device flushes them
  (XLA:CPU and GPUs run float32 with flush-to-zero).
* NVFP4: blocks of 16, E2M1 elements, an E4M3 scale per block and one float32 scale per tensor:
  s_t = amax_t * float32(1/2688), s_b = E4M3(amax_b / (6 s_t)), q = E2M1(V / (s_b s_t)), float32
  steps each rounded to nearest even.
* FP8 block (Hopper / DeepSeek-V3 style): float32 scales amax * float32(1/448) per 1x128 activation block or
  128x128 weight tile, E4M3 elements.

Every cast to an 8- or 4-bit float goes through ``narrow``: XLA:GPU's excess-precision pass (flag
xla_allow_excess_precision, on by default) rewrites ``convert(convert(x, f8), f32)`` to ``x``, so a
plain ``astype`` followed by a widening cast in the same program is not rounded at all.

Non-finite blocks: a block holding NaN or Inf gets a NaN scale (E8M0 0xFF, E4M3 0x7F, or a float32
NaN) and NaN elements (zeros for E2M1, which has no NaN), so dequantizing gives NaN for the block.
The NVFP4 and FP8-block recipes divide in float32 and therefore read float32 subnormal inputs as zero
(DAZ), exactly as XLA and GPUs do; their float32 scales are floored (2^-126, NVFP4 tensor scale
2^-117) so that every scale and scale product stays a normal number.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

MX_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK = 128

# name -> (dtype, largest exponent of a normal, largest finite value)
ELEM_FORMATS = {
    "e4m3": (jnp.float8_e4m3fn, 8, 448.0),
    "e5m2": (jnp.float8_e5m2, 15, 57344.0),
}
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_F32_TINY = 2.0 ** -126
_NAN_BITS = {jnp.dtype(jnp.float8_e4m3fn): 0x7F, jnp.dtype(jnp.float8_e5m2): 0x7E}
NVFP4_MIN_TENSOR_SCALE = 2.0 ** -117  # times the smallest E4M3 subnormal 2^-9 is still normal


def narrow(x, dtype):
  """``x.astype(dtype)`` behind an optimization barrier, so that a later widening cast cannot be
  folded into it. On an H100 without the barrier, NVFP4's block-scale rounding and every fake-quant
  (quantize then dequantize in one jit) were skipped: the codes and the dequantized products came
  out of unrounded values (tests/kernels/test_quant.py::test_narrowing_casts_sit_behind_a_barrier)."""
  return lax.optimization_barrier(x.astype(dtype))


def _check_axis(x, axis: int, block: int, what: str) -> int:
  axis = axis % x.ndim
  if x.shape[axis] % block:
    raise ValueError(f"{what}: dimension {axis} of shape {x.shape} must be a multiple of {block}; "
                     f"pad the input along axis={axis}")
  return axis


def _to_blocks(x, axis: int, block: int):
  """Moves ``axis`` last and splits it into [n_blocks, block]."""
  x = jnp.moveaxis(x, axis, -1)
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _from_blocks(xb, axis: int):
  x = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])
  return jnp.moveaxis(x, -1, axis)


def _expand_scale(scale, axis: int, block: int):
  """Repeats per-block scales along ``axis`` to the element shape."""
  return jnp.repeat(scale, block, axis=axis)


# ---------------------------------------------------------------------------------------------------
# MXFP8


def _f32_bits(x):
  return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _floor_log2_bits(mag_bits):
  """floor(log2(v)) for non-negative finite float32 bit patterns, subnormals included (v > 0)."""
  e = (mag_bits >> 23) & 0xFF
  m = mag_bits & 0x7FFFFF
  sub = -150 + (32 - lax.clz(m))  # v = m * 2^-149: floor(log2 v) = bit_length(m) - 1 - 149
  return jnp.where(e > 0, e - 127, sub)


def _significand_bits(mag_bits):
  """The 23 fraction bits of v normalised to 1.f (subnormals shifted up)."""
  e = (mag_bits >> 23) & 0xFF
  m = mag_bits & 0x7FFFFF
  shift = lax.clz(m) - 8
  return jnp.where(e > 0, m, (m << jnp.maximum(shift, 0)) & 0x7FFFFF)


def _scale_pow2_exact(x_bits, neg_exp):
  """x * 2^neg_exp computed on the bit pattern (exact; results below 2^-126 become signed zero,
  which is what any 8-bit-or-narrower element format rounds them to)."""
  sign = x_bits & jnp.int32(-0x80000000)
  mag = x_bits & 0x7FFFFFFF
  flog = _floor_log2_bits(mag)
  frac = _significand_bits(mag)
  new_e = flog + neg_exp + 127
  out = jnp.where((new_e >= 1) & (mag != 0), sign | (new_e << 23) | frac, sign)
  return lax.bitcast_convert_type(out, jnp.float32)


def mxfp8_scale_exponent(xb, elem: str = "e4m3", scale_rounding: str = "floor"):
  """Per-block unbiased scale exponent (int32) and a non-finite flag, for blocks on the last axis."""
  _, emax, _ = ELEM_FORMATS[elem]
  mag = _f32_bits(xb) & 0x7FFFFFFF
  amax = jnp.max(mag, axis=-1)  # integer order of non-negative floats is their value order
  nonfinite = amax >= 0x7F800000
  safe = jnp.where(nonfinite | (amax == 0), 1, amax)
  exp = _floor_log2_bits(safe) - emax
  if scale_rounding == "up":
    # max normal is 1.75 * 2^emax for both element formats: round up when amax's significand > 1.75
    exp = exp + (_significand_bits(safe) > 0x600000).astype(jnp.int32)
  exp = jnp.where(amax == 0, -127, exp)
  return jnp.clip(exp, -127, 127), nonfinite


def mxfp8_blocks(xb, elem: str = "e4m3", scale_rounding: str = "floor"):
  """MXFP8 of float32 blocks on the last axis ``[..., nb, 32]`` -> (elements, E8M0 scales [..., nb]).
  The fused Pallas kernel restates it on raw bits (``quant_pallas._mx_bits``); the tests hold both
  bit-equal to the NumPy reference."""
  dtype, _, maxn = ELEM_FORMATS[elem]
  exp, nonfinite = mxfp8_scale_exponent(xb, elem, scale_rounding)
  scaled = _scale_pow2_exact(_f32_bits(xb), -exp[..., None])
  q = narrow(jnp.clip(scaled, -maxn, maxn), dtype)
  q = _with_canonical_nan(q, nonfinite[..., None])
  scale_bits = jnp.where(nonfinite, 255, exp + 127).astype(jnp.uint8)
  return q, lax.bitcast_convert_type(scale_bits, jnp.float8_e8m0fnu)


def _with_canonical_nan(q, mask):
  """Sets ``q`` (an 8-bit float) to the format's positive quiet NaN where ``mask``: one bit pattern
  on every backend (a float32 NaN's payload would otherwise leak into the mantissa bits)."""
  nan_bits = _NAN_BITS[jnp.dtype(q.dtype)]
  bits = lax.bitcast_convert_type(q, jnp.uint8)
  return lax.bitcast_convert_type(jnp.where(mask, jnp.uint8(nan_bits), bits), q.dtype)


def _check_mx_args(elem, scale_rounding):
  if elem not in ELEM_FORMATS:
    raise ValueError(f"quantize_mxfp8: elem={elem!r} must be 'e4m3' or 'e5m2'")
  if scale_rounding not in ("floor", "up"):
    raise ValueError(f"quantize_mxfp8: scale_rounding={scale_rounding!r} must be 'floor' or 'up'")


def quantize_mxfp8(x, axis: int = -1, *, elem: str = "e4m3", scale_rounding: str = "floor"):
  """MXFP8: returns ``(q float8_e4m3fn|float8_e5m2 like x, scale float8_e8m0fnu)``; the scale has
  ``x.shape`` with ``axis`` divided by 32."""
  _check_mx_args(elem, scale_rounding)
  axis = _check_axis(x, axis, MX_BLOCK, "quantize_mxfp8")
  q, scale = mxfp8_blocks(_to_blocks(x.astype(jnp.float32), axis, MX_BLOCK), elem, scale_rounding)
  return _from_blocks(q, axis), jnp.moveaxis(scale, -1, axis)


def e8m0_to_f32_pair(scale):
  """An E8M0 scale as two normal float32 factors whose product is the scale (2^-127 is subnormal in
  float32, which flush-to-zero devices would read as 0)."""
  e = lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32) - 127
  half = e // 2
  f1 = lax.bitcast_convert_type((half + 127) << 23, jnp.float32)
  f2 = lax.bitcast_convert_type((e - half + 127) << 23, jnp.float32)
  nan = e == 128
  return jnp.where(nan, jnp.nan, f1), jnp.where(nan, jnp.nan, f2)


def dequantize_mxfp8(q, scale, axis: int = -1, dtype=jnp.float32):
  axis = axis % q.ndim
  f1, f2 = e8m0_to_f32_pair(scale)
  f1, f2 = _expand_scale(f1, axis, MX_BLOCK), _expand_scale(f2, axis, MX_BLOCK)
  return (q.astype(jnp.float32) * f1 * f2).astype(dtype)


# ---------------------------------------------------------------------------------------------------
# NVFP4


def _daz(x):
  """float32 with subnormals read as zero (what flush-to-zero hardware does)."""
  x = x.astype(jnp.float32)
  sub = (_f32_bits(x) & 0x7F800000) == 0
  return jnp.where(sub, jnp.zeros_like(x), x)


def nvfp4_tensor_scale(x):
  """s_t = amax / (6 * 448) over the finite entries, floored so s_b * s_t stays a normal float32."""
  a = jnp.abs(_daz(x))
  amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))
  # times a float32 reciprocal, not a division: XLA rewrites x / constant that way anyway
  rcp = jnp.float32(1.0 / (E2M1_MAX * E4M3_MAX))
  return jnp.maximum(amax * rcp, jnp.float32(NVFP4_MIN_TENSOR_SCALE))


def nvfp4_blocks(xb, s_t):
  """NVFP4 of DAZ'd float32 blocks ``[..., nb, 16]`` given the tensor scale -> (E2M1 elements,
  E4M3 block scales [..., nb]). The fused Pallas kernel restates it with integer E2M1 codes
  (``quant_pallas._nvfp4_bits``); the tests hold both bit-equal to the NumPy reference."""
  amax_b = jnp.max(jnp.abs(xb), axis=-1)
  nonfinite = jnp.any(~jnp.isfinite(xb), axis=-1)
  s_b = narrow(jnp.minimum(amax_b / (jnp.float32(E2M1_MAX) * s_t), E4M3_MAX), jnp.float8_e4m3fn)
  denom = s_b.astype(jnp.float32) * s_t
  safe = jnp.where(denom > 0, denom, 1.0)
  q = jnp.where((denom > 0)[..., None], xb / safe[..., None], 0.0)
  q = narrow(jnp.where(nonfinite[..., None], 0.0, jnp.clip(q, -E2M1_MAX, E2M1_MAX)), jnp.float4_e2m1fn)
  s_b = narrow(jnp.where(nonfinite, jnp.nan, s_b.astype(jnp.float32)), jnp.float8_e4m3fn)
  return q, s_b


def quantize_nvfp4(x, axis: int = -1, *, tensor_scale=None):
  """NVFP4: returns ``(q float4_e2m1fn like x, block_scale float8_e4m3fn, tensor_scale float32)``."""
  axis = _check_axis(x, axis, NVFP4_BLOCK, "quantize_nvfp4")
  x = _daz(x)
  s_t = nvfp4_tensor_scale(x) if tensor_scale is None else jnp.asarray(tensor_scale, jnp.float32)
  q, s_b = nvfp4_blocks(_to_blocks(x, axis, NVFP4_BLOCK), s_t)
  return _from_blocks(q, axis), jnp.moveaxis(s_b, -1, axis), s_t


def dequantize_nvfp4(q, block_scale, tensor_scale, axis: int = -1, dtype=jnp.float32):
  axis = axis % q.ndim
  s = _expand_scale(block_scale.astype(jnp.float32) * tensor_scale, axis, NVFP4_BLOCK)
  return (q.astype(jnp.float32) * s).astype(dtype)


# ---------------------------------------------------------------------------------------------------
# FP8 block recipe (Hopper): 1x128 activation scales, 128x128 weight scales, float32 scales.


def _fp8_scale(amax, nonfinite):
  """float32 scale amax * float32(1/448), floored at 2^-126 (stays normal; covers zero blocks)."""
  scale = jnp.maximum(amax * jnp.float32(1.0 / E4M3_MAX), jnp.float32(_F32_TINY))
  return jnp.where(nonfinite, jnp.nan, scale), nonfinite


def quantize_fp8_rowwise(x, axis: int = -1, block: int = FP8_BLOCK):
  """1 x block activation quantization along ``axis``: ``(q float8_e4m3fn, scale float32)``."""
  axis = _check_axis(x, axis, block, "quantize_fp8_rowwise")
  xb = _to_blocks(_daz(x), axis, block)
  scale, nonfinite = _fp8_scale(jnp.max(jnp.abs(xb), axis=-1),
                               jnp.any(~jnp.isfinite(xb), axis=-1))
  q = jnp.clip(xb / scale[..., None], -E4M3_MAX, E4M3_MAX)
  q = narrow(jnp.where(nonfinite[..., None], jnp.nan, q), jnp.float8_e4m3fn)
  return _from_blocks(q, axis), jnp.moveaxis(scale, -1, axis)


def dequantize_fp8_rowwise(q, scale, axis: int = -1, block: int = FP8_BLOCK, dtype=jnp.float32):
  axis = axis % q.ndim
  return (q.astype(jnp.float32) * _expand_scale(scale, axis, block)).astype(dtype)


def quantize_fp8_tile(w, block: int = FP8_BLOCK):
  """block x block quantization of the last two axes: ``(q float8_e4m3fn, scale float32[..., r, c])``."""
  _check_axis(w, -1, block, "quantize_fp8_tile")
  _check_axis(w, -2, block, "quantize_fp8_tile")
  *lead, r, c = w.shape
  wt = _daz(w).reshape(*lead, r // block, block, c // block, block)
  amax = jnp.max(jnp.abs(wt), axis=(-3, -1))
  scale, nonfinite = _fp8_scale(amax, jnp.any(~jnp.isfinite(wt), axis=(-3, -1)))
  s = scale[..., :, None, :, None]
  q = jnp.clip(wt / s, -E4M3_MAX, E4M3_MAX)
  q = narrow(jnp.where(nonfinite[..., :, None, :, None], jnp.nan, q), jnp.float8_e4m3fn)
  return q.reshape(w.shape), scale


def dequantize_fp8_tile(q, scale, block: int = FP8_BLOCK, dtype=jnp.float32):
  s = jnp.repeat(jnp.repeat(scale, block, axis=-1), block, axis=-2)
  return (q.astype(jnp.float32) * s).astype(dtype)


def fake_quant(x, axis: int, fmt: str):
  """Quantize-dequantize ``x`` along ``axis`` (float32 out): the exact values a block-scaled kernel
  multiplies. ``fmt``: mxfp8_e4m3 | mxfp8_e5m2 | nvfp4 | fp8_row | fp8_tile (last two axes)."""
  if fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):
    q, s = quantize_mxfp8(x, axis, elem=fmt[-4:])
    return dequantize_mxfp8(q, s, axis)
  if fmt == "nvfp4":
    q, sb, st = quantize_nvfp4(x, axis)
    return dequantize_nvfp4(q, sb, st, axis)
  if fmt == "fp8_row":
    q, s = quantize_fp8_rowwise(x, axis)
    return dequantize_fp8_rowwise(q, s, axis)
  if fmt == "fp8_tile":
    q, s = quantize_fp8_tile(x)
    return dequantize_fp8_tile(q, s)
  raise ValueError(f"fake_quant: unknown fmt={fmt!r}")


__all__ = [
  "dequantize_fp8_rowwise",
  "dequantize_fp8_tile",
  "dequantize_mxfp8",
  "dequantize_nvfp4",
  "fake_quant",
  "narrow",
  "quantize_fp8_rowwise",
  "quantize_fp8_tile",
  "quantize_mxfp8",
  "quantize_nvfp4",
]

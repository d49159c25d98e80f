"""Fused Pallas quantize kernels: one pass reads a float tile and writes elements and block scales.

The pure-JAX quantizers (kernels.quant) are the reference; these kernels call the same block math
(``mxfp8_blocks``, ``nvfp4_blocks``) on a VMEM / SRAM tile, so there is no intermediate float32 copy,
amax array or scaled array in HBM. Quantization runs along the last axis of a 2-D [rows, cols]
input (reshape / transpose other layouts first). NVFP4 needs the tensor amax before any block, so its
tensor scale comes in as a scalar operand, computed by a plain reduction. ``interpret=True`` runs the
kernels on CPU (TPU interpret mode when ``target='tpu'``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from composer_jax.kernels import quant
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton


def _tile(dim: int, preferred: int, multiple: int) -> int:
  t = preferred
  while t >= multiple:
    if dim % t == 0:
      return t
    t //= 2
  return dim


def _block_shape(r: int, c: int, block_shape, quant_block: int, target: str, interpret: bool,
                 what: str):
  """(rows, cols) of one kernel tile. Triton needs power-of-two tiles; Mosaic needs the last dim of
  every block (the scale output's is cols / quant_block) a multiple of 128 or the whole array."""
  br, bc = _tile(r, block_shape[0], 8), _tile(c, block_shape[1], quant_block)
  if target == "tpu":
    lanes = 128 * quant_block
    bc = _tile(c, max(block_shape[1] // lanes, 1) * lanes, lanes) if c % lanes == 0 else c
    rows = max(block_shape[0] * block_shape[1] // bc, 8)  # keep the tile's element count
    br = _tile(r, 1 << (rows.bit_length() - 1), 8)
  elif any(d & (d - 1) for d in (br, bc)) and not interpret:
    raise ValueError(f"{what}: target='gpu' (Triton) needs power-of-two tiles; x.shape={(r, c)} "
                     f"gives {(br, bc)}: pad rows to a multiple of 8 and cols to a multiple of "
                     f"{quant_block} times a power of two")
  return br, bc


def _compiler_params(target: str, tile_elems: int):
  """Explicit Triton params select the Triton lowering on GPU (pallas_call's GPU default is Mosaic
  GPU); about 64 elements per thread keeps the float32 tile math in registers."""
  if target == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  return pltriton.CompilerParams(num_warps=min(max(tile_elems // 2048, 4), 16), num_stages=1)


def _interpret(interpret: bool, target: str):
  if not interpret:
    return False
  return pltpu.InterpretParams() if target == "tpu" else True


def _check_target(target: str, what: str):
  if target not in ("gpu", "tpu"):
    raise ValueError(f"{what}: target={target!r} must be 'gpu' or 'tpu'")


def _mx_bits(xb, elem: str, scale_rounding: str):
  """``quant.mxfp8_blocks`` producing raw uint8 bits (elements, E8M0 scales): the kernels never
  hold a float8_e8m0fnu value, which the Triton lowering has no use for. A non-finite block stores
  the element format's canonical NaN, so the bits survive any float round trip."""
  dtype, _, maxn = quant.ELEM_FORMATS[elem]
  exp, nonfinite = quant.mxfp8_scale_exponent(xb, elem, scale_rounding)
  scaled = quant._scale_pow2_exact(quant._f32_bits(xb), -exp[..., None])
  bits = jax.lax.bitcast_convert_type(jnp.clip(scaled, -maxn, maxn).astype(dtype), jnp.uint8)
  q = jnp.where(nonfinite[..., None], jnp.uint8(quant._NAN_BITS[jnp.dtype(dtype)]), bits)
  return q, jnp.where(nonfinite, 255, exp + 127).astype(jnp.uint8)


def _mx_kernel(x_ref, q_ref, s_ref, *, elem, scale_rounding):
  br, bc = x_ref.shape
  xb = x_ref[...].astype(jnp.float32).reshape(br, bc // quant.MX_BLOCK, quant.MX_BLOCK)
  q, s = _mx_bits(xb, elem, scale_rounding)
  q_ref[...] = q.reshape(br, bc)
  s_ref[...] = s


def quantize_mxfp8_pallas(x, *, elem: str = "e4m3", scale_rounding: str = "floor",
                          block_shape: tuple[int, int] = (64, 512), interpret: bool = False,
                          target: str = "gpu"):
  """MXFP8 of x[rows, cols] along cols: ``(q, scale float8_e8m0fnu[rows, cols/32])``."""
  quant._check_mx_args(elem, scale_rounding)
  _check_target(target, "quantize_mxfp8_pallas")
  if x.ndim != 2:
    raise ValueError(f"quantize_mxfp8_pallas: x must be 2-D [rows, cols]; got shape {x.shape}")
  quant._check_axis(x, -1, quant.MX_BLOCK, "quantize_mxfp8_pallas")
  r, c = x.shape
  br, bc = _block_shape(r, c, block_shape, quant.MX_BLOCK, target, interpret,
                        "quantize_mxfp8_pallas")
  dtype = quant.ELEM_FORMATS[elem][0]
  q, s = pl.pallas_call(
      functools.partial(_mx_kernel, elem=elem, scale_rounding=scale_rounding),
      out_shape=(jax.ShapeDtypeStruct((r, c), jnp.uint8),
                 jax.ShapeDtypeStruct((r, c // quant.MX_BLOCK), jnp.uint8)),
      grid=(r // br, c // bc),
      in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
      out_specs=(pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                 pl.BlockSpec((br, bc // quant.MX_BLOCK), lambda i, j: (i, j))),
      compiler_params=_compiler_params(target, br * bc),
      interpret=_interpret(interpret, target),
      name="quantize_mxfp8",
  )(x)
  bitcast = jax.lax.bitcast_convert_type
  return bitcast(q, dtype), bitcast(s, jnp.float8_e8m0fnu)


# E2M1 magnitudes by code; RNE boundaries between neighbours (ties go to the even code)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
            (5.0, False))  # (boundary, a tie rounds up)


def _e2m1_code(v):
  """float32 in [-6, 6] -> E2M1 code (uint8: sign << 3 | magnitude code), rounded to nearest even.
  Integer compares instead of a float4 cast: neither Triton nor every Mosaic target has f4."""
  a = jnp.abs(v)
  code = sum(((a >= b) if up else (a > b)).astype(jnp.int32) for b, up in _E2M1_UP)
  sign = (quant._f32_bits(v) < 0).astype(jnp.int32)
  return (sign * 8 + code).astype(jnp.uint8)


def _nvfp4_bits(xb, s_t):
  """``quant.nvfp4_blocks`` on DAZ'd float32 blocks [..., nb, 16] producing (E2M1 codes, E4M3 scale
  bits) as uint8. "Any non-finite" is an integer max: Triton has no lowering for reduce_or."""
  amax_b = jnp.max(jnp.abs(xb), axis=-1)
  nonfinite = jnp.max((~jnp.isfinite(xb)).astype(jnp.int32), axis=-1) > 0
  s_b = jnp.minimum(amax_b / (jnp.float32(quant.E2M1_MAX) * s_t), quant.E4M3_MAX)
  # a plain cast, not quant.narrow: a kernel body has no optimization barrier, and Triton / Mosaic
  # keep the round trip (XLA:GPU would fold it, so interpret mode on a GPU is not bit-exact)
  s_b = s_b.astype(jnp.float8_e4m3fn)
  denom = s_b.astype(jnp.float32) * s_t
  safe = jnp.where(denom > 0, denom, 1.0)
  q = jnp.where((denom > 0)[..., None], xb / safe[..., None], 0.0)
  q = jnp.where(nonfinite[..., None], 0.0, jnp.clip(q, -quant.E2M1_MAX, quant.E2M1_MAX))
  nan_bits = jnp.uint8(quant._NAN_BITS[jnp.dtype(jnp.float8_e4m3fn)])
  s_bits = jnp.where(nonfinite, nan_bits, jax.lax.bitcast_convert_type(s_b, jnp.uint8))
  return _e2m1_code(q), s_bits


def _nvfp4_kernel(st_ref, x_ref, q_ref, s_ref):
  br, bc = x_ref.shape
  xb = quant._daz(x_ref[...]).reshape(br, bc // quant.NVFP4_BLOCK, quant.NVFP4_BLOCK)
  q, s = _nvfp4_bits(xb, st_ref[0])
  q_ref[...] = q.reshape(br, bc)
  s_ref[...] = s


def e2m1_from_codes(codes):
  """uint8 E2M1 codes -> float4_e2m1fn (exact: every code's value is representable)."""
  mag = jnp.asarray(_E2M1_VALUES, jnp.float32)[codes & 7]
  return jnp.where(codes >= 8, -mag, mag).astype(jnp.float4_e2m1fn)


def quantize_nvfp4_pallas(x, *, block_shape: tuple[int, int] = (64, 512), interpret: bool = False,
                          target: str = "gpu"):
  """NVFP4 of x[rows, cols] along cols: ``(q float4_e2m1fn, block_scale float8_e4m3fn, s_t)``.
  The kernel writes one E2M1 code per byte; the float4 array is made from the codes outside it
  (Pallas has no 4-bit memory refs on Triton)."""
  _check_target(target, "quantize_nvfp4_pallas")
  if x.ndim != 2:
    raise ValueError(f"quantize_nvfp4_pallas: x must be 2-D [rows, cols]; got shape {x.shape}")
  quant._check_axis(x, -1, quant.NVFP4_BLOCK, "quantize_nvfp4_pallas")
  r, c = x.shape
  br, bc = _block_shape(r, c, block_shape, quant.NVFP4_BLOCK, target, interpret,
                        "quantize_nvfp4_pallas")
  s_t = quant.nvfp4_tensor_scale(x)
  if target == "tpu":
    st_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
  else:
    st_spec = pl.BlockSpec((1,), lambda i, j: (0,))
  q, s = pl.pallas_call(
      _nvfp4_kernel,
      out_shape=(jax.ShapeDtypeStruct((r, c), jnp.uint8),
                 jax.ShapeDtypeStruct((r, c // quant.NVFP4_BLOCK), jnp.uint8)),
      grid=(r // br, c // bc),
      in_specs=[st_spec, pl.BlockSpec((br, bc), lambda i, j: (i, j))],
      out_specs=(pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                 pl.BlockSpec((br, bc // quant.NVFP4_BLOCK), lambda i, j: (i, j))),
      compiler_params=_compiler_params(target, br * bc),
      interpret=_interpret(interpret, target),
      name="quantize_nvfp4",
  )(s_t.reshape(1), x)
  return e2m1_from_codes(q), jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn), s_t

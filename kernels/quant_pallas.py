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


def _tile(dim: int, preferred: int, multiple: int) -> int:
  t = preferred
  while t >= multiple:
    if dim % t == 0:
      return t
    t //= 2
  return dim


def _interpret(interpret: bool, target: str):
  if not interpret:
    return False
  return pltpu.InterpretParams() if target == "tpu" else True


def _mx_kernel(x_ref, q_ref, s_ref, *, elem, scale_rounding):
  br, bc = x_ref.shape
  xb = x_ref[...].astype(jnp.float32).reshape(br, bc // quant.MX_BLOCK, quant.MX_BLOCK)
  q, s = quant.mxfp8_blocks(xb, elem, scale_rounding)
  # stored as raw bits: the NaN pattern must survive any float round trip of the store
  q_ref[...] = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(br, bc)
  s_ref[...] = jax.lax.bitcast_convert_type(s, jnp.uint8)


def quantize_mxfp8_pallas(x, *, elem: str = "e4m3", scale_rounding: str = "floor",
                          block_shape: tuple[int, int] = (64, 512), interpret: bool = False,
                          target: str = "gpu"):
  """MXFP8 of x[rows, cols] along cols: ``(q, scale float8_e8m0fnu[rows, cols/32])``."""
  quant._check_mx_args(elem, scale_rounding)
  if x.ndim != 2:
    raise ValueError(f"quantize_mxfp8_pallas: x must be 2-D [rows, cols]; got shape {x.shape}")
  quant._check_axis(x, -1, quant.MX_BLOCK, "quantize_mxfp8_pallas")
  r, c = x.shape
  br, bc = _tile(r, block_shape[0], 8), _tile(c, block_shape[1], quant.MX_BLOCK)
  dtype = quant.ELEM_FORMATS[elem][0]
  q, s = pl.pallas_call(
      functools.partial(_mx_kernel, elem=elem, scale_rounding=scale_rounding),
      out_shape=(jax.ShapeDtypeStruct((r, c), jnp.uint8),
                 jax.ShapeDtypeStruct((r, c // quant.MX_BLOCK), jnp.uint8)),
      grid=(r // br, c // bc),
      in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
      out_specs=(pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                 pl.BlockSpec((br, bc // quant.MX_BLOCK), lambda i, j: (i, j))),
      interpret=_interpret(interpret, target),
      name="quantize_mxfp8",
  )(x)
  bitcast = jax.lax.bitcast_convert_type
  return bitcast(q, dtype), bitcast(s, jnp.float8_e8m0fnu)


def _nvfp4_kernel(st_ref, x_ref, q_ref, s_ref):
  br, bc = x_ref.shape
  xb = quant._daz(x_ref[...]).reshape(br, bc // quant.NVFP4_BLOCK, quant.NVFP4_BLOCK)
  q, s = quant.nvfp4_blocks(xb, st_ref[0])
  q_ref[...] = q.reshape(br, bc)
  s_ref[...] = s


def quantize_nvfp4_pallas(x, *, block_shape: tuple[int, int] = (64, 512), interpret: bool = False,
                          target: str = "gpu"):
  """NVFP4 of x[rows, cols] along cols: ``(q float4_e2m1fn, block_scale float8_e4m3fn, s_t)``."""
  if x.ndim != 2:
    raise ValueError(f"quantize_nvfp4_pallas: x must be 2-D [rows, cols]; got shape {x.shape}")
  quant._check_axis(x, -1, quant.NVFP4_BLOCK, "quantize_nvfp4_pallas")
  r, c = x.shape
  br, bc = _tile(r, block_shape[0], 8), _tile(c, block_shape[1], quant.NVFP4_BLOCK)
  s_t = quant.nvfp4_tensor_scale(x)
  if target == "tpu":
    st_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
  else:
    st_spec = pl.BlockSpec((1,), lambda i, j: (0,))
  q, s = pl.pallas_call(
      _nvfp4_kernel,
      out_shape=(jax.ShapeDtypeStruct((r, c), jnp.float4_e2m1fn),
                 jax.ShapeDtypeStruct((r, c // quant.NVFP4_BLOCK), jnp.float8_e4m3fn)),
      grid=(r // br, c // bc),
      in_specs=[st_spec, pl.BlockSpec((br, bc), lambda i, j: (i, j))],
      out_specs=(pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                 pl.BlockSpec((br, bc // quant.NVFP4_BLOCK), lambda i, j: (i, j))),
      interpret=_interpret(interpret, target),
      name="quantize_nvfp4",
  )(s_t.reshape(1), x)
  return q, s, s_t

"""Grouped matmul: rows of ``lhs`` sorted by group, one weight matrix per group.

``gmm(lhs[m,k], rhs[g,k,n], group_sizes[g]) -> [m,n]``; rows past ``sum(group_sizes)`` give zeros.
``tgmm(lhs[m,k], grad[m,n], group_sizes[g]) -> [g,k,n]`` is the weight-gradient product.

Backends (``impl``): ``xla`` (lax.ragged_dot), ``sorted`` (block layout + a loop of large dense
dots per group, the CPU path: gmm_sorted), ``pallas`` (Mosaic kernels on TPU, Triton kernels on GPU),
``interpret`` (the Pallas kernels in interpret mode on CPU; ``interpret_target`` picks the GPU kernels
or the TPU kernels in TPU interpret mode), ``auto`` (pallas on GPU/TPU, sorted on CPU). All but bf16
``xla`` run on the block layout under one custom VJP: dlhs = gmm(grad, rhs^T), drhs = tgmm(lhs, grad).

Several products over the same rows share one layout: ``plan_rows`` builds it once and
``gmm_planned`` multiplies rows already in it (the MoE gathers tokens straight into it and runs gate,
up and down there; see composer_jax.model.moe).

``precision`` (bf16 | fp8_block | mxfp8 | nvfp4) quantizes the operands of all three products in the
recipe's formats (kernels.quant.fake_quant: exactly the values a block-scaled kernel multiplies) and
accumulates in float32; the master weights and the cotangents handed back stay full precision.

Which products run on real low-precision operands (everything else multiplies the fake-quant
float32 values, i.e. the same numbers, on 32-bit units):

==========  =====================  ==================================================================
recipe      backend                real low-precision product
==========  =====================  ==================================================================
fp8_block   pallas GPU (Triton)    fwd and dgrad: E4M3 x E4M3 tensor-core dots per 128-wide k slice,
                                   1x128 / 128x128 float32 scales on the float32 partial products
mxfp8       pallas GPU (Triton)    fwd: E4M3 x E4M3 dots per 32-wide k slice (one Hopper wgmma
                                   k-step), E8M0 scales decoded to float32; dgrad: E5M2 grad x E4M3
                                   weight loaded as FP8 but multiplied as float16 (exact; Pallas'
                                   Triton lowering takes no mixed-type dot), so 16-bit tensor cores
nvfp4       any                    none (Hopper has no FP4 tensor cores)
any         pallas TPU, sorted,    none: Mosaic / XLA products of the dequantized float32 operands
            xla
==========  =====================  ==================================================================

The weight gradient (tgmm, scale blocks along the tokens) is dequantized for every recipe. ``impl=
"interpret"`` with ``interpret_target="gpu"`` runs the same FP8 kernels on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from composer_jax.kernels import gmm_pallas_gpu, gmm_pallas_tpu, gmm_sorted
from composer_jax.kernels.gmm_layout import (
  BlockLayout,
  from_blocks,
  make_layout,
  to_blocks,
  varying_like,
)
from composer_jax.kernels.quant import (
  fake_quant,
  quantize_fp8_rowwise,
  quantize_fp8_tile,
  quantize_mxfp8,
)

IMPLS = ("auto", "xla", "sorted", "pallas", "interpret")
PRECISIONS = ("bf16", "fp8_block", "mxfp8", "nvfp4")

# recipe -> formats for (fwd lhs along k, fwd rhs along k, grad along n, rhs along n,
#                        wgrad lhs along m, wgrad grad along m), and the contraction multiple needed
RECIPES = {
    "mxfp8": (("mxfp8_e4m3", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp8_e4m3", "mxfp8_e4m3", "mxfp8_e5m2"),
              32),
    "nvfp4": (("nvfp4",) * 6, 16),
    "fp8_block": (("fp8_row", "fp8_tile", "fp8_row", "fp8_tile", "fp8_row", "fp8_row"), 128),
}


def _resolve_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"gmm: impl={impl!r} is not one of {IMPLS}")
  if impl == "auto":
    return "pallas" if jax.default_backend() in ("gpu", "tpu") else "sorted"
  return impl


def default_block_rows(impl: str, precision: str) -> int:
  """Rows per block. CPU (sorted): blocks only set the padding (the dots run on chunks of up to
  gmm_sorted.MAX_CHUNK_ROWS rows), so small: 16 rows measured 5 % faster than 32 and 9 % faster than
  64 on the bench MoE layer. Kernels: 128 (MXU / tensor-core tile)."""
  bm = 16 if impl == "sorted" else 128
  if precision != "bf16":  # token-axis scale blocks must not straddle two groups
    mult = RECIPES[precision][1]
    bm = -(-bm // mult) * mult
  return bm


def _backend(impl: str, interpret_target: str):
  """(gmm_blocks, tgmm_blocks) for a resolved impl."""
  if impl == "sorted":
    return gmm_sorted.gmm_blocks, gmm_sorted.tgmm_blocks
  if impl == "xla":
    return _xla_gmm_blocks, _xla_tgmm_blocks
  if impl == "interpret":
    mod = gmm_pallas_tpu if interpret_target == "tpu" else gmm_pallas_gpu
    return (functools.partial(mod.gmm_blocks, interpret=True),
            functools.partial(mod.tgmm_blocks, interpret=True))
  mod = gmm_pallas_tpu if jax.default_backend() == "tpu" else gmm_pallas_gpu
  return mod.gmm_blocks, mod.tgmm_blocks


def _padded_sizes(layout, block_rows):
  return (layout.group_block_start[1:] - layout.group_block_start[:-1]) * block_rows


def _xla_gmm_blocks(xp, rhs, layout, block_rows, *, transpose_rhs=False, out_dtype=None):
  w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  return jax.lax.ragged_dot(xp, w, _padded_sizes(layout, block_rows),
                            preferred_element_type=out_dtype or xp.dtype)


def _xla_tgmm_blocks(xp, gp, layout, block_rows, num_groups, *, out_dtype=None):
  dn = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(xp, gp, _padded_sizes(layout, block_rows)[:num_groups], dn,
                                    preferred_element_type=out_dtype or xp.dtype)


# recipes with a real FP8 Pallas GPU kernel for the activation-side products (fwd, dgrad)
FP8_KERNEL_RECIPES = ("fp8_block", "mxfp8")


def _fp8_kernel_product(impl, interpret_target, precision):
  """The true FP8 Pallas product (FP8 operands + float32 block scales) when an FP8 recipe runs on
  the GPU kernels (or those kernels in interpret mode); else None (dequantized operands)."""
  if precision not in FP8_KERNEL_RECIPES:
    return None
  if impl == "interpret" and interpret_target == "gpu":
    return functools.partial(gmm_pallas_gpu.gmm_fp8_blocks, interpret=True)
  if impl == "pallas" and jax.default_backend() == "gpu":
    return gmm_pallas_gpu.gmm_fp8_blocks
  return None


def _e8m0_to_f32(scale):
  """E8M0 -> float32 2^e from the bit pattern (Triton has no E8M0 type). Code 0 (2^-127) has no
  float32 exponent field of its own: it is the subnormal 0x00400000. 0xFF is NaN."""
  bits = jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
  val = jax.lax.bitcast_convert_type(jnp.where(bits == 0, 1 << 22, bits << 23), jnp.float32)
  return jnp.where(bits == 255, jnp.nan, val)


def _kernel_quant(a, axis, fmt):
  """(FP8 elements, float32 scales on a's axes) in ``fmt``: the same values fake_quant(a, axis,
  fmt) dequantizes to."""
  if fmt == "fp8_row":
    return quantize_fp8_rowwise(a, axis)
  if fmt == "fp8_tile":  # 128x128 tiles serve either contraction axis
    return quantize_fp8_tile(a)
  q, s = quantize_mxfp8(a, axis, elem=fmt[-4:])
  return q, _e8m0_to_f32(s)


def _fp8_product(prod, x, w, fmt_x, fmt_w, layout, block_rows, transpose_rhs):
  """x [P, kc] @ w (contracting w's axis 1, or axis 2 with ``transpose_rhs``), both quantized along
  the contraction axis, on the FP8 kernel."""
  xq, xs = _kernel_quant(x, 1, fmt_x)
  wq, ws = _kernel_quant(w, 2 if transpose_rhs else 1, fmt_w)
  return prod(xq, xs, wq, ws, layout, block_rows, transpose_rhs=transpose_rhs)


def _q(x, axis, fmt):
  return x if fmt is None else fake_quant(x, axis, fmt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm_padded(xp, rhs, layout, impl, precision, block_rows, interpret_target):
  out, _ = _gmm_padded_fwd(xp, rhs, layout, impl, precision, block_rows, interpret_target)
  return out


def _gmm_padded_fwd(xp, rhs, layout, impl, precision, block_rows, interpret_target):
  fwd, _ = _backend(impl, interpret_target)
  fmts = RECIPES[precision][0] if precision != "bf16" else (None,) * 6
  fp8 = _fp8_kernel_product(impl, interpret_target, precision)
  if fp8 is not None:
    out = _fp8_product(fp8, xp, rhs, fmts[0], fmts[1], layout, block_rows, False)
    return out, (xp, rhs, layout)
  out = fwd(_q(xp, 1, fmts[0]), _q(rhs, 1, fmts[1]), layout, block_rows, out_dtype=jnp.float32)
  return out, (xp, rhs, layout)


def _gmm_padded_bwd(impl, precision, block_rows, interpret_target, res, ct):
  xp, rhs, layout = res
  fwd, tg = _backend(impl, interpret_target)
  fmts = RECIPES[precision][0] if precision != "bf16" else (None,) * 6
  ct = ct.astype(jnp.float32) if precision != "bf16" else ct.astype(xp.dtype)
  fp8 = _fp8_kernel_product(impl, interpret_target, precision)
  if fp8 is not None:  # dgrad: grad and rhs quantized along n
    dx = _fp8_product(fp8, ct, rhs, fmts[2], fmts[3], layout, block_rows, True)
  else:
    dx = fwd(_q(ct, 1, fmts[2]), _q(rhs, 2, fmts[3]), layout, block_rows, transpose_rhs=True,
             out_dtype=jnp.float32)
  # wgrad (quantized along tokens, per group) stays on dequantized operands for every recipe: its
  # scale blocks run along the contraction m (an FP8 tgmm kernel is not written yet)
  drhs = tg(_q(xp, 0, fmts[4]), _q(ct, 0, fmts[5]), layout, block_rows, rhs.shape[0],
            out_dtype=jnp.float32)
  return dx.astype(xp.dtype), drhs.astype(rhs.dtype), None


_gmm_padded.defvjp(_gmm_padded_fwd, _gmm_padded_bwd)


def _check(lhs, rhs, group_sizes, impl, precision):
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(f"gmm: need lhs[m,k], rhs[g,k,n], group_sizes[g]; got {lhs.shape}, "
                     f"{rhs.shape}, {group_sizes.shape}")
  if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
    raise ValueError(f"gmm: lhs {lhs.shape} / rhs {rhs.shape} / group_sizes {group_sizes.shape} "
                     "disagree on k or g")
  if precision not in PRECISIONS:
    raise ValueError(f"gmm: precision={precision!r} is not one of {PRECISIONS}")
  if precision != "bf16":
    mult = RECIPES[precision][1]
    if lhs.shape[1] % mult or rhs.shape[2] % mult:
      raise ValueError(f"gmm: precision={precision} needs k and n multiples of {mult}; got "
                       f"k={lhs.shape[1]}, n={rhs.shape[2]} (use gmm_precision=bf16 or resize)")
  _resolve_impl(impl)


class RowPlan(NamedTuple):
  """A block layout with the backend choices that go with it: build once per routing, then run any
  number of products over the same padded rows (the MoE's gate/up and down share one)."""
  layout: BlockLayout
  block_rows: int
  impl: str
  precision: str
  interpret_target: str


def plan_rows(group_sizes, m: int, *, impl: str = "auto", precision: str = "bf16",
              block_rows: int | None = None, interpret_target: str = "gpu") -> RowPlan:
  """Resolve the backend and lay ``m`` group-sorted rows out in blocks for it."""
  if precision not in PRECISIONS:
    raise ValueError(f"gmm: precision={precision!r} is not one of {PRECISIONS}")
  impl = _resolve_impl(impl)
  bm = block_rows or default_block_rows(impl, precision)
  return RowPlan(make_layout(group_sizes, m, bm), bm, impl, precision, interpret_target)


def gmm_planned(xp, rhs, plan: RowPlan):
  """``gmm`` on rows already in the plan's block layout (``to_blocks``): [P,k] x [g,k,n] -> [P,n]
  float32, padding rows zero. Differentiable in xp and rhs."""
  if plan.precision != "bf16":
    mult = RECIPES[plan.precision][1]
    if xp.shape[1] % mult or rhs.shape[2] % mult:
      raise ValueError(f"gmm: precision={plan.precision} needs k and n multiples of {mult}; got "
                       f"k={xp.shape[1]}, n={rhs.shape[2]} (use gmm_precision=bf16 or resize)")
  # Inside shard_map, give both operands the union of their varying mesh axes *outside* the custom
  # VJP: its backward returns cotangents that vary like the products, and the pcast's own transpose
  # (a psum) then brings e.g. a data-invariant weight's gradient back to invariant.
  xp, rhs = (varying_like(a, xp, rhs, plan.layout) for a in (xp, rhs))
  return _gmm_padded(xp, rhs, plan.layout, plan.impl, plan.precision, plan.block_rows,
                     plan.interpret_target)


def gmm(lhs, rhs, group_sizes, *, impl: str = "auto", precision: str = "bf16",
        preferred_element_type=None, block_rows: int | None = None,
        interpret_target: str = "gpu"):
  """Grouped matmul ``[m,k] x [g,k,n] -> [m,n]``, differentiable in lhs and rhs."""
  _check(lhs, rhs, group_sizes, impl, precision)
  out_dtype = preferred_element_type or lhs.dtype
  if _resolve_impl(impl) == "xla" and precision == "bf16":  # ragged_dot's own autodiff: the contrast
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                              preferred_element_type=out_dtype)
  plan = plan_rows(group_sizes, lhs.shape[0], impl=impl, precision=precision,
                   block_rows=block_rows, interpret_target=interpret_target)
  xp = to_blocks(lhs, plan.layout.src, plan.layout.dest)
  yp = gmm_planned(xp, rhs, plan)
  return from_blocks(yp, plan.layout.src, plan.layout.dest).astype(out_dtype)


def tgmm(lhs, grad, group_sizes, *, num_groups: int | None = None, impl: str = "auto",
         block_rows: int | None = None, interpret_target: str = "gpu"):
  """Per-group ``lhs^T @ grad`` -> [g,k,n] (the weight gradient of gmm)."""
  g = num_groups if num_groups is not None else group_sizes.shape[0]
  impl = _resolve_impl(impl)
  m = lhs.shape[0]
  bm = block_rows or default_block_rows(impl, "bf16")
  layout = make_layout(group_sizes[:g], m, bm)
  xp = to_blocks(lhs, layout.src, layout.dest)
  gp = to_blocks(grad, layout.src, layout.dest)
  _, tg = _backend(impl, interpret_target)
  return tg(xp, gp, layout, bm, g, out_dtype=jnp.float32).astype(lhs.dtype)


def gmm_reference(lhs, rhs, group_sizes):
  """Plain-JAX definition (masked dense product over all groups): the tests' autodiff reference."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(lhs.shape[0])
  mask = (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])  # [g, m]
  return jnp.einsum("gm,mk,gkn->mn", mask.astype(lhs.dtype), lhs, rhs)

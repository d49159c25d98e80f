"""The Pallas kernels lower for the platforms they are written for, checked on a CPU-only machine.

``jax.export`` with ``platforms=("cuda",)`` / ``("tpu",)`` traces and lowers for a backend this
machine does not have: the GPU kernels become Triton IR inside ``__gpu$xla.gpu.triton`` custom calls,
the TPU kernels Mosaic MLIR inside ``tpu_custom_call``. Each kernel body is decoded back from the
custom call and inspected: dot operand dtypes (the FP8 kernel must multiply E4M3, not an upcast),
Triton's power-of-two tile rule, and no Mosaic GPU call (pallas_call's GPU default, whose staging of
the full weight array does not fit in shared memory). What this cannot see: the device compilers
(Triton -> PTX, Mosaic's layout passes in libtpu) run only on real hardware.
"""

from __future__ import annotations

import base64
import json
import re

import jax
import jax.numpy as jnp
import pytest
from composer_jax.kernels import gmm, gmm_pallas_gpu, gmm_pallas_tpu, quant_pallas
from composer_jax.kernels.gmm_layout import BlockLayout, num_blocks
from jax import export
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import tpu as tpu_dialect
from jax._src.lib import triton as triton_lib
from jax._src.lib.mlir import ir
from jaxlib.mlir.passmanager import PassManager

TRITON_CALL = "__gpu$xla.gpu.triton"  # what jaxlib 0.10.2 emits for a Triton pallas_call
MOSAIC_CALL = "tpu_custom_call"
MOSAIC_GPU_CALLS = ("mosaic_gpu", "mosaic_gpu_v2")
F8 = jnp.float8_e4m3fn
S = jax.ShapeDtypeStruct

# (m, k, n, groups, block_rows): DeepSeek-V3-like expert shapes on 8 local experts, and a small one
# whose sizes are not powers of two in every dimension
SHAPES = {"deepseek": (1024, 7168, 2048, 8, 128), "small": (192, 256, 384, 3, 64)}


def _export(fn, args, platform):
  checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)] if platform == "cuda" else []
  return export.export(jax.jit(fn), platforms=(platform,), disabled_checks=checks)(*args)


def _walk(op, out):
  op = op.operation
  if op.name == "stablehlo.custom_call":
    out.append(op)
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        _walk(child, out)
  return out


def _triton_body(cfg):
  ctx = jax_mlir.make_ir_context()
  triton_lib.dialect.register_dialect(ctx)
  with ctx:
    return str(ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes))


def _mosaic_body(cfg_json):
  body = base64.b64decode(json.loads(cfg_json)["custom_call_config"]["body"])
  ctx = jax_mlir.make_ir_context()
  tpu_dialect.register_dialect(ctx)
  with ctx, ir.Location.unknown():
    ctx.allow_unregistered_dialects = True
    mod = ir.Module.parse(body)
    PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(mod.operation)
    return str(mod)


def kernels(exported):
  """[(call target, kernel name, decoded kernel IR text)] for every custom call in the module."""
  with jax_mlir.make_ir_context():
    mod = ir.Module.parse(exported.mlir_module())
    out = []
    for op in _walk(mod, []):
      target = ir.StringAttr(op.attributes["call_target_name"]).value
      if target == TRITON_CALL:
        cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
        out.append((target, ir.StringAttr(cfg["name"]).value, _triton_body(cfg)))
      elif target == MOSAIC_CALL:
        body = _mosaic_body(ir.StringAttr(op.attributes["backend_config"]).value)
        name = re.search(r"func\.func @(\w+)\(", body).group(1)
        out.append((target, name, body))
      else:
        out.append((target, None, ""))
  return out


def _dot_types(body):
  """Operand element types of every Triton dot: [("bf16", "bf16"), ...]."""
  return re.findall(r"tt\.dot .*: tensor<[\dx]+x(\w+)> \* tensor<[\dx]+x(\w+)>", body)


def _tensor_shapes(body):
  return {tuple(int(d) for d in s.split("x")) for s in re.findall(r"tensor<(\d+(?:x\d+)*)x", body)}


def check_triton(exported, want):
  """Every custom call is a Triton kernel, the kernel names are ``want``, and every tensor in them
  has power-of-two dims (Triton's tile rule)."""
  ks = kernels(exported)
  targets = {t for t, _, _ in ks}
  assert targets == {TRITON_CALL}, targets
  assert not targets & set(MOSAIC_GPU_CALLS)
  assert sorted(n for _, n, _ in ks) == sorted(want)
  for _, name, body in ks:
    bad = [s for s in _tensor_shapes(body) if any(d & (d - 1) for d in s)]
    assert not bad, (name, bad)
    assert "f8E8M0FNU" not in body and "f4E2M1FN" not in body, name  # no Triton type for these
  return ks


def check_mosaic(exported, want):
  ks = kernels(exported)
  assert {t for t, _, _ in ks} == {MOSAIC_CALL}
  assert sorted(n for _, n, _ in ks) == sorted(want)
  return ks


def _layout_args(m, g, bm):
  nb = num_blocks(m, g, bm)
  return nb * bm, (S((nb * bm,), jnp.int32), S((m,), jnp.int32), S((nb,), jnp.int32),
                   S((g + 1,), jnp.int32))


MODS = {"cuda": (gmm_pallas_gpu, "gpu"), "tpu": (gmm_pallas_tpu, "tpu")}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("product", ["fwd", "dlhs", "wgrad"])
def test_gmm_kernels_lower(shape, platform, product):
  m, k, n, g, bm = SHAPES[shape]
  mod, suffix = MODS[platform]
  p, lay = _layout_args(m, g, bm)
  bf = jnp.bfloat16
  if product == "wgrad":
    fn = lambda x, gr, *l: mod.tgmm_blocks(x, gr, BlockLayout(*l), bm, g, out_dtype=jnp.float32)
    args, name = (S((p, k), bf), S((p, n), bf)), f"tgmm_{suffix}"
  else:
    tr = product == "dlhs"
    fn = lambda x, w, *l: mod.gmm_blocks(x, w, BlockLayout(*l), bm, transpose_rhs=tr,
                                         out_dtype=jnp.float32)
    args, name = (S((p, n if tr else k), bf), S((g, k, n), bf)), f"gmm_{suffix}"
  ex = _export(fn, args + lay, platform)
  if platform == "cuda":
    [(_, _, body)] = check_triton(ex, [name])
    assert _dot_types(body) == [("bf16", "bf16")]
  else:
    [(_, _, body)] = check_mosaic(ex, [name])
    assert "tpu.matmul" in body


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_fp8_kernel_lowers_to_fp8_dot(shape, transpose_rhs):
  m, k, n, g, bm = SHAPES[shape]
  p, lay = _layout_args(m, g, bm)
  kx = n if transpose_rhs else k
  args = (S((p, kx), F8), S((p, kx // 128), jnp.float32), S((g, k, n), F8),
          S((g, k // 128, n // 128), jnp.float32))
  fn = lambda x, xs, w, ws, *l: gmm_pallas_gpu.gmm_fp8_blocks(x, xs, w, ws, BlockLayout(*l), bm,
                                                              transpose_rhs=transpose_rhs)
  [(_, _, body)] = check_triton(_export(fn, args + lay, "cuda"), ["gmm_fp8_gpu"])
  # the tensor cores multiply E4M3 tiles; the scales are applied to the float32 products
  assert _dot_types(body) == [("f8E4M3FN", "f8E4M3FN")]


QUANT = {
    "mxfp8_e4m3": (lambda x, t: quant_pallas.quantize_mxfp8_pallas(x, elem="e4m3", target=t),
                   "quantize_mxfp8"),
    "mxfp8_e5m2": (lambda x, t: quant_pallas.quantize_mxfp8_pallas(x, elem="e5m2", target=t),
                   "quantize_mxfp8"),
    "nvfp4": (lambda x, t: quant_pallas.quantize_nvfp4_pallas(x, target=t), "quantize_nvfp4"),
}


@pytest.mark.parametrize("rows_cols", [(1024, 7168), (48, 128)])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("fmt", list(QUANT))
def test_quantize_kernels_lower(rows_cols, platform, fmt):
  fn, name = QUANT[fmt]
  target = MODS[platform][1]
  ex = _export(lambda x: fn(x, target), (S(rows_cols, jnp.bfloat16),), platform)
  (check_triton if platform == "cuda" else check_mosaic)(ex, [name])


def test_mixed_dtype_gmm_lowers():
  """bf16 activations against float32 (master) weights: Triton dots need one operand dtype, so the
  kernel promotes the bf16 tile, as XLA would; float32 tiles are 64 wide to fit the pipeline."""
  m, k, n, g, bm = SHAPES["small"]
  p, lay = _layout_args(m, g, bm)
  fn = lambda x, w, *l: gmm_pallas_gpu.gmm_blocks(x, w, BlockLayout(*l), bm)
  ex = _export(fn, (S((p, k), jnp.bfloat16), S((g, k, n), jnp.float32)) + lay, "cuda")
  [(_, _, body)] = check_triton(ex, ["gmm_gpu"])
  assert _dot_types(body) == [("f32", "f32")]
  assert "tensor<64x64xf32> * tensor<64x64xf32>" in body


def test_gpu_tiles_must_be_powers_of_two():
  p, lay = _layout_args(96, 2, 32)
  fn = lambda x, w, *l: gmm_pallas_gpu.gmm_blocks(x, w, BlockLayout(*l), 32)
  with pytest.raises(ValueError, match="power-of-two tiles"):
    _export(fn, (S((p, 24), jnp.bfloat16), S((2, 24, 64), jnp.bfloat16)) + lay, "cuda")
  with pytest.raises(ValueError, match="power-of-two tiles"):
    quant_pallas.quantize_mxfp8_pallas(jnp.zeros((12, 64)), target="gpu")


# the differentiable gmm: forward and both backward products through the custom VJP
GMM_CASES = [("cuda", "bf16", ["gmm_gpu", "gmm_gpu", "tgmm_gpu"]),
             ("cuda", "fp8_block", ["gmm_fp8_gpu", "gmm_fp8_gpu", "tgmm_gpu"]),
             ("cuda", "mxfp8", ["gmm_fp8_gpu", "gmm_fp8_gpu", "tgmm_gpu"]),
             ("tpu", "bf16", ["gmm_tpu", "gmm_tpu", "tgmm_tpu"]),
             ("tpu", "mxfp8", ["gmm_tpu", "gmm_tpu", "tgmm_tpu"])]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("platform", "precision", "want"), GMM_CASES)
def test_gmm_value_and_grad_lowers(monkeypatch, shape, platform, precision, want):
  m, k, n, g, _ = SHAPES[shape]
  # gmm picks its kernels from the default backend; this machine's is cpu
  monkeypatch.setattr(jax, "default_backend", lambda: MODS[platform][1])

  def loss(x, w, sizes):
    y = gmm(x, w, sizes, impl="pallas", precision=precision)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  fn = jax.value_and_grad(loss, argnums=(0, 1))
  args = (S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((g,), jnp.int32))
  ex = _export(fn, args, platform)
  if platform == "tpu":
    check_mosaic(ex, want)
    return
  ks = check_triton(ex, want)
  dots = sorted(_dot_types(body)[0] for _, _, body in ks)
  if precision == "fp8_block":  # both activation-side products on the FP8 kernel
    assert dots.count(("f8E4M3FN", "f8E4M3FN")) == 2
  elif precision == "mxfp8":
    # fwd: E4M3 x E4M3 tensor-core dots per 32-wide k slice; dgrad: E5M2 grad x E4M3 weight, which
    # Pallas' Triton lowering cannot take as one dot, widened in-kernel to float16 (exact);
    # wgrad: dequantized float32 operands
    assert dots == sorted([("f8E4M3FN", "f8E4M3FN"), ("f16", "f16"), ("f32", "f32")])
    fwd = next(b for _, _, b in ks if _dot_types(b) == [("f8E4M3FN", "f8E4M3FN")])
    assert "tensor<128x32xf8E4M3FN> * tensor<32x128xf8E4M3FN>" in fwd
    dgrad = next(b for _, _, b in ks if _dot_types(b) == [("f16", "f16")])
    assert "xf8E5M2>" in dgrad and "xf8E4M3FN>" in dgrad  # loaded as FP8 from memory
  else:
    assert dots == [("bf16", "bf16")] * 3


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_mxfp8_kernel_lowers_to_fp8_dot(shape, transpose_rhs):
  """MXFP8 scales (float32 from E8M0): per 32 of k for the rows, per (32 of k, column) for rhs; the
  kernel steps k one 32-wide scale block at a time with an E4M3 x E4M3 dot (the dgrad layout,
  transpose_rhs, given E4M3 operands here too)."""
  m, k, n, g, bm = SHAPES[shape]
  p, lay = _layout_args(m, g, bm)
  kx = n if transpose_rhs else k
  ws = S((g, k, n // 32) if transpose_rhs else (g, k // 32, n), jnp.float32)
  args = (S((p, kx), F8), S((p, kx // 32), jnp.float32), S((g, k, n), F8), ws)
  fn = lambda x, xs, w, ws, *l: gmm_pallas_gpu.gmm_fp8_blocks(x, xs, w, ws, BlockLayout(*l), bm,
                                                              transpose_rhs=transpose_rhs)
  [(_, _, body)] = check_triton(_export(fn, args + lay, "cuda"), ["gmm_fp8_gpu"])
  assert _dot_types(body) == [("f8E4M3FN", "f8E4M3FN")]
  assert re.search(r"tt\.dot .*: tensor<\d+x32xf8E4M3FN> \* tensor<32x\d+xf8E4M3FN>", body)

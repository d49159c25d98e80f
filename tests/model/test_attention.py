"""The attention entry point: every implementation against a float64 NumPy reference (forward and a
hand-derived backward), with causal masking, packed segments, padding rows, MLA's unequal head dims
and sequence lengths that do not divide the block; the kernels run in Pallas interpret mode here and
are lowered for their own platforms with jax.export.

Tolerances (float32 inputs of order 1, matmul precision "highest" from conftest): outputs 2e-5
absolute; gradients 2e-5 times the largest reference entry. The blockwise and dense float32 paths
agree with each other to the same bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from composer_jax.config import load_config
from composer_jax.model import attention as A

SCALE = 0.3


def numpy_attention(q, k, v, seg, g):
  """float64 forward and the backward of sum(o * g): (o, dq, dk, dv, per-head max logit)."""
  q, k, v, g = (np.asarray(a, np.float64) for a in (q, k, v, g))
  b, s = q.shape[:2]
  seg = np.ones((b, s), np.int32) if seg is None else np.asarray(seg)
  idx = np.arange(s)
  mask = ((idx[:, None] >= idx[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
          & (seg[:, :, None] != 0))[:, None]  # padding (id 0) attends to nothing: a zero output
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
  top = np.where(mask, logits, -np.inf).max(axis=(0, 2, 3))
  e = np.where(mask, np.exp(logits - np.where(mask, logits, -np.inf).max(-1, keepdims=True)), 0.0)
  p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  o = np.einsum("bhqk,bkhd->bqhd", p, v)
  dp = np.einsum("bqhd,bkhd->bhqk", g, v)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * SCALE
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * SCALE
  dv = np.einsum("bhqk,bqhd->bkhd", p, g)
  return o, dq, dk, dv, top


def make_inputs(b, s, h, dk, dv, packing, seed=0):
  r = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)
  seg = None
  if packing:
    seg = np.ones((b, s), np.int32)
    seg[0, s // 3:] = 2
    seg[0, s - s // 5:] = 0  # padding at the end: it attends to nothing
    seg[-1] = 1 + np.arange(s) // 7  # many short documents: most off-diagonal blocks are empty
    seg = jnp.asarray(seg)
  return f(b, s, h, dk), f(b, s, h, dk), f(b, s, h, dv), seg, f(b, s, h, dv)


def run(fn, q, k, v, g):
  """(o, dq, dk, dv) of ``fn(q, k, v) -> o`` through jax.vjp with cotangent g."""
  o, vjp = jax.vjp(fn, q, k, v)
  return (o,) + vjp(g)


def check(got, want):
  o, *grads = got
  np.testing.assert_allclose(np.asarray(o, np.float64), want[0], atol=2e-5, rtol=0)
  for a, b in zip(grads, want[1:4]):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=2e-5 * np.abs(b).max(), rtol=0)


# (batch, seq, heads, dk, dv, block, packed): blocks dividing s and not, one block, MLA-like dims
CASES = [(2, 64, 3, 12, 8, 16, True), (2, 100, 2, 24, 16, 32, True), (1, 40, 2, 8, 8, 64, True),
         (2, 100, 2, 24, 16, 32, False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}s{}h{}dk{}dv{}blk{}{}".format(
    *c[:6], "packed" if c[6] else "unpacked"))
def test_blockwise_and_dense_match_float64_reference(case):
  *shape, block, packing = case
  q, k, v, seg, g = make_inputs(*shape, packing)
  want = numpy_attention(q, k, v, seg, g)
  # dense: today's path, the float32 reference; blockwise with one plan for the batch and per row
  for impl, rows in (("blockwise", None), ("blockwise", 1), ("dense", None)):
    fn = lambda q, k, v, impl=impl, rows=rows: A.attention(q, k, v, seg, scale=SCALE, impl=impl,
                                                           block=block, rows=rows)[0]
    check(jax.jit(lambda *a, fn=fn: run(fn, *a))(q, k, v, g), want)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_blockwise_per_row_plans_on_right_padded_rows(rows):
  """An RL learner batch: one sequence a row, right-padded to the longest, and a row of padding
  only. Each group of ``rows`` rows visits only the block pairs its own rows need, and the result
  (zero at the padding) equals the float64 reference, gradients included."""
  b, s, h, dk, dv, block = 4, 96, 2, 12, 8, 16
  q, k, v, _, g = make_inputs(b, s, h, dk, dv, False, seed=3)
  lengths = [96, 20, 0, 57]
  seg = jnp.asarray((np.arange(s)[None] < np.asarray(lengths)[:, None]).astype(np.int32))
  fn = lambda q, k, v: A.attention(q, k, v, seg, scale=SCALE, impl="blockwise", block=block,
                                   rows=rows)[0]
  got = jax.jit(lambda *a: run(fn, *a))(q, k, v, g)
  check(got, numpy_attention(q, k, v, seg, g))
  assert not np.asarray(got[0])[2].any()  # the padding row's output
  sb = A._seg_blocks(seg, b, s, s // block, block)
  visited = [int(A._visit_plan(sb[:, i:i + rows], sb[:, i:i + rows], jnp.arange(s // block))[1].sum())
             for i in range(0, b, rows)]
  blocks = [-(-max(lengths[i:i + rows]) // block) for i in range(0, b, rows)]
  assert visited == [n * (n + 1) // 2 for n in blocks]  # the causal pairs of the group's longest


def test_max_logit_per_head_matches_dense():
  q, k, v, seg, _ = make_inputs(2, 100, 3, 12, 8, True)
  want = numpy_attention(q, k, v, seg, jnp.zeros_like(v))[4]
  for impl in ("blockwise", "dense"):
    top = jax.jit(lambda q, k, v, impl=impl: A.attention(
        q, k, v, seg, scale=SCALE, impl=impl, block=32, with_max_logit=True)[1])(q, k, v)
    np.testing.assert_allclose(np.asarray(top), want, atol=1e-5)
  top = jax.jit(lambda q, k: A.max_logit(q, k, seg, SCALE, block=16))(q, k)  # the kernels' pass
  np.testing.assert_allclose(np.asarray(top), want, atol=1e-5)


def test_blockwise_bfloat16_close_to_float32():
  """bf16 inputs: float32 scores and accumulators, so within bf16 rounding of the float32 result."""
  q, k, v, seg, _ = make_inputs(1, 64, 2, 24, 16, True)
  ref = A.attention(q, k, v, seg, scale=SCALE, impl="dense")[0]
  bf = lambda x: x.astype(jnp.bfloat16)
  o = A.attention(bf(q), bf(k), bf(v), seg, scale=SCALE, impl="blockwise", block=16)[0]
  assert o.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ref), atol=3e-2)


def test_blockwise_memory_is_linear_in_sequence():
  """XLA's buffer assignment for fwd+bwd: the blockwise temporaries grow ~linearly with s (x2.3 at
  most for 2x s), the dense path's quadratically; at s=2048 blockwise needs under 1/4 of dense."""
  def temp_bytes(impl, s):
    args = [jax.ShapeDtypeStruct((1, s, 2, 24), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((1, s, 2, 16), jnp.float32), jax.ShapeDtypeStruct((1, s), jnp.int32)]
    loss = lambda q, k, v, sg: A.attention(q, k, v, sg, scale=SCALE, impl=impl, block=256)[0].sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  blk1, blk2 = temp_bytes("blockwise", 1024), temp_bytes("blockwise", 2048)
  assert blk2 < 2.3 * blk1, (blk1, blk2)
  assert blk2 < temp_bytes("dense", 2048) / 4


# --------------------------------------------------------------------------------------------------
# Kernels: numerics in Pallas interpret mode, lowering for their platform
# --------------------------------------------------------------------------------------------------

KERNELS = {
    "splash": lambda q, k, v, seg: A.splash(q, k, v, seg, SCALE, block=128, interpret=True),
    "pallas_gpu": lambda q, k, v, seg: A.pallas_gpu(q, k, v, seg, SCALE, block=128, interpret=True),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_float64_reference_in_interpret_mode(name):
  """Two 128-row blocks, packed with padding, MLA's dk != dv (v padded for the GPU kernel)."""
  q, k, v, seg, g = make_inputs(1, 256, 2, 24, 16, True)
  fn = lambda q, k, v: KERNELS[name](q, k, v, seg)
  check(run(fn, q, k, v, g), numpy_attention(q, k, v, seg, g))


def test_kernel_runs_per_shard_on_a_mesh(monkeypatch):
  """On a data x tensor mesh the kernel runs inside shard_map per (batch, head) shard; loss and
  gradients equal the dense path's on one device."""
  import functools

  from composer_jax.config import MeshConfig
  from composer_jax.parallel.mesh import build_mesh
  from composer_jax.parallel.rules import activate, make_rules
  monkeypatch.setattr(A, "splash", functools.partial(A.splash, interpret=True))
  q, k, v, seg, _ = make_inputs(4, 256, 2, 24, 16, True)
  loss = lambda impl: lambda q, k, v: (A.attention(q, k, v, seg, scale=SCALE, impl=impl,
                                                   block=128)[0] ** 2).sum()
  want = jax.value_and_grad(loss("dense"), argnums=(0, 1, 2))(q, k, v)
  with activate(build_mesh(MeshConfig(data=4, tensor=2)), make_rules()):
    got = jax.jit(jax.value_and_grad(loss("splash"), argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
  for a, b in zip(got[1], want[1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * float(jnp.abs(b).max()))


def _exported(impl, platform, disabled=()):
  """value_and_grad of the K2-shaped attention (qk 192, v 128) exported for ``platform``."""
  from tests.kernels.test_lowering import TRITON_CALL
  s_ = jax.ShapeDtypeStruct
  b, s, h = 2, 512, 2
  args = (s_((b, s, h, 192), jnp.bfloat16), s_((b, s, h, 192), jnp.bfloat16),
          s_((b, s, h, 128), jnp.bfloat16), s_((b, s), jnp.int32))

  def loss(q, k, v, seg):
    o, _ = A.attention(q, k, v, None if impl == "cudnn" else seg, scale=SCALE, impl=impl, block=256)
    return jnp.sum(o.astype(jnp.float32) ** 2)

  checks = [export.DisabledSafetyCheck.custom_call(t) for t in (TRITON_CALL,) + tuple(disabled)]
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return export.export(fn, platforms=(platform,), disabled_checks=checks)(*args)


def test_splash_lowers_for_tpu():
  from tests.kernels.test_lowering import check_mosaic
  check_mosaic(_exported("splash", "tpu"), ["splash_mha_fwd_segmented_residuals",
                                            "splash_mha_dkv_segmented_no_residuals",
                                            "splash_mha_dq_segmented_no_residuals"])


def test_pallas_gpu_lowers_for_cuda():
  from tests.kernels.test_lowering import check_triton
  check_triton(_exported("pallas_gpu", "cuda"),
               ["mha_forward", "mha_backward", "mha_preprocess_backward"])


def test_cudnn_lowers_for_cuda(monkeypatch):
  """jax.nn's cuDNN path asks the local GPU for its cuDNN version and compute capability while
  tracing; they are patched to what an H100 with cuDNN 9.10 reports (head dim 192 needs sm90)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  from tests.kernels.test_lowering import kernels
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda c: True)
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: False)
  calls = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
  got = sorted(t for t, _, _ in kernels(_exported("cudnn", "cuda", calls)))
  assert got == sorted(calls)


# --------------------------------------------------------------------------------------------------
# Selection and the model
# --------------------------------------------------------------------------------------------------


def test_selection_by_backend_and_shape():
  assert A.resolve_impl("auto", 1024, "tpu") == "splash"
  assert A.resolve_impl("auto", 1000, "tpu") == "blockwise"  # splash needs s % 128 == 0
  assert A.resolve_impl("auto", 1024, "gpu") == "pallas_gpu"
  assert A.resolve_impl("auto", 1024, "gpu", packed=False) == "cudnn"  # no segment ids: cuDNN
  assert A.resolve_impl("auto", 1024, "gpu", packed=False, head_dim=320) == "pallas_gpu"
  # float32 on GPU: cuDNN refuses it and Triton's dots would be TF32, so the XLA path
  assert A.resolve_impl("auto", 1024, "gpu", packed=False, dtype=jnp.float32) == "blockwise"
  assert A.resolve_impl("auto", 1024, "gpu", dtype=jnp.float32) == "blockwise"
  assert A.resolve_impl("auto", 1024, "gpu", dtype=jnp.float16) == "pallas_gpu"
  assert A.resolve_impl("auto", 1024, "cpu") == "blockwise"
  assert A.resolve_impl("dense", 1024, "tpu") == "dense"
  with pytest.raises(ValueError, match="model.attention_impl"):
    A.resolve_impl("flash", 64)
  q, k, v, seg, _ = make_inputs(1, 100, 1, 8, 8, True)
  with pytest.raises(ValueError, match="multiple of 128"):
    A.attention(q, k, v, seg, scale=SCALE, impl="splash")
  with pytest.raises(ValueError, match="segment ids"):
    A.attention(q, k, v, seg, scale=SCALE, impl="cudnn")
  with pytest.raises(ValueError, match="model.compute_dtype=bfloat16"):
    A.attention(q, k, v, None, scale=SCALE, impl="cudnn")  # float32 inputs


def test_model_blockwise_matches_dense():
  """The tiny model on packed rows with padding: loss, gradients and QK-clip's per-head max logits
  agree between attention_impl=dense and blockwise (a block smaller than the sequence)."""
  from flax import nnx

  from composer_jax.model import build_model, lm_loss
  from composer_jax.train.step import pop_max_logits
  b, s = 2, 48
  seg = np.where(np.arange(s)[None] < np.array([[20], [30]]), 1, 2).astype(np.int32)
  seg[0, -6:] = 0
  pos = np.where(seg == 1, np.arange(s), np.arange(s) - np.array([[20], [30]])).astype(np.int32)
  tokens = np.random.default_rng(0).integers(1, 256, (b, s)).astype(np.int32)
  out = {}
  for impl in ("dense", "blockwise"):
    cfg = load_config("configs/tiny.yaml", [f"model.attention_impl={impl}", "model.attention_block=16",
                                            "model.vocab_size=256", "model.n_layers=1",
                                            "model.mtp_depths=0"])
    model = build_model(cfg)
    model.set_attributes(record_max_logit=True, raise_if_not_found=False)

    def loss_fn(m, cfg=cfg):
      o = m(jnp.asarray(tokens), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
      return lm_loss(o, jnp.asarray(tokens), None, cfg.model)[0], pop_max_logits(m)

    (loss, top), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model)
    out[impl] = (loss, top, grads)
  (l0, t0, g0), (l1, t1, g1) = out["dense"], out["blockwise"]
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(t1), np.asarray(t0), rtol=1e-5)
  for a, b_ in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(b_), np.asarray(a), atol=1e-6 + 1e-5 * float(np.abs(a).max()))

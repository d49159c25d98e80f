"""Activation memory of one training step, per device, by arithmetic: no devices, no compile.

``step_memory(cfg, sizes, seq, batch)`` is a pure function of the config, the mesh axis sizes, the
sequence length and the micro-batch. It lists what the code in ``composer_jax/model`` and
``composer_jax/parallel`` allocates per layer and how those buffers overlap in time;
``train/plan.py`` adds parameters, optimizer state and gradients (``composer-jax params CONFIG
--sharding --seq-len N``). tests/train/test_memory.py checks it by hand and against XLA.

Symbols (per device; the rule table is ``mesh.rules`` over ``parallel/rules.py``; a mesh axis that
does not divide a dim leaves it whole, as ``spec_for(strict=False)`` does):

  b    ``batch``: sequences per shard of act_batch (data x fsdp x expert by default)
  cp   shards of act_seq (context);  L = seq / cp;  T = b L, the tokens of a [b, s/cp, d] activation
  Skv  keys a device expands: b seq under context parallelism (parallel/context.py all-gathers the
       latent and expands K/V for every key), T without
  H    n_heads over act_heads;  Fd, Fs = dense_ffn_dim, moe_ffn_dim n_shared over act_mlp;  V = vocab
       over act_vocab
  d, ql, r, e, dn, dv, dq   d_model, q_lora_rank, kv_lora_rank, qk_rope, qk_nope, v_head, dn + e
  ep   shards of the experts' ``exp`` dim;  R = T k (token, slot) rows
  Rx   rows the expert FFN holds: ep R (all_to_all's receive buffer is sized for every row of every
       rank, all_gather gathers them all); R without an expert axis
  f    moe_ffn_dim over the exp_mlp axes that do not shard tokens (tensor parallelism inside experts)
  P    Rx + (E/ep) bm: the grouped-matmul block layout, each local expert adding at most one partial
       block of bm rows (``block_rows``: 128 for the GPU/TPU kernels, 16 for CPU's sorted path)
  c    bytes of model.compute_dtype (4 = float32)

One layer's residuals (what its backward reads; ``_attention``, ``_moe``, ``_mlp``):

  attention  c [2Td (norm in, out) + 2T ql (q_a, q_norm) + T H (dq + e) (q_b, roped q_pe)
               + T (2r + 2e) (kv_a, latent, roped k_pe) + Skv (r + e) (gathered latent, CP only)
               + Skv H (dn + dv) (K/V expanded) + 2 [T H dq + Skv H (dq + dv)] (q, k = [nope|rope],
               v and their block copies) + 2 T H dv (o) + T d (o_proj)] + 4 * 2 b H L (lse, max)
  MoE        c 2Td (norm) + 4 T (d + 2E) (router input, logits, scores: float32)
             + c [2 R d + 2 Rx d] (rows sorted by destination and back; received and sorted: EP only)
             + c P d (block layout) + 4 * 2 P f (gate, up: float32 out of the grouped matmul)
             + c P f (silu(gate) up) + 4 P d (down) + 2 c Rx d (outputs, in pair order) + c T d
             + c T (3 Fs + d) (shared expert)
  dense MLP  c 2Td (norm) + c T (3 Fd + d)

Backward transients of one layer (the larger of the attention's and the MLP's):

  attention  4 [T H dq + Skv H (dq + dv)] (blockwise dq, dk, dv in float32)
             + c Skv H (dq + dv + dn + dv) (their casts, d(K/V expanded)) + c Skv (r + e) (CP only)
  MoE        4 P (3 f + d) (d(down), d(gate), d(up), d(rows)) + 2 c Rx d (the reverse exchange)
  dense MLP  3 c T Fd

Weights: one layer's parameters all-gathered over the axes that shard tokens (FSDP; tensor and
expert shards stay), in c, their gradient before the reduce-scatter, in c, and one float32 copy of
the largest: (2c) W + 4 max(w).

Saved for the backward, per layer, by ``model.remat``:

  none           every residual
  full           the layer input, c T d
  dots, dots_no_batch
                 c T d + c T (ql + H dq + r + e + d) (q_a, q_b, kv_a, o_proj outputs)
                 + c Skv H (dn + dv) (the K/V expansion: at 256K under CP, the keys of the whole
                 sequence, per layer) + 4 T E (router logits) + c T (2F + d) (MLP or shared expert).
                 Attention scores run inside loops / a custom VJP and are not saved; nor are the
                 GPU/TPU grouped-matmul kernels (CPU's sorted path is made of dots and is saved).
  moe_only       dense layers as none, MoE layers as full
  MTP depths run without remat: residuals + c 2Td (the [emb | h] concat) each.

Loss (model/loss.py, not chunked): c (1 + mtp) T V (every head's logits, held until the loss)
  + (4 + 4 + c) T V (one head at a time: float32 copy, float32 gradient, its cast) + c T d (final
  norm) + (c + 4) d V (the head gathered, its gradient).

Inputs: T (16 + 4e) (token ids, segment ids, positions, loss mask; cos and sin in float32).

Peak of the step:

  activations = inputs + n_layers saved + MTP + max(loss, max over layer kinds of
                (residuals unless saved whole) + backward + weights)

Gradients (``gradient_bytes``): the parameter bytes per device (a gradient is sharded like its
parameter), plus a float32 sum under ``train.grad_accum > 1``. The optimizer update
(``update_bytes``) runs after the backward, once the activations are gone: 4 float32 copies of the
largest parameter shard (float32 gradient, new moment, Newton-Schulz iterate, update).

Not counted: int32 bookkeeping (a few per token), collective staging buffers, fusion-dependent copies
and alignment, and the quantized copies of ``model.gmm_precision`` (fp8 rows: half the bf16 rows
counted). Validation (float32, tests/train/test_memory.py): XLA:CPU's temp bytes of the compiled
forward + backward over the estimate, 0.9-1.3 on one device and on expert x context meshes; the
remat terms also against the residuals JAX saves (full 0.86, dots_no_batch 1.01). A Python loop of
remat'd blocks shows no savings on XLA:CPU, whose scheduler runs each recomputation early (8 layers:
temp 333 MB full vs 347 MB none); scanned layers (``model.scan_layers``) keep it in the backward
loop (87 MB vs 298 MB, estimate 79 MB).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from composer_jax.config import Config, ConfigError
from composer_jax.parallel.rules import make_rules

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "moe_only")


@dataclass(frozen=True)
class Dims:
  """Per-device sizes (see the module docstring for each symbol)."""
  b: int
  seq: int
  cp: int
  L: int
  T: int
  Skv: int
  H: int
  Fd: int
  Fs: int
  V: int
  ep: int
  R: int
  Rx: int
  f: int
  P: int
  c: int


def _shards(axes, sizes: dict, dim: int | None = None) -> int:
  """Product of the mesh axes (size > 1) sharding a dim of size ``dim`` (non-dividing ones dropped)."""
  n = 1
  for a in axes:
    s = sizes.get(a, 1)
    if s > 1 and (dim is None or dim % (n * s) == 0):
      n *= s
  return n


def dims(cfg: Config, sizes: dict, seq: int, batch: int, block_rows: int = 128) -> Dims:
  m, rules = cfg.model, make_rules(cfg.mesh.rules)
  cp = _shards(rules["act_seq"], sizes, seq)
  T = batch * (seq // cp)
  ep = _shards(rules["exp"], sizes, m.n_routed_experts)
  tok = set(rules["act_batch"]) | set(rules["act_seq"]) | set(rules["exp"] if ep > 1 else ())
  # inside the EP shard_map the FFN dim stays split over exp_mlp axes that do not shard tokens;
  # without EP, XLA partitions the grouped matmul like any exp_mlp-sharded product
  f_axes = [a for a in rules["exp_mlp"] if a not in tok] if ep > 1 else rules["exp_mlp"]
  mlp = lambda n: n // _shards(rules["act_mlp"], sizes, n)
  R = T * m.n_experts_per_tok
  Rx = ep * R
  return Dims(b=batch, seq=seq, cp=cp, L=seq // cp, T=T, Skv=batch * seq if cp > 1 else T,
              H=m.n_heads // _shards(rules["act_heads"], sizes, m.n_heads),
              Fd=mlp(m.dense_ffn_dim), Fs=mlp(m.moe_ffn_dim * m.n_shared_experts),
              V=m.vocab_size // _shards(rules["act_vocab"], sizes, m.vocab_size), ep=ep, R=R, Rx=Rx,
              f=m.moe_ffn_dim // _shards(f_axes, sizes, m.moe_ffn_dim),
              P=Rx + (m.n_routed_experts // ep) * block_rows, c=np.dtype(m.compute_dtype).itemsize)


# --------------------------------------------------------------------------------------------------
# One layer: (name, bytes) lists, in the order of the module docstring
# --------------------------------------------------------------------------------------------------


def _attention(cfg: Config, D: Dims) -> tuple[list, list, list]:
  """(residuals, backward transients, what a dots policy saves) of one MLA layer."""
  m, c, T, S, H = cfg.model, D.c, D.T, D.Skv, D.H
  d, ql, r, e = m.d_model, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_dim
  dn, dv, dq = m.qk_nope_dim, m.v_head_dim, m.qk_head_dim
  cp = D.cp > 1
  res = [("attn_norm in, out", c * 2 * T * d), ("q_a, q_norm", c * 2 * T * ql),
         ("q_b out, roped q_pe", c * T * H * (dq + e)),
         ("kv_a out, latent, roped k_pe", c * T * (2 * r + 2 * e)),
         ("latent gathered over context", c * S * (r + e) if cp else 0),
         ("K/V expanded [Skv, H, dn+dv]", c * S * H * (dn + dv)),
         ("q, k = [nope | rope], v, block copies", c * 2 * (T * H * dq + S * H * (dq + dv))),
         ("o (blocks, natural order)", c * 2 * T * H * dv), ("o_proj out", c * T * d),
         ("lse, row max (f32)", 4 * 2 * D.b * H * D.L)]
  bwd = [("dq, dk, dv (f32)", 4 * (T * H * dq + S * H * (dq + dv))),
         ("dk, dv cast, d(K/V expanded)", c * S * H * (dq + dv + dn + dv)),
         ("d(latent gathered)", c * S * (r + e) if cp else 0)]
  dots = [("q_a, q_b, kv_a, o_proj outs", c * T * (ql + H * dq + r + e + d)),
          ("K/V expansion", c * S * H * (dn + dv))]
  return res, bwd, dots


def _moe(cfg: Config, D: Dims) -> tuple[list, list, list]:
  m, c, T = cfg.model, D.c, D.T
  d, E = m.d_model, m.n_routed_experts
  ep = D.ep > 1
  res = [("mlp_norm in, out", c * 2 * T * d),
         ("router input, logits, scores (f32)", 4 * T * (d + 2 * E)),
         ("EP: rows sorted by destination, back", c * 2 * D.R * d if ep else 0),
         ("EP: rows received, sorted", c * 2 * D.Rx * d if ep else 0),
         ("block layout rows [P, d]", c * D.P * d), ("gate, up (f32)", 4 * 2 * D.P * D.f),
         ("silu(gate) up", c * D.P * D.f), ("down (f32)", 4 * D.P * d),
         ("expert outputs, in pair order", c * 2 * D.Rx * d), ("combined", c * T * d),
         ("shared expert", c * T * (3 * D.Fs + d))]
  bwd = [("d(down), d(gate), d(up), d(rows) (f32)", 4 * D.P * (3 * D.f + d)),
         ("reverse exchange", c * 2 * D.Rx * d)]
  dots = [("router logits (f32)", 4 * T * E), ("shared expert", c * T * (2 * D.Fs + d))]
  return res, bwd, dots


def _mlp(cfg: Config, D: Dims) -> tuple[list, list, list]:
  c, T, d = D.c, D.T, cfg.model.d_model
  return ([("mlp_norm in, out", c * 2 * T * d), ("gate, up, h, down", c * T * (3 * D.Fd + d))],
          [("d(gate), d(up), d(h)", c * 3 * T * D.Fd)], [("MLP", c * T * (2 * D.Fd + d))])


def layer_param_shapes(cfg: Config, moe: bool) -> list[tuple[str, tuple, tuple, str]]:
  """(name, shape, logical axes, dtype) of one block's parameters as model/mla.py, moe.py and
  layers.py create them (a test compares this with eval_shape)."""
  m = cfg.model
  d, h, ql, r, e, pd = m.d_model, m.n_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_dim, m.param_dtype
  out = [("attn_norm", (d,), ("norm",), pd), ("mlp_norm", (d,), ("norm",), pd),
         ("kv_a", (d, r + e), ("embed", "kv_lora"), pd), ("kv_norm", (r,), ("norm",), pd),
         ("kv_b", (r, h, m.qk_nope_dim + m.v_head_dim), ("kv_lora_up", "heads", "head_dim"), pd),
         ("o_proj", (h * m.v_head_dim, d), ("heads", "embed"), pd)]
  if ql:
    out += [("q_a", (d, ql), ("embed", "q_lora"), pd), ("q_norm", (ql,), ("norm",), pd),
            ("q_b", (ql, h, m.qk_head_dim), ("q_lora_up", "heads", "head_dim"), pd)]
  else:
    out.append(("q_proj", (d, h, m.qk_head_dim), ("embed", "heads", "head_dim"), pd))

  def mlp(pre, n):
    return [(pre + "gate", (d, n), ("embed", "mlp"), pd), (pre + "up", (d, n), ("embed", "mlp"), pd),
            (pre + "down", (n, d), ("mlp", "embed"), pd)]

  if not moe:
    return out + mlp("", m.dense_ffn_dim)
  E, f = m.n_routed_experts, m.moe_ffn_dim
  out += [("router", (d, E), ("embed", None), "float32"),
          ("w_gate", (E, d, f), ("exp", "exp_embed", "exp_mlp"), pd),
          ("w_up", (E, d, f), ("exp", "exp_embed", "exp_mlp"), pd),
          ("w_down", (E, f, d), ("exp", "exp_mlp", "exp_embed"), pd)]
  return out + (mlp("shared.", f * m.n_shared_experts) if m.n_shared_experts else [])


def gathered_elems(cfg: Config, sizes: dict, shape: tuple, axes: tuple) -> int:
  """Elements of a parameter on one device while a layer computes with it: dims on mesh axes that
  also shard tokens (FSDP) are all-gathered; tensor shards and the experts' own shards stay."""
  rules = make_rules(cfg.mesh.rules)
  tok = set(rules["act_batch"]) | set(rules["act_seq"])
  n = 1
  for dim, ax in zip(shape, axes):
    targets = () if ax is None else rules[ax]
    keep = targets if ax == "exp" else [a for a in targets if a not in tok]
    n *= dim // _shards(keep, sizes, dim)
  return n


def _total(items: list) -> int:
  return int(sum(b for _, b in items))


def check_shape(cfg: Config, sizes: dict, seq: int, batch: int) -> None:
  """One-line errors for a step that could not run, before anything is traced."""
  if batch < 1:
    raise ConfigError(f"--batch={batch} must be >= 1 (sequences per batch shard per micro-step)")
  if seq < 1:
    raise ConfigError(f"--seq-len={seq} must be positive")
  cp = _shards(make_rules(cfg.mesh.rules)["act_seq"], sizes)
  if cp > 1 and seq % (2 * cp):
    raise ConfigError(f"--seq-len={seq} must be divisible by 2*mesh.context={2 * cp} (zigzag "
                      "context parallelism cuts each sequence into 2*context half-chunks)")
  if seq > cfg.model.max_seq_len:
    raise ConfigError(f"--seq-len={seq} exceeds model.max_seq_len={cfg.model.max_seq_len}: raise "
                      "model.max_seq_len (and model.yarn_factor) for the long-context stage")


def step_memory(cfg: Config, sizes: dict, seq: int, batch: int, block_rows: int = 128) -> dict:
  """Activation bytes per device of one training step (forward and backward), formulas in the
  module docstring. ``sizes``: mesh axis -> size. Returns {"activations": peak bytes, "terms":
  {name: bytes} (they add up to the peak), "kinds": per layer kind {residuals, backward, weights,
  saved, items}, "dims": Dims}."""
  check_shape(cfg, sizes, seq, batch)
  m = cfg.model
  D = dims(cfg, sizes, seq, batch, block_rows)
  c, T, d = D.c, D.T, m.d_model
  a_res, a_bwd, a_dots = _attention(cfg, D)
  kinds = {}
  for kind, n, (f_res, f_bwd, f_dots) in (("dense", m.n_dense_layers, _mlp(cfg, D)),
                                          ("moe", m.n_moe_layers, _moe(cfg, D))):
    if n == 0:
      continue
    params = [gathered_elems(cfg, sizes, s, a) for _, s, a, _ in layer_param_shapes(cfg, kind == "moe")]
    res = _total(a_res + f_res)
    if m.remat == "none" or (m.remat == "moe_only" and kind == "dense"):
      saved = res
    elif m.remat in ("full", "moe_only"):
      saved = c * T * d
    else:
      saved = c * T * d + _total(a_dots + f_dots)
    kinds[kind] = {"n": n, "residuals": res, "backward": max(_total(a_bwd), _total(f_bwd)),
                   "weights": 2 * c * sum(params) + 4 * max(params), "saved": saved,
                   "items": a_res + f_res + a_bwd + f_bwd}
  mtp_kind = kinds["moe" if m.n_moe_layers else "dense"]
  loss = (c * (1 + m.mtp_depths) * T * D.V + (8 + c) * T * D.V + c * T * d
          + (c + 4) * gathered_elems(cfg, sizes, (d, m.vocab_size), ("embed", "vocab")))
  layer = max((0 if k["saved"] == k["residuals"] else k["residuals"]) + k["backward"] + k["weights"]
              for k in kinds.values())
  terms = {"inputs (ids, masks, cos/sin)": T * (16 + 4 * m.qk_rope_dim),
           "saved for the backward (all layers)": sum(k["n"] * k["saved"] for k in kinds.values()),
           "MTP depths (no remat)": m.mtp_depths * (mtp_kind["residuals"] + c * 2 * T * d),
           "loss or one layer's recompute + backward + weights": max(loss, layer)}
  return {"activations": int(sum(terms.values())), "terms": terms, "kinds": kinds, "dims": D,
          "loss": loss, "layer": layer}


def gradient_bytes(param_elems: int, param_bytes: int, grad_accum: int) -> int:
  """Gradient buffers: sharded like the parameters, in their dtype; a float32 sum under
  accumulation (train/step.py) on top."""
  return param_bytes + (4 * param_elems if grad_accum > 1 else 0)


def update_bytes(largest_param_elems: int) -> int:
  """The optimizer update's working set: 4 float32 copies of the largest parameter shard."""
  return 4 * 4 * largest_param_elems


__all__ = ["Dims", "dims", "gathered_elems", "gradient_bytes", "layer_param_shapes", "step_memory",
           "update_bytes"]

"""An independent float64 NumPy reference of the model, written from the papers / HF DeepseekV3.

Deliberately different in form from composer_jax.model: loops over tokens and experts, RoPE in
HF's de-interleave + rotate_half form, explicit per-head attention, Python sorting for top-k.
"""

from __future__ import annotations

import math

import numpy as np


def rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x):
  return x / (1.0 + np.exp(-x))


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
  x = x - x.max(axis=axis, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis=axis, keepdims=True)


def _mscale(scale, m=1.0):
  return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_inv_freq(cfg):
  """DeepSeek-V3's yarn: find the correction range, blend interpolated and extrapolated freqs."""
  dim, base = cfg.qk_rope_dim, cfg.rope_theta
  freq_extra = 1.0 / (base ** (np.arange(0, dim, 2) / dim))
  if cfg.yarn_factor <= 1:
    return freq_extra, 1.0
  freq_inter = 1.0 / (cfg.yarn_factor * base ** (np.arange(0, dim, 2) / dim))
  orig = cfg.yarn_original_max_position
  find = lambda r: (dim * math.log(orig / (r * 2 * math.pi))) / (2 * math.log(base))
  low = max(math.floor(find(cfg.yarn_beta_fast)), 0)
  high = min(math.ceil(find(cfg.yarn_beta_slow)), dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
  mask = 1.0 - ramp
  inv = freq_inter * (1 - mask) + freq_extra * mask
  if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
    f = _mscale(cfg.yarn_factor, cfg.yarn_mscale) / _mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim)
  else:
    f = _mscale(cfg.yarn_factor)
  return inv, f


def rope(x, pos, cfg):
  """HF form: de-interleave the pairs, then x*cos + rotate_half(x)*sin over [b,s,(h),d]."""
  inv, f = yarn_inv_freq(cfg)
  ang = pos[..., None] * inv  # [b,s,d/2]
  emb = np.concatenate([ang, ang], -1)
  cos, sin = np.cos(emb) * f, np.sin(emb) * f
  if x.ndim == 4:
    cos, sin = cos[:, :, None], sin[:, :, None]
  d = x.shape[-1]
  x = x.reshape(*x.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(x.shape)
  rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
  return x * cos + rot * sin


def mla(p, x, pos, seg, cfg):
  b, s, _ = x.shape
  h = cfg.n_heads
  if cfg.q_lora_rank:
    q = np.einsum("bsr,rhd->bshd", rms(x @ p["q_a"]["w"], p["q_norm"]["scale"], cfg.rms_eps), p["q_b"]["w"])
  else:
    q = np.einsum("bsi,ihd->bshd", x, p["q_proj"]["w"])
  kv = x @ p["kv_a"]["w"]
  c = rms(kv[..., : cfg.kv_lora_rank], p["kv_norm"]["scale"], cfg.rms_eps)
  k_pe = rope(kv[..., cfg.kv_lora_rank:], pos, cfg)
  kvb = np.einsum("bsr,rhd->bshd", c, p["kv_b"]["w"])
  k_nope, v = kvb[..., : cfg.qk_nope_dim], kvb[..., cfg.qk_nope_dim:]
  q_nope, q_pe = q[..., : cfg.qk_nope_dim], rope(q[..., cfg.qk_nope_dim:], pos, cfg)
  scale = cfg.qk_head_dim ** -0.5
  if cfg.yarn_factor > 1 and cfg.yarn_mscale_all_dim:
    scale *= _mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
  out = np.zeros((b, s, h, cfg.v_head_dim))
  for bi in range(b):
    for hi in range(h):
      k_full = np.concatenate([k_nope[bi, :, hi], k_pe[bi]], -1)
      q_full = np.concatenate([q_nope[bi, :, hi], q_pe[bi, :, hi]], -1)
      sc = q_full @ k_full.T * scale
      allowed = np.tril(np.ones((s, s), bool))
      if seg is not None:  # padding (id 0) attends to nothing: a zero output
        allowed &= (seg[bi][:, None] == seg[bi][None, :]) & (seg[bi][:, None] != 0)
      sc = np.where(allowed, sc, -np.inf)
      pr = np.where(allowed.any(-1, keepdims=True), softmax(np.where(allowed.any(-1, keepdims=True), sc, 0)), 0)
      pr = np.where(allowed, pr, 0)
      out[bi, :, hi] = pr @ v[bi, :, hi]
  return out.reshape(b, s, -1) @ p["o_proj"]["w"]


def mlp(p, x):
  return (silu(x @ p["gate"]["w"]) * (x @ p["up"]["w"])) @ p["down"]["w"]


def route_token(logit, bias, cfg):
  """One token: ids (sorted by choice score, descending) and combine weights."""
  if cfg.scoring == "sigmoid":
    score = sigmoid(logit)
  else:
    score = softmax(logit)
  choice = score + bias if cfg.selection_bias else score.copy()
  e = len(score)
  if cfg.n_group > 1:
    per = e // cfg.n_group
    groups = choice.reshape(cfg.n_group, per)
    if cfg.scoring == "sigmoid":
      gs = np.array([sum(sorted(g)[-2:]) for g in groups])
    else:
      gs = groups.max(-1)
    keep = sorted(range(cfg.n_group), key=lambda i: -gs[i])[: cfg.topk_group]
    allowed = np.zeros(e, bool)
    for gi in keep:
      allowed[gi * per:(gi + 1) * per] = True
    choice = np.where(allowed, choice, -np.inf)
  ids = sorted(range(e), key=lambda i: -choice[i])[: cfg.n_experts_per_tok]
  w = score[ids]
  if cfg.norm_topk_prob and cfg.n_experts_per_tok > 1:
    w = w / (w.sum() + 1e-20)
  return np.array(ids), w * cfg.routed_scaling_factor


def moe(p, x, cfg):
  b, s, d = x.shape
  xt = x.reshape(-1, d)
  out = np.zeros_like(xt)
  ids_all = []
  for t in range(xt.shape[0]):
    ids, w = route_token(xt[t] @ p["router"], p["router_bias"], cfg)
    ids_all.append(ids)
    for e, we in zip(ids, w):
      hdn = silu(xt[t] @ p["w_gate"][e]) * (xt[t] @ p["w_up"][e])
      out[t] += we * (hdn @ p["w_down"][e])
  out = out.reshape(b, s, d)
  if cfg.n_shared_experts:
    out = out + mlp(p["shared"], x)
  return out, np.array(ids_all)


def block(p, x, pos, seg, cfg, is_moe):
  h = x + mla(p["attn"], rms(x, p["attn_norm"]["scale"], cfg.rms_eps), pos, seg, cfg)
  y = rms(h, p["mlp_norm"]["scale"], cfg.rms_eps)
  m = moe(p["mlp"], y, cfg)[0] if is_moe else mlp(p["mlp"], y)
  return h + m


def forward(params, tokens, cfg, seg=None):
  """Returns (logits, [mtp logits per depth])."""
  b, s = tokens.shape
  pos = np.broadcast_to(np.arange(s, dtype=np.float64), (b, s))
  x = params["embed"][tokens]
  for i in range(cfg.n_layers):
    x = block(params["layers"][i], x, pos, seg, cfg, i >= cfg.n_dense_layers)
  head = params["embed"].T if cfg.tie_embeddings else params["head"]
  logits = rms(x, params["norm"]["scale"], cfg.rms_eps) @ head
  mtp, h = [], x
  for k in range(cfg.mtp_depths):
    p = params["mtp"][k]
    ahead = np.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1)))
    cat = np.concatenate([rms(params["embed"][ahead], p["enorm"]["scale"], cfg.rms_eps),
                          rms(h, p["hnorm"]["scale"], cfg.rms_eps)], -1)
    h = block(p["block"], cat @ p["proj"]["w"], pos, seg, cfg, cfg.n_moe_layers > 0)
    mtp.append(rms(h, p["norm"]["scale"], cfg.rms_eps) @ head)
  return logits, mtp

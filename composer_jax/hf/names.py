"""Which HF tensors make up each of our parameters, and how their layouts differ.

Three kinds of leaf:
- ``copy``: same array (norm scales, embedding, router bias).
- ``linear``: our ``w[in, *out]`` is HF's ``weight[prod(out), in]`` transposed (out flattened
  head-major, as HF's ``view(..., heads, head_dim)`` reads it).
- ``experts``: our stacked ``w[E, in, out]`` is ``mlp.experts.{e}.{proj}.weight[out, in]`` for each
  expert (the released per-expert layout), or, when transformers wrote its in-memory fused layout,
  ``mlp.experts.gate_up_proj[E, 2*f, d]`` (gate rows first) / ``mlp.experts.down_proj[E, d, f]``.

A stacked parameter of ``model.scan_layers`` (``moe_layers/...``, a leading layer axis) is the
stack of the per-layer parameters ``layers/{n_dense + j}/...``: ``layer_maps`` gives one LeafMap per
layer, so the HF side never sees the difference.

MTP depth k (0-based) is stored as DeepSeek-V3 does, as an extra decoder layer
``model.layers.{n_layers + k}`` with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and
copies of the shared embedding and head (written on save, ignored on load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from composer_jax.config import ModelConfig
from composer_jax.model.scan import layer_paths

# Our path inside a block -> (HF suffix inside model.layers.N, kind).
BLOCK = {
    ("attn_norm", "scale"): ("input_layernorm.weight", "copy"),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", "copy"),
    ("attn", "q_a", "w"): ("self_attn.q_a_proj.weight", "linear"),
    ("attn", "q_norm", "scale"): ("self_attn.q_a_layernorm.weight", "copy"),
    ("attn", "q_b", "w"): ("self_attn.q_b_proj.weight", "linear"),
    ("attn", "q_proj", "w"): ("self_attn.q_proj.weight", "linear"),
    ("attn", "kv_a", "w"): ("self_attn.kv_a_proj_with_mqa.weight", "linear"),
    ("attn", "kv_norm", "scale"): ("self_attn.kv_a_layernorm.weight", "copy"),
    ("attn", "kv_b", "w"): ("self_attn.kv_b_proj.weight", "linear"),
    ("attn", "o_proj", "w"): ("self_attn.o_proj.weight", "linear"),
    ("mlp", "gate", "w"): ("mlp.gate_proj.weight", "linear"),
    ("mlp", "up", "w"): ("mlp.up_proj.weight", "linear"),
    ("mlp", "down", "w"): ("mlp.down_proj.weight", "linear"),
    ("mlp", "router"): ("mlp.gate.weight", "linear"),
    ("mlp", "router_bias"): ("mlp.gate.e_score_correction_bias", "copy"),
    ("mlp", "shared", "gate", "w"): ("mlp.shared_experts.gate_proj.weight", "linear"),
    ("mlp", "shared", "up", "w"): ("mlp.shared_experts.up_proj.weight", "linear"),
    ("mlp", "shared", "down", "w"): ("mlp.shared_experts.down_proj.weight", "linear"),
    ("mlp", "w_gate"): ("gate_proj", "experts"),
    ("mlp", "w_up"): ("up_proj", "experts"),
    ("mlp", "w_down"): ("down_proj", "experts"),
}
MTP = {
    ("enorm", "scale"): ("enorm.weight", "copy"),
    ("hnorm", "scale"): ("hnorm.weight", "copy"),
    ("proj", "w"): ("eh_proj.weight", "linear"),
    ("norm", "scale"): ("shared_head.norm.weight", "copy"),
}
TOP = {
    ("embed",): ("model.embed_tokens.weight", "copy"),
    ("head",): ("lm_head.weight", "linear"),
    ("norm", "scale"): ("model.norm.weight", "copy"),
}
# Tensors a checkpoint may hold that no parameter of ours reads.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LeafMap:
  """How one of our parameters is read from / written to HF tensors."""
  path: tuple
  name: str  # HF tensor name (copy/linear) or "model.layers.N.mlp.experts" prefix (experts)
  kind: str  # "copy" | "linear" | "experts"
  proj: str = ""  # experts only: gate_proj / up_proj / down_proj


def leaf_map(path: tuple, cfg: ModelConfig) -> LeafMap:
  """The HF source of our parameter at ``path`` (keys of ``nnx.state(model)``)."""
  path = tuple(path)
  if path in TOP:
    return LeafMap(path, *TOP[path])
  if path[0] == "layers":
    prefix, rest = f"model.layers.{path[1]}.", path[2:]
  elif path[0] == "mtp":
    prefix = f"model.layers.{cfg.n_layers + path[1]}."
    if path[2:] in MTP:
      name, kind = MTP[path[2:]]
      return LeafMap(path, prefix + name, kind)
    assert path[2] == "block", path
    rest = path[3:]
  else:
    raise KeyError(f"no HF name for parameter {path}")
  suffix, kind = BLOCK[rest]
  if kind == "experts":
    return LeafMap(path, prefix + "mlp.experts", kind, suffix)
  return LeafMap(path, prefix + suffix, kind)


def layer_maps(path: tuple, cfg: ModelConfig) -> tuple[list[LeafMap], bool]:
  """(one LeafMap per layer the parameter holds, whether it is stacked on a leading layer axis)."""
  paths = layer_paths(path, cfg.n_dense_layers, cfg.n_moe_layers)
  return [leaf_map(p, cfg) for p in paths], paths[0] != tuple(path)


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
  """HF names of the per-MTP-layer copies of the shared embedding/head -> the main tensor's name."""
  out = {}
  for k in range(cfg.mtp_depths):
    p = f"model.layers.{cfg.n_layers + k}."
    out[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
    if not cfg.tie_embeddings:
      out[p + "shared_head.head.weight"] = "lm_head.weight"
  return out


# -- layout conversions (pure) -----------------------------------------------------------------------


def linear_from_hf(w: np.ndarray, shape: tuple) -> np.ndarray:
  """HF ``weight[prod(out), in]`` -> our ``w[in, *out]``."""
  return np.ascontiguousarray(w.T).reshape(shape)


def linear_to_hf(w: np.ndarray) -> np.ndarray:
  """Our ``w[in, *out]`` -> HF ``weight[prod(out), in]``."""
  return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def expert_names(m: LeafMap, n_experts: int) -> list[str]:
  return [f"{m.name}.{e}.{m.proj}.weight" for e in range(n_experts)]


def fused_name(m: LeafMap) -> str:
  return f"{m.name}.{'down_proj' if m.proj == 'down_proj' else 'gate_up_proj'}"


def hf_shape(m: LeafMap, shape: tuple, name: str) -> tuple:
  """The shape HF tensor ``name`` must have to fill our parameter of ``shape``."""
  if m.kind == "copy":
    return tuple(shape)
  if m.kind == "linear":
    return (int(np.prod(shape[1:])), shape[0])
  n_exp, d_in, d_out = shape
  if name.endswith("gate_up_proj"):
    return (n_exp, 2 * d_out, d_in)
  if name.endswith("experts.down_proj"):
    return (n_exp, d_out, d_in)
  return (d_out, d_in)


def experts_from_fused(fused: np.ndarray, proj: str) -> np.ndarray:
  """transformers' fused ``gate_up_proj[E, 2f, d]`` / ``down_proj[E, d, f]`` -> our [E, in, out]."""
  if proj != "down_proj":
    f = fused.shape[1] // 2
    fused = fused[:, :f] if proj == "gate_proj" else fused[:, f:]
  return np.ascontiguousarray(np.swapaxes(fused, 1, 2))


def load_leaf(m: LeafMap, shape: tuple, read: Callable[[str], np.ndarray], has: Callable[[str], bool],
              dtype) -> np.ndarray:
  """Our parameter ``m.path`` assembled from HF tensors (``read`` returns float arrays)."""
  if m.kind == "copy":
    return np.asarray(read(m.name), dtype).reshape(shape)
  if m.kind == "linear":
    return linear_from_hf(np.asarray(read(m.name), dtype), shape)
  names = expert_names(m, shape[0])
  if not has(names[0]) and has(fused_name(m)):
    return experts_from_fused(np.asarray(read(fused_name(m)), dtype), m.proj)
  out = np.empty(shape, dtype)  # one expert at a time into the stacked buffer
  for e, name in enumerate(names):
    out[e] = np.asarray(read(name), dtype).T
  return out


def dump_leaf(m: LeafMap, value: np.ndarray):
  """Yield (HF name, array) pairs for our parameter, in the released per-expert layout."""
  if m.kind == "copy":
    yield m.name, value
  elif m.kind == "linear":
    yield m.name, linear_to_hf(value)
  else:
    for name, w in zip(expert_names(m, value.shape[0]), value):
      yield name, np.ascontiguousarray(w.T)

"""HF ``config.json`` (DeepseekV3 / KimiK2 / DeepseekV2 layout) <-> our ``ModelConfig``.

Absent fields take the defaults of transformers' ``DeepseekV3Config``, since that is how HF reads
the same file. Anything we cannot reproduce exactly (other RoPE types, non-interleaved RoPE, biases,
other activations, unknown routing) raises ``ConfigError`` with one line instead of loading a model
that would silently compute something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composer_jax.config import Config, ConfigError, DataConfig, ModelConfig, from_dict

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
# DeepseekV3Config defaults (transformers) for fields a config.json may leave out.
HF_DEFAULTS = {"first_k_dense_replace": 3, "moe_intermediate_size": 2048, "n_routed_experts": 256,
               "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
               "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "q_lora_rank": 1536,
               "num_nextn_predict_layers": 0, "initializer_range": 0.02}


def _get(d: dict, key: str) -> Any:
  return d[key] if key in d else HF_DEFAULTS[key]


def _bad(field: str, value: Any, fix: str) -> ConfigError:
  return ConfigError(f"config.json {field}={value!r} is not supported: {fix}")


def param_dtype_from_hf(d: dict) -> str:
  """The parameter dtype a checkpoint asks for: bfloat16 stays, everything else loads as float32."""
  name = str(d.get("torch_dtype") or d.get("dtype") or "float32").replace("torch.", "")
  return "bfloat16" if name == "bfloat16" else "float32"


def _rope(d: dict) -> dict:
  """rope_theta and YaRN fields from either the released (rope_scaling) or transformers-5
  (rope_parameters) layout."""
  scaling = d.get("rope_scaling") or {}
  params = d.get("rope_parameters") or {}
  if not isinstance(scaling, dict) or not isinstance(params, dict):
    raise _bad("rope_scaling", scaling, "give a mapping or null")
  if "layer_types" in d or any(isinstance(v, dict) for v in params.values()):
    raise _bad("rope_parameters", params, "per-layer RoPE is not supported")
  s = {**params, **scaling}
  theta = d.get("rope_theta", s.get("rope_theta", 10000.0))
  kind = s.get("rope_type") or s.get("type") or "default"
  out = {"rope_theta": float(theta)}
  if s.get("partial_rotary_factor", 1.0) != 1.0:
    raise _bad("rope partial_rotary_factor", s["partial_rotary_factor"], "MLA rotates all rope dims")
  if kind == "default":
    return out
  if kind not in ("yarn", "deepseek_yarn"):
    raise _bad("rope_scaling.type", kind, "only 'yarn' (or no scaling) is implemented")
  if s.get("attention_factor") is not None:
    raise _bad("rope_scaling.attention_factor", s["attention_factor"],
               "remove it; the factor is derived from mscale/mscale_all_dim")
  if s.get("truncate", True) is not True:
    raise _bad("rope_scaling.truncate", s["truncate"], "only the truncated YaRN ramp is implemented")
  if s.get("original_max_position_embeddings") is None:
    raise ConfigError("config.json rope_scaling.original_max_position_embeddings is missing: "
                      "YaRN needs the pre-training context length")
  orig = int(s["original_max_position_embeddings"])
  factor = s.get("factor")
  if factor is None:  # transformers derives it from the two context lengths
    factor = _get(d, "max_position_embeddings") / orig
  out.update(yarn_factor=float(factor), yarn_original_max_position=orig,
             yarn_beta_fast=float(s.get("beta_fast") or 32),
             yarn_beta_slow=float(s.get("beta_slow") or 1),
             # None and 0 both mean "unset" to HF (`if mscale and mscale_all_dim`).
             yarn_mscale=float(s.get("mscale") or 0.0),
             yarn_mscale_all_dim=float(s.get("mscale_all_dim") or 0.0))
  return out


def _routing(d: dict, model_type: str) -> dict:
  n_group = int(d.get("n_group", HF_DEFAULTS["n_group"]) or 1)
  topk_group = int(d.get("topk_group", HF_DEFAULTS["topk_group"]) or 1)
  v2 = model_type == "deepseek_v2"
  scoring = d.get("scoring_func") or ("softmax" if v2 else "sigmoid")
  if scoring not in ("sigmoid", "softmax"):
    raise _bad("scoring_func", scoring, "use 'sigmoid' or 'softmax'")
  method = d.get("topk_method") or ("greedy" if v2 else "noaux_tc")
  if method not in TOPK_METHODS:
    raise _bad("topk_method", method, f"use one of {list(TOPK_METHODS)}")
  if method == "greedy":
    n_group = topk_group = 1  # greedy ignores the groups
  elif n_group > 1:
    # Our group score follows the scoring function: top-2 sum for sigmoid (noaux_tc), max for
    # softmax (group_limited_greedy); the crossed combinations would compute something else.
    want = "noaux_tc" if scoring == "sigmoid" else "group_limited_greedy"
    if method != want:
      raise _bad("topk_method", method, f"with scoring_func={scoring!r} and n_group>1 use {want!r}")
  return {"scoring": scoring, "selection_bias": method == "noaux_tc", "n_group": n_group,
          "topk_group": topk_group}


def config_from_hf(d: dict) -> ModelConfig:
  """A validated ``ModelConfig`` from an HF config.json dict (raises ``ConfigError``, one line)."""
  if not isinstance(d, dict):
    raise ConfigError("config.json must hold a JSON object")
  model_type = d.get("model_type")
  if model_type not in MODEL_TYPES:
    raise _bad("model_type", model_type, f"expected one of {list(MODEL_TYPES)}")
  for key in REQUIRED:
    if d.get(key) is None:
      raise ConfigError(f"config.json is missing {key!r}: it is required for a {model_type} model")
  heads = int(d["num_attention_heads"])
  checks = [("hidden_act", d.get("hidden_act", "silu"), "silu", "only SwiGLU (silu) MLPs exist"),
            ("attention_bias", bool(d.get("attention_bias", False)), False, "MLA has no biases here"),
            ("mlp_bias", bool(d.get("mlp_bias", False)), False, "the MLPs have no biases here"),
            ("rope_interleave", d.get("rope_interleave", True) is not False, True,
             "only interleaved (pairwise) RoPE, the DeepSeek/Kimi layout, is implemented"),
            ("moe_layer_freq", d.get("moe_layer_freq", 1), 1, "every layer after the dense ones is MoE"),
            ("num_key_value_heads", d.get("num_key_value_heads") or heads, heads,
             "MLA needs num_key_value_heads == num_attention_heads")]
  for field, got, want, fix in checks:
    if got != want:
      raise _bad(field, d.get(field), fix)
  quant = d.get("quantization_config")
  if quant is not None:
    fp8_block_size(d)  # raises for formats we cannot dequantize
  n_layers = int(d["num_hidden_layers"])
  n_experts = d.get("n_routed_experts", HF_DEFAULTS["n_routed_experts"])
  dense = n_layers if not n_experts else min(int(_get(d, "first_k_dense_replace") or 0), n_layers)
  dtype = param_dtype_from_hf(d)
  kw = dict(
      vocab_size=int(d["vocab_size"]), d_model=int(d["hidden_size"]), n_layers=n_layers,
      n_dense_layers=dense, dense_ffn_dim=int(d["intermediate_size"]), n_heads=heads,
      q_lora_rank=int(_get(d, "q_lora_rank") or 0), kv_lora_rank=int(d["kv_lora_rank"]),
      qk_nope_dim=int(d["qk_nope_head_dim"]), qk_rope_dim=int(d["qk_rope_head_dim"]),
      v_head_dim=int(d["v_head_dim"]), max_seq_len=int(_get(d, "max_position_embeddings")),
      rms_eps=float(_get(d, "rms_norm_eps")), tie_embeddings=bool(_get(d, "tie_word_embeddings")),
      mtp_depths=int(_get(d, "num_nextn_predict_layers") or 0), param_dtype=dtype, compute_dtype=dtype,
      init_std=float(_get(d, "initializer_range")), **_rope(d))
  if n_experts:
    kw.update(n_routed_experts=int(n_experts), n_experts_per_tok=int(_get(d, "num_experts_per_tok")),
              n_shared_experts=int(_get(d, "n_shared_experts") or 0),
              moe_ffn_dim=int(_get(d, "moe_intermediate_size")),
              norm_topk_prob=bool(_get(d, "norm_topk_prob")),
              routed_scaling_factor=float(_get(d, "routed_scaling_factor")), **_routing(d, model_type))
  cfg = ModelConfig(**kw)
  # from_dict's defaults (e.g. rl.max_context = the model's length), then the one-line checks.
  whole = Config(model=cfg, data=DataConfig(seq_len=min(cfg.max_seq_len, DataConfig.seq_len)))
  from_dict(whole.to_dict())
  return cfg


def fp8_block_size(d: dict) -> tuple[int, int]:
  """The (rows, cols) of each ``weight_scale_inv`` block of an FP8 checkpoint (128x128 default)."""
  q = d.get("quantization_config") or {}
  method = q.get("quant_method", "fp8")
  if method != "fp8" or q.get("fmt", "e4m3") != "e4m3":
    raise _bad("quantization_config.quant_method", method,
               "only block-scaled FP8 e4m3 (DeepSeek-V3 style weight_scale_inv) can be dequantized")
  block = q.get("weight_block_size") or [128, 128]
  if len(block) != 2 or min(block) < 1:
    raise _bad("quantization_config.weight_block_size", block, "give two positive sizes, e.g. [128, 128]")
  return int(block[0]), int(block[1])


def config_to_hf(cfg: ModelConfig, model_type: str = "deepseek_v3") -> dict:
  """The config.json of the released DeepSeek-V3 layout (legacy ``rope_scaling``), which both the
  original remote code and transformers' DeepseekV3 read."""
  rope_scaling = None
  if cfg.yarn_factor > 1.0:
    rope_scaling = {"type": "yarn", "rope_type": "yarn", "factor": cfg.yarn_factor,
                    "original_max_position_embeddings": cfg.yarn_original_max_position,
                    "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                    "mscale": cfg.yarn_mscale, "mscale_all_dim": cfg.yarn_mscale_all_dim}
  if cfg.selection_bias:
    method = "noaux_tc"
  else:
    method = "group_limited_greedy" if cfg.n_group > 1 else "greedy"
  return {
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
      "first_k_dense_replace": cfg.n_dense_layers, "moe_layer_freq": 1,
      "intermediate_size": cfg.dense_ffn_dim, "moe_intermediate_size": cfg.moe_ffn_dim,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
      "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
      "qk_nope_head_dim": cfg.qk_nope_dim, "qk_rope_head_dim": cfg.qk_rope_dim,
      "v_head_dim": cfg.v_head_dim, "n_routed_experts": cfg.n_routed_experts,
      "num_experts_per_tok": cfg.n_experts_per_tok, "n_shared_experts": cfg.n_shared_experts,
      "scoring_func": cfg.scoring, "topk_method": method, "n_group": cfg.n_group,
      "topk_group": cfg.topk_group, "norm_topk_prob": cfg.norm_topk_prob,
      "routed_scaling_factor": cfg.routed_scaling_factor, "hidden_act": "silu",
      "attention_bias": False, "rope_interleave": True, "rope_theta": cfg.rope_theta,
      "rope_scaling": rope_scaling, "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "num_nextn_predict_layers": cfg.mtp_depths, "initializer_range": cfg.init_std,
      "torch_dtype": cfg.param_dtype, "use_cache": True,
  }


def hf_fields_equal(a: ModelConfig, b: ModelConfig) -> bool:
  """Whether two configs agree on everything a config.json can express."""
  skip = {"seq_aux_loss_coef", "bias_update_rate", "gmm_impl", "gmm_precision", "mtp_loss_weight",
          "remat", "scan_layers"}
  if a.yarn_factor == b.yarn_factor == 1.0:  # the other YaRN fields are inert then
    skip |= {f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("yarn_")}
  return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(ModelConfig)
             if f.name not in skip)

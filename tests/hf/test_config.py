"""config.json <-> ModelConfig: released configs, round trips, and one-line errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from composer_jax.config import ConfigError, ModelConfig, load_config
from composer_jax.hf import config_from_hf, config_to_hf
from composer_jax.hf.config import hf_fields_equal
from tests.hf.helpers import OURS_TINY

# The public config.json files of the released checkpoints (fields that matter here).
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
       "weight_block_size": [128, 128]}
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True,
    "hidden_act": "silu", "max_position_embeddings": 131072, "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
    "torch_dtype": "bfloat16", "quantization_config": FP8,
}
DEEPSEEK_V3 = dict(
    KIMI_K2, model_type="deepseek_v3", vocab_size=129280, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, routed_scaling_factor=2.5, n_group=8,
    topk_group=4, first_k_dense_replace=3, max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    num_nextn_predict_layers=1)


@pytest.mark.parametrize("hf, yaml", [(KIMI_K2, "configs/kimi-k2.yaml"),
                                      (DEEPSEEK_V3, "configs/deepseek-v3.yaml")])
def test_released_configs_match_presets(hf, yaml):
  # The presets' parameter counts are checked against the published totals in tests/model; equal
  # configs therefore load into models of exactly those sizes.
  ours = config_from_hf(hf)
  preset = load_config(yaml).model
  assert hf_fields_equal(ours, preset), [
      (f.name, getattr(ours, f.name), getattr(preset, f.name)) for f in dataclasses.fields(ModelConfig)
      if getattr(ours, f.name) != getattr(preset, f.name)]


@pytest.mark.parametrize("changes", [
    {},
    {"q_lora_rank": 0, "tie_embeddings": True, "yarn_factor": 1.0, "mtp_depths": 0},
    {"scoring": "softmax", "selection_bias": False, "n_group": 4, "topk_group": 2,
     "norm_topk_prob": False, "param_dtype": "bfloat16", "compute_dtype": "bfloat16"},
    {"selection_bias": False, "n_group": 1, "topk_group": 1, "n_dense_layers": 0,
     "yarn_mscale": 0.0},
])
def test_round_trip(changes):
  cfg = dataclasses.replace(OURS_TINY, **changes)
  back = config_from_hf(config_to_hf(cfg))
  assert hf_fields_equal(back, cfg)
  assert config_to_hf(back) == config_to_hf(cfg)


def test_transformers5_layout():
  """transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_scaling."""
  hf = copy.deepcopy(KIMI_K2)
  hf["rope_parameters"] = dict(hf.pop("rope_scaling"), rope_type="yarn", rope_theta=hf.pop("rope_theta"))
  hf.pop("quantization_config")
  hf["dtype"] = hf.pop("torch_dtype")
  assert hf_fields_equal(config_from_hf(hf), config_from_hf(KIMI_K2))
  hf["rope_parameters"]["factor"] = None  # derived as max_position / original_max_position
  assert config_from_hf(hf).yarn_factor == 32.0


def test_installed_transformers_config():
  transformers = pytest.importorskip("transformers")
  from tests.hf.helpers import HF_TINY
  hf = transformers.DeepseekV3Config(**HF_TINY).to_dict()
  assert hf_fields_equal(config_from_hf(hf), dataclasses.replace(OURS_TINY, mtp_depths=0, init_std=0.02))


def _set(path: str, value):
  def apply(d):
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
      node = node[k]
    if value is KeyError:
      del node[keys[-1]]
    else:
      node[keys[-1]] = value
  return apply


@pytest.mark.parametrize("change, field", [
    (_set("rope_interleave", False), "rope_interleave"),
    (_set("scoring_func", "sqrtsoftplus"), "scoring_func"),
    (_set("topk_method", "random"), "topk_method"),
    (_set("topk_method", "group_limited_greedy"), "topk_method"),  # sigmoid + n_group>1
    (_set("model_type", "llama"), "model_type"),
    (_set("rope_scaling.type", "linear"), "rope_scaling.type"),
    (_set("rope_scaling.attention_factor", 1.2), "attention_factor"),
    (_set("rope_scaling.original_max_position_embeddings", KeyError), "original_max_position"),
    (_set("hidden_size", KeyError), "hidden_size"),
    (_set("quantization_config.quant_method", "awq"), "quant_method"),
    (_set("num_key_value_heads", 8), "num_key_value_heads"),
    (_set("hidden_act", "gelu"), "hidden_act"),
    (_set("attention_bias", True), "attention_bias"),
    (_set("moe_layer_freq", 2), "moe_layer_freq"),
    (_set("num_experts_per_tok", 400), "n_experts_per_tok"),  # caught by our own validation
])
def test_config_errors(change, field):
  hf = copy.deepcopy(DEEPSEEK_V3)
  change(hf)
  with pytest.raises(ConfigError) as e:
    config_from_hf(hf)
  msg = str(e.value)
  assert field in msg and "\n" not in msg, msg

"""Shared pieces of the HF tests: a tiny HF-side config and randomised models on both sides."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from composer_jax.config import ModelConfig
from composer_jax.model import abstract_model

# A tiny DeepseekV3 exercising every feature the mapping touches: q low-rank, a dense first layer,
# two MoE layers with a shared expert, group-limited routing (4 groups, best 2), YaRN with
# factor > 1 and mscale != mscale_all_dim (so both the cos/sin factor and the softmax scale move),
# v_head_dim != qk_nope_head_dim.
HF_TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
    qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=128,
    norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
                         mscale=1.0, mscale_all_dim=0.7),
    num_mtp_layers=0,
)

OURS_TINY = ModelConfig(
    vocab_size=96, d_model=32, n_layers=3, n_dense_layers=1, dense_ffn_dim=48, n_heads=4,
    q_lora_rank=24, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=12, n_routed_experts=8,
    n_experts_per_tok=2, n_shared_experts=1, moe_ffn_dim=16, scoring="sigmoid", selection_bias=True,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, max_seq_len=128, yarn_factor=4.0,
    yarn_original_max_position=32, yarn_mscale=1.0, yarn_mscale_all_dim=0.7, mtp_depths=1,
    init_std=0.1)


def our_model(seed: int = 0, **changes):
  """Our model with every parameter drawn in NumPy (fast, independent of the init code): weights
  N(0, 0.1), norm scales 1 + N(0, 0.1), router biases N(0, 0.05) — ones and zeros would hide a
  swapped norm or a dropped bias."""
  cfg = dataclasses.replace(OURS_TINY, **changes)
  graphdef, state = nnx.split(abstract_model(cfg))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(state):
    std, base = {"scale": (0.1, 1.0), "router_bias": (0.05, 0.0)}.get(path[-1], (0.1, 0.0))
    var.set_value(jnp.asarray(base + rng.normal(0.0, std, var.shape), var.dtype))
  return nnx.merge(graphdef, state)


def leaves(model) -> dict:
  return {p: np.asarray(jax.device_get(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(model))}


# One compiled forward per model structure; eager op-by-op dispatch is several times slower here.
_forward = nnx.jit(lambda model, tokens: model(tokens).logits)


def logits(model, tokens) -> np.ndarray:
  return np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32)), np.float32)


def hf_tensors(path: str) -> dict:
  """Every tensor of the *.safetensors files in ``path``, by name."""
  out = {}
  for file in sorted(os.listdir(path)):
    if file.endswith(".safetensors"):
      with safe_open(os.path.join(path, file), framework="np") as f:
        out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
  return out

"""Building the model: abstract (eval_shape) or materialised directly on its shardings."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from composer_jax.config import Config, ModelConfig
from composer_jax.model.transformer import Transformer
from composer_jax.parallel.rules import make_rules, state_shardings


def model_config(cfg: Config | ModelConfig) -> ModelConfig:
  return cfg.model if isinstance(cfg, Config) else cfg


def _rules(cfg, rules):
  if rules is not None:
    return rules
  return make_rules(cfg.mesh.rules if isinstance(cfg, Config) else None)


def abstract_model(cfg: Config | ModelConfig) -> Transformer:
  """The model with ShapeDtypeStruct leaves: shapes, dtypes and axes, nothing allocated."""
  mcfg = model_config(cfg)
  return nnx.eval_shape(lambda: Transformer(mcfg, nnx.Rngs(0)))


def build_model(cfg: Config | ModelConfig, mesh: Mesh | None = None, seed: int = 0,
                rules: dict | None = None) -> Transformer:
  """Initialise the model; with a mesh, every parameter is created on its own sharding."""
  mcfg = model_config(cfg)

  def create():
    return Transformer(mcfg, nnx.Rngs(seed))

  if mesh is None:
    return create()
  graphdef, abs_state = nnx.split(abstract_model(mcfg))
  shardings = state_shardings(abs_state, mesh, _rules(cfg, rules))
  state = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def _is_var(x):
  return isinstance(x, nnx.Variable)


def count_params(cfg: Config | ModelConfig) -> dict:
  """Total and active-per-token parameter counts (embedding, head, norms, router bias included).

  Active = total minus the routed experts a token does not visit: (E - k) experts in every MoE
  block (the main stack and MTP depths alike).
  """
  mcfg = model_config(cfg)
  model = abstract_model(mcfg)
  state = nnx.state(model)
  total = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(state, is_leaf=_is_var))
  per_expert = 3 * mcfg.d_model * mcfg.moe_ffn_dim
  n_moe_blocks = sum(n or 1 for _, n in model.moe_groups())  # a stack of n counts n
  inactive = n_moe_blocks * (mcfg.n_routed_experts - mcfg.n_experts_per_tok) * per_expert
  embed = mcfg.vocab_size * mcfg.d_model
  return {"total": total, "active": total - inactive,
          "active_non_embedding": total - inactive - embed, "embedding": embed}


def flops_per_token(cfg: Config | ModelConfig, seq_len: int, training: bool = True) -> float:
  """Model FLOPs per token: 2 x active matmul params (no embedding lookup) + causal attention.

  Attention per layer per token: QK^T and PV over on average seq_len/2 keys (causal), per head
  2*(qk_head + v_head)*seq_len/2. Training = 3x forward (backward counts twice).
  """
  mcfg = model_config(cfg)
  counts = count_params(mcfg)
  matmul = counts["active_non_embedding"]
  n_layers = mcfg.n_layers + mcfg.mtp_depths
  attn = n_layers * mcfg.n_heads * (mcfg.qk_head_dim + mcfg.v_head_dim) * seq_len
  fwd = 2.0 * matmul + attn
  return 3.0 * fwd if training else fwd

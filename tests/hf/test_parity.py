"""Logits parity with transformers' DeepseekV3 (torch, CPU, float32), both directions.

Tolerance: max |logit difference| <= 1e-4 with logits of magnitude ~1-3: both sides compute in
float32 (our matmuls at precision "highest"), so only float32 rounding through three layers
separates them (observed ~1e-6). A wrong convention (RoPE pairing, YaRN, routing, a transposed or
swapped weight) moves logits by ~1e-1.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from composer_jax.hf import from_pretrained, save_pretrained
from tests.hf.helpers import HF_TINY, leaves, logits, our_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4


def random_hf_model(q_lora: bool, seed: int = 0):
  """A randomly initialised DeepseekV3ForCausalLM: weights N(0, 0.1), norm weights 1 + N(0, 0.1),
  and a non-zero e_score_correction_bias so that the selection bias matters."""
  cfg = dict(HF_TINY, q_lora_rank=HF_TINY["q_lora_rank"] if q_lora else None)
  config = transformers.DeepseekV3Config(**cfg, initializer_range=0.1, attn_implementation="eager")
  torch.manual_seed(seed)
  model = transformers.DeepseekV3ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn_like(b))
  return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


TOKENS = np.random.default_rng(0).integers(0, HF_TINY["vocab_size"], (2, 12))


@pytest.fixture(scope="module", params=[True, False], ids=["q_lora", "direct_q"])
def hf_checkpoint(request, tmp_path_factory):
  model = random_hf_model(q_lora=request.param)
  path = str(tmp_path_factory.mktemp("hf"))
  model.save_pretrained(path)
  return model, path


def test_hf_model_to_ours_logits(hf_checkpoint):
  model, path = hf_checkpoint
  ours = from_pretrained(path)
  assert ours.cfg.q_lora_rank == (model.config.q_lora_rank or 0)
  ref = hf_logits(model, TOKENS)
  diff = np.abs(logits(ours, TOKENS) - ref).max()
  assert np.abs(ref).max() > 0.5  # logits are not trivially small
  assert diff <= TOL, f"max |logit diff| {diff:.2e} > {TOL}"


def test_hf_in_memory_fused_layout(hf_checkpoint, tmp_path):
  """transformers keeps experts fused in memory (experts.gate_up_proj / experts.down_proj); a
  checkpoint written from that state_dict loads to the same parameters as the per-expert one."""
  from safetensors.torch import save_file
  model, path = hf_checkpoint
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
  save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with open(f"{path}/config.json") as f:
    (tmp_path / "config.json").write_text(f.read())
  fused, released = leaves(from_pretrained(str(tmp_path))), leaves(from_pretrained(path))
  assert fused.keys() == released.keys()
  for k in fused:
    np.testing.assert_array_equal(fused[k], released[k], err_msg=str(k))


def test_our_checkpoint_loads_in_hf(tmp_path):
  ours = our_model(seed=1)
  path = save_pretrained(ours, str(tmp_path))
  with open(f"{path}/config.json") as f:
    assert json.load(f)["rope_scaling"]["type"] == "yarn"
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
  assert hf.config.rope_parameters["mscale_all_dim"] == ours.cfg.yarn_mscale_all_dim
  bias = hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy()
  np.testing.assert_array_equal(bias, np.asarray(ours.layers[1].mlp.router_bias.get_value()))
  mine = logits(ours, TOKENS)
  diff = np.abs(hf_logits(hf, TOKENS) - mine).max()
  assert np.abs(mine).max() > 0.5
  assert diff <= TOL, f"max |logit diff| {diff:.2e} > {TOL}"

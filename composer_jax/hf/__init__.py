"""HuggingFace DeepseekV3 / KimiK2 checkpoints: config mapping, streaming load (FP8 dequantized,
sharded, placed on a mesh) and save in the released per-expert layout."""

from composer_jax.hf.checkpoint import from_pretrained, read_hf_config, save_pretrained
from composer_jax.hf.config import config_from_hf, config_to_hf
from composer_jax.hf.tensors import dequantize_fp8

__all__ = [
           "config_from_hf",
           "config_to_hf",
           "dequantize_fp8",
           "from_pretrained",
           "read_hf_config",
           "save_pretrained",
]

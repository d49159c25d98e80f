"""Pallas kernels.

Public API: one dispatch function per operation; the backend (Pallas GPU / TPU, interpret, XLA,
CPU sorted blocks) is chosen behind it.
"""

from composer_jax.kernels.gmm import gmm, gmm_reference, tgmm
from composer_jax.kernels.quant import (
    dequantize_fp8_rowwise,
    dequantize_fp8_tile,
    dequantize_mxfp8,
    dequantize_nvfp4,
    fake_quant,
    quantize_fp8_rowwise,
    quantize_fp8_tile,
    quantize_mxfp8,
    quantize_nvfp4,
)
from composer_jax.kernels.quant_pallas import (
    quantize_mxfp8_pallas,
    quantize_nvfp4_pallas,
)

__all__ = [
    "dequantize_fp8_rowwise",
    "dequantize_fp8_tile",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "fake_quant",
    "gmm",
    "gmm_reference",
    "quantize_fp8_rowwise",
    "quantize_fp8_tile",
    "quantize_mxfp8",
    "quantize_mxfp8_pallas",
    "quantize_nvfp4",
    "quantize_nvfp4_pallas",
    "tgmm",
]

"""Fused Pallas quantize kernels (interpret mode) bit for bit against the NumPy reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from composer_jax.kernels.quant_pallas import (
  quantize_mxfp8_pallas,
  quantize_nvfp4_pallas,
)

from tests.kernels.kernels_ref import ref_mxfp8, ref_nvfp4
from tests.kernels.test_quant import _bits, _test_matrix


@pytest.fixture(scope="module")
def x():
  return np.concatenate([_test_matrix(0, 24, 128), _test_matrix(1, 24, 128)])  # 48 x 128


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_mxfp8_kernel_bit_exact(x, target, elem):
  f = jax.jit(lambda v: quantize_mxfp8_pallas(v, elem=elem, block_shape=(16, 64), interpret=True,
                                              target=target))
  q, s = f(x)
  rq, rs = ref_mxfp8(x, elem)
  np.testing.assert_array_equal(_bits(s), _bits(rs))
  np.testing.assert_array_equal(_bits(q), _bits(rq))


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_nvfp4_kernel_bit_exact(x, target):
  f = jax.jit(lambda v: quantize_nvfp4_pallas(v, block_shape=(16, 64), interpret=True,
                                              target=target))
  q, sb, st = f(x)
  rq, rsb, rst = ref_nvfp4(x)
  assert np.float32(st) == rst
  np.testing.assert_array_equal(_bits(sb), _bits(rsb))
  np.testing.assert_array_equal(_bits(q), _bits(rq))

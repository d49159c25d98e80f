"""Expert loads (which drive the aux-loss-free router-bias update) count valid tokens only."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from composer_jax.config import load_config
from composer_jax.model.routing import expert_load
from tests.train.test_step import SMALL


def test_expert_load_by_hand():
  ids = jnp.array([[0, 1], [1, 2], [3, 3]])
  np.testing.assert_allclose(expert_load(ids, 4), [1 / 6, 2 / 6, 1 / 6, 2 / 6])
  # The padded third token is not counted: 4 valid (token, slot) pairs.
  np.testing.assert_allclose(expert_load(ids, 4, jnp.array([True, True, False])), [0.25, 0.5, 0.25, 0])
  np.testing.assert_array_equal(expert_load(ids, 4, jnp.zeros(3, bool)), np.zeros(4))


def test_model_loads_ignore_padding():
  """router_loads of a half-padded batch = a NumPy count of the routed experts of its valid tokens."""
  from composer_jax.model import build_model
  cfg = load_config("configs/tiny.yaml", SMALL)
  model = build_model(cfg, seed=0)
  rng = np.random.default_rng(0)
  seg = np.ones((2, 16), np.int32)
  seg[0, 5:] = 0
  seg[1, 12:] = 0
  tokens = rng.integers(1, 64, size=(2, 16)).astype(np.int32)
  pos = np.where(seg > 0, np.arange(16), 0).astype(np.int32)
  out = model(tokens, seg, pos, mtp=False, return_routing=True)
  ids = np.asarray(out.routed_experts[0])  # [b, s, k] of the one MoE layer
  want = np.bincount(ids[seg > 0].reshape(-1), minlength=4) / (seg.sum() * ids.shape[-1])
  np.testing.assert_allclose(np.asarray(out.router_loads[0]), want, rtol=1e-6)

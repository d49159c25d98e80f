"""The chunked head + CE (train.loss_chunk) equals the whole-logits loss: values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import load_config
from composer_jax.model.loss import chunked_head_ce, shifted_ce


@pytest.mark.parametrize("chunk,z_loss", [(8, 0.0), (7, 1e-2), (64, 1e-2)])
def test_chunked_head_ce_matches_shifted_ce(chunk, z_loss):
  """Chunks that divide s, that do not (padding), and one chunk longer than s; z-loss on/off."""
  rng = np.random.default_rng(0)
  b, s, d, v = 3, 24, 16, 50
  h = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  tok = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
  seg = jnp.asarray(np.where(np.arange(s) < 15, 1, 2)[None].repeat(b, 0) * (np.arange(s) < 22))
  mask = jnp.asarray(rng.integers(0, 2, (b, s)), jnp.float32)

  def ref(h, w):
    ce, n, z = shifted_ce(jnp.einsum("bsd,dv->bsv", h, w), tok, mask, seg, 1, z_loss)
    return ce + z, (ce, n, z)

  def got(h, w):
    ce, n, z = chunked_head_ce(h, w, tok, mask, seg, 1, z_loss, chunk)
    return ce + z, (ce, n, z)

  (lr, ar), gr = jax.value_and_grad(ref, argnums=(0, 1), has_aux=True)(h, w)
  (lg, ag), gg = jax.jit(jax.value_and_grad(got, argnums=(0, 1), has_aux=True))(h, w)
  np.testing.assert_allclose(lg, lr, rtol=1e-5)
  for a, r in zip(ag, ar):
    np.testing.assert_allclose(a, r, rtol=1e-5)
  for a, r in zip(gg, gr):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6)


def test_lm_loss_fn_chunked_equals_whole_logits():
  """The train step's loss (tiny model with MTP, packed rows) with and without chunking."""
  from composer_jax.model import build_model
  from composer_jax.train.step import lm_loss_fn, split_model
  small = ["model.n_layers=2", "data.seq_len=32", "data.batch_size=2", "model.max_seq_len=32"]
  cfgs = [load_config("configs/tiny.yaml", small + [f"train.loss_chunk={c}", "train.z_loss=1e-3"])
          for c in (0, 12)]
  graphdef, params, rest = split_model(build_model(cfgs[0], seed=0))
  rng = np.random.default_rng(1)
  seg = jnp.asarray(np.where(np.arange(32) < 20, 1, 2)[None].repeat(2, 0), jnp.int32)
  batch = {"tokens": jnp.asarray(rng.integers(0, 2048, (2, 32)), jnp.int32), "segment_ids": seg,
           "positions": jnp.asarray(np.where(np.arange(32) < 20, np.arange(32), np.arange(32) - 20)[None]
                                    .repeat(2, 0), jnp.int32),
           "loss_mask": jnp.ones((2, 32), jnp.float32)}
  outs = []
  for cfg in cfgs:
    f = lambda p, cfg=cfg: lm_loss_fn(nnx.merge(graphdef, p, rest), batch, cfg)[:2]
    outs.append(jax.jit(jax.value_and_grad(f, has_aux=True))(params))
  (l0, m0), g0 = outs[0]
  (l1, m1), g1 = outs[1]
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for k in ("ce", "z_loss", "mtp_ce", "tokens"):
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5)
  jax.tree.map(lambda a, r: np.testing.assert_allclose(a, r, rtol=1e-3, atol=1e-6), g1, g0)

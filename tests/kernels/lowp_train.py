"""A short training run of the real tiny model (configs/tiny.yaml, shrunk) at a gmm precision, on
a learnable synthetic stream (each token's successor is a fixed random function of it)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composer_jax.config import load_config
from composer_jax.model import build_model, lm_loss

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.yaml")


def tiny_config(precision: str, *, layers: int = 2, vocab: int = 256):
  return load_config(TINY, [f"model.gmm_precision={precision}", "model.gmm_impl=sorted",
                            f"model.n_layers={layers}", f"model.vocab_size={vocab}",
                            "model.mtp_depths=0"])


def batches(vocab: int, batch: int, seq: int, steps: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  succ = rng.integers(0, vocab, vocab)  # the rule to learn
  for _ in range(steps):
    tok = np.empty((batch, seq), np.int32)
    tok[:, 0] = rng.integers(0, vocab, batch)
    for t in range(1, seq):
      noise = rng.random(batch) < 0.1
      tok[:, t] = np.where(noise, rng.integers(0, vocab, batch), succ[tok[:, t - 1]])
    yield jnp.asarray(tok)


def train_curve(precision: str, steps: int, *, batch: int = 4, seq: int = 32, lr: float = 3e-3,
                layers: int = 2, vocab: int = 256) -> np.ndarray:
  """Per-step training CE; same init, data and optimizer for every precision."""
  cfg = tiny_config(precision, layers=layers, vocab=vocab)
  model = build_model(cfg.model, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(lr)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, tokens):
    def loss_fn(p):
      out = nnx.merge(graphdef, p, rest)(tokens, mtp=False)
      loss, metrics = lm_loss(out, tokens, None, cfg.model)
      return loss, metrics["ce"]
    (_, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, ce

  curve = []
  for tokens in batches(vocab, batch, seq, steps):
    params, opt, ce = step(params, opt, tokens)
    curve.append(float(ce))
  return np.array(curve)

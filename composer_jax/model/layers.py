"""Basic layers: parameters with logical axes, RMSNorm, linear maps, SwiGLU MLP, RoPE with YaRN."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.parallel.rules import constrain


def dtype_of(name: str):
  return jnp.dtype(name)


class KeySeq:
  """A stream of PRNG keys for parameter init: ``keys()`` folds a Python counter into one key.

  Used instead of calling ``nnx.Rngs.params()`` per parameter, whose in-place counter update costs
  quadratic time when tracing a large model under eval_shape (minutes for Kimi K2).
  """

  def __init__(self, key: jax.Array):
    self.key, self.n = key, 0

  def __call__(self) -> jax.Array:
    self.n += 1
    return jax.random.fold_in(self.key, self.n)


def param(rngs: KeySeq | None, shape: Sequence[int], axes: Sequence[str | None], dtype,
          std: float | None = None, init: str = "normal") -> nnx.Param:
  """A parameter with logical ``axes`` metadata; ``init`` is normal(std), ones or zeros."""
  assert len(shape) == len(axes), (shape, axes)
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = (std * jax.random.truncated_normal(rngs(), -2.0, 2.0, shape, jnp.float32)).astype(dtype)
  # eager_sharding=False: flax would otherwise query each traced value's sharding at creation,
  # which costs quadratic time under eval_shape of a large model (10 s for K2).
  return nnx.Param(value, axes=tuple(axes), eager_sharding=False)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, cfg: ModelConfig):
    self.eps = cfg.rms_eps
    self.scale = param(None, (dim,), ("norm",), dtype_of(cfg.param_dtype), init="ones")

  def __call__(self, x):
    # Normalise in float32 as the reference implementations do, then return to the input dtype.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (self.scale[...].astype(jnp.float32) * xf).astype(x.dtype)


class Linear(nnx.Module):
  """``x[..., in] @ w[in, *out]``; weights stored as [in, *out] with logical axes."""

  def __init__(self, d_in: int, out_shape: Sequence[int], axes: Sequence[str], cfg: ModelConfig,
               rngs: KeySeq, std: float | None = None):
    out_shape = tuple(out_shape)
    self.w = param(rngs, (d_in,) + out_shape, axes, dtype_of(cfg.param_dtype),
                   std=cfg.init_std if std is None else std)
    self.compute_dtype = dtype_of(cfg.compute_dtype)
    self.n_out = len(out_shape)

  def __call__(self, x):
    w = self.w[...].astype(self.compute_dtype)
    out = "".join("uvwxyz"[: self.n_out])
    return jnp.einsum(f"...i,i{out}->...{out}", x.astype(self.compute_dtype), w)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, hidden: int, rngs: KeySeq):
    d = cfg.d_model
    self.gate = Linear(d, (hidden,), ("embed", "mlp"), cfg, rngs)
    self.up = Linear(d, (hidden,), ("embed", "mlp"), cfg, rngs)
    self.down = Linear(hidden, (d,), ("mlp", "embed"), cfg, rngs)

  def __call__(self, x):
    h = jax.nn.silu(self.gate(x)) * self.up(x)
    h = constrain(h, ("act_batch", "act_seq", "act_mlp"))
    return self.down(h)


# --------------------------------------------------------------------------------------------------
# RoPE / YaRN (as HF transformers' DeepseekV3 computes it)
# --------------------------------------------------------------------------------------------------


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  if scale <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """Inverse frequencies [rope_dim/2] and the factor cos/sin are multiplied by."""
  dim, base = cfg.qk_rope_dim, cfg.rope_theta
  inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  if cfg.yarn_factor <= 1.0:
    return inv_freq, 1.0
  factor = cfg.yarn_factor
  orig = cfg.yarn_original_max_position

  def correction_dim(n_rot):
    return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

  low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
  high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  extrapolation = 1.0 - ramp
  inv_freq = (inv_freq / factor) * (1.0 - extrapolation) + inv_freq * extrapolation
  if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
    attn_factor = yarn_get_mscale(factor, cfg.yarn_mscale) / yarn_get_mscale(factor, cfg.yarn_mscale_all_dim)
  else:
    attn_factor = yarn_get_mscale(factor)
  return inv_freq, attn_factor


def softmax_scale(cfg: ModelConfig) -> float:
  """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
  scale = cfg.qk_head_dim ** -0.5
  if cfg.yarn_factor > 1.0 and cfg.yarn_mscale_all_dim:
    m = yarn_get_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim)
    scale = scale * m * m
  return scale


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape [..., rope_dim/2] in float32 for integer ``positions``."""
  inv_freq, attn_factor = rope_frequencies(cfg)
  ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  return jnp.cos(ang) * attn_factor, jnp.sin(ang) * attn_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate consecutive pairs (x[2i], x[2i+1]) — the layout of DeepSeek / Kimi checkpoints.

  x: [b, s, h, d] (or [b, s, d] for the shared key); cos/sin: [b, s, d/2].
  """
  if x.ndim == 4:
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., 0::2], xf[..., 1::2]
  r1 = x1 * cos - x2 * sin
  r2 = x2 * cos + x1 * sin
  return jnp.stack([r1, r2], axis=-1).reshape(x.shape).astype(x.dtype)

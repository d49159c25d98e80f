"""Pallas kernels, installed as ``composer_jax.kernels``.

Public API: one dispatch function per operation; the backend (Pallas GPU / TPU, interpret, XLA) is
chosen behind it.
"""

from composer_jax.kernels.gmm import gmm, tgmm

__all__ = ["gmm", "tgmm"]

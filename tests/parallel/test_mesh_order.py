"""A mesh that cannot get a topology-aware device order says so, in one line."""

from __future__ import annotations

import jax
import pytest

from composer_jax.config import MeshConfig
from composer_jax.parallel.mesh import build_mesh


def test_row_major_fallback_warns(monkeypatch):
  from jax.experimental import mesh_utils

  def refuse(*a, **k):
    raise ValueError("no topology for these devices\nsecond line")
  monkeypatch.setattr(mesh_utils, "create_device_mesh", refuse)
  with pytest.warns(UserWarning, match="row-major device order") as rec:
    mesh = build_mesh(MeshConfig(data=2, fsdp=2), jax.devices()[:4])
  assert "\n" not in str(rec[0].message) and "no topology" in str(rec[0].message)
  assert mesh.devices.ravel().tolist() == jax.devices()[:4]

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


def test_context_jit_retraces_per_rules_and_strategy():
  """A function reading the active rules / EP strategy while tracing: plain jax.jit replays the
  first trace under another activate block; context_jit traces once per context."""
  import jax.numpy as jnp
  import numpy as np

  from composer_jax.parallel.rules import (
    activate,
    active,
    active_option,
    context_jit,
    make_rules,
  )

  def f(x):
    strategy = active_option("ep_strategy", "none")
    return x + {"none": 0, "all_to_all": 1, "all_gather": 2}[strategy] + 10 * len(active()[1]["exp"])

  mesh = build_mesh(MeshConfig(data=2), jax.devices()[:2])
  a = (make_rules(), {"ep_strategy": "all_to_all"})
  b = (make_rules({"exp": None}), {"ep_strategy": "all_gather"})
  plain, keyed = jax.jit(f), context_jit(f)
  got = {}
  for name, (rules, opts) in (("a", a), ("b", b)):
    with activate(mesh, rules, **opts):
      got[name] = (int(plain(jnp.zeros(()))), int(keyed(jnp.zeros(()))))
  assert got["a"] == (11, 11)
  assert got["b"] == (11, 2)  # plain jit: the stale trace; context_jit: strategy 2, no exp axis
  assert len(keyed.cache) == 2
  np.testing.assert_equal(int(keyed(jnp.zeros(()))), 10)  # outside any block: default rules

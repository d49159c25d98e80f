"""Task draws: the family curriculum's weights against an exact binomial sum, its preference for
families with both outcomes on a simulated policy, and its checkpointed state."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest

from composer_jax.config import ConfigError, load_config
from composer_jax.rl.curriculum import (
  FamilyStream,
  TaskStream,
  family_of,
  make_stream,
  mixed_outcome_prob,
)


def test_mixed_outcome_prob_is_the_binomial_mass_between_all_and_none():
  wins, tries = np.array([0.0, 3.0, 0.0, 7.2, 40.0]), np.array([0.0, 4.0, 20.0, 8.0, 40.0])
  for g in (2, 4, 8):
    got = mixed_outcome_prob(wins, tries, g)
    p = (wins + 1) / (tries + 2)
    want = [sum(math.comb(g, k) * q ** k * (1 - q) ** (g - k) for k in range(1, g)) for q in p]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  # An unseen family weighs most; a family that always or never resolves weighs little.
  w = mixed_outcome_prob(np.array([0.0, 0.0, 20.0]), np.array([0.0, 20.0, 20.0]), 4)
  assert w[0] == pytest.approx(1 - 2 / 16) and w[1] < 0.2 and w[2] < 0.2


def _tasks(spec: dict) -> list:
  """Fake synthetic tasks: {family: count}."""
  out = []
  for fam, n in spec.items():
    kind, level = fam.rsplit("-d", 1)
    out += [types.SimpleNamespace(difficulty={"kind": kind, "level": int(level)}, repo="synthetic")
            for _ in range(n)]
  return out


def test_family_stream_prefers_families_with_both_outcomes():
  """A simulated policy that never solves A, always solves C and solves B half the time: after the
  first draws (every family tried), B gets most of them; within a family no task repeats before
  all its tasks were drawn."""
  tasks = _tasks({"a-d1": 10, "b-d2": 10, "c-d1": 10})
  rate = {"a-d1": 0.0, "b-d2": 0.5, "c-d1": 1.0}
  s = FamilyStream([family_of(t) for t in tasks], seed=0, group_size=4)
  rng = np.random.default_rng(1)
  drawn = []
  for _ in range(60):
    for t in s.take(2):
      drawn.append(t)
      s.observe(t, list(rng.random(4) < rate[family_of(tasks[t])]))
  fams = [family_of(tasks[t]) for t in drawn]
  assert set(fams[:12]) == set(rate)  # each family tried early
  share_b = fams[20:].count("b-d2") / len(fams[20:])
  assert share_b > 0.5, share_b  # uniform draws would give 1/3; the weights give ~0.7
  b_tasks = [t for t in drawn if family_of(tasks[t]) == "b-d2"]
  assert sorted(b_tasks[:10]) == list(range(10, 20))  # one pass over B's tasks before any repeats


def test_streams_resume_where_they_stopped_and_refuse_a_mismatch():
  tasks = _tasks({"a-d1": 5, "b-d1": 3})
  fams = [family_of(t) for t in tasks]
  s = FamilyStream(fams, seed=7, group_size=2)
  for t in s.take(5):
    s.observe(t, [t % 2 == 0, True])
  st = json.loads(json.dumps(s.state()))  # the checkpoint's JSON item
  s2 = FamilyStream(fams, seed=7, group_size=2)
  s2.set_state(st)
  assert s2.take(7) == s.take(7)
  np.testing.assert_array_equal(s2.weights(), s.weights())
  with pytest.raises(ConfigError, match="rl.curriculum"):
    FamilyStream(fams[:-1], seed=7, group_size=2).set_state(st)
  with pytest.raises(ConfigError, match="rl.curriculum=family"):
    TaskStream(len(fams), seed=7).set_state(st)
  with pytest.raises(ConfigError, match="rl.curriculum"):
    s2.set_state(TaskStream(len(fams), seed=7).state())


def test_family_of_and_the_config_switch():
  t = types.SimpleNamespace(difficulty={"kind": "fix_bug", "level": 2}, repo="synthetic/fix_bug")
  assert family_of(t) == "fix_bug-d2"
  assert family_of(types.SimpleNamespace(difficulty={}, repo="attrs")) == "attrs"
  tasks = _tasks({"a-d1": 2, "b-d1": 2})
  cfg = load_config(None, ["rl.curriculum=family"])
  assert isinstance(make_stream(tasks, cfg), FamilyStream)
  assert isinstance(make_stream(tasks, load_config(None, [])), TaskStream)

"""Group advantages and pass@k statistics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from composer_jax.eval import bench
from composer_jax.rl import advantages as A

R = [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1]]


def test_mean_centred():
  # means 0.5, 1, 0.25
  want = [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [-0.25, -0.25, -0.25, 0.75]]
  np.testing.assert_allclose(A.group_advantages(R, std_norm=False), want, atol=1e-12)


def test_std_normalised():
  # sample std (ddof=1): group 0: sqrt(1/3) = 0.577350; group 2: sqrt(0.75/3) = 0.5; group 1: flat -> 0
  got = A.group_advantages(R, std_norm=True, eps=0.0)
  want = [[0.866025, -0.866025, -0.866025, 0.866025], [0, 0, 0, 0], [-0.5, -0.5, -0.5, 1.5]]
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert np.all(got[1] == 0.0)


def test_single_rollout_groups_and_bad_shape():
  np.testing.assert_array_equal(A.group_advantages([[3.0], [0.0]], std_norm=True), [[0.0], [0.0]])
  with pytest.raises(ValueError, match="n_groups"):
    A.group_advantages([1.0, 2.0], False)


def test_pass_stats_hand():
  # n=4, k=2: c=2: 1 - C(2,2)/C(4,2) = 5/6, pass^2 = 1/6; c=4: 1, 1; c=1: 1 - 3/6 = 1/2, pass^2 = 0
  got = A.group_pass_stats(np.array(R, bool), ks=(1, 2, 8))
  assert got["pass@2"] == pytest.approx((5 / 6 + 1 + 0.5) / 3, abs=1e-12)
  assert got["pass^2"] == pytest.approx((1 / 6 + 1) / 3, abs=1e-12)
  assert got["pass@1"] == pytest.approx(7 / 12) and got["pass_rate"] == pytest.approx(7 / 12)
  assert "pass@8" not in got  # k > group size: not estimable
  assert A.pass_at_k is bench.pass_at_k and A.pass_hat_k is bench.pass_hat_k  # one implementation


def _group(gid: int, outcomes: list[bool], malformed=(), passed=None) -> list:
  """``passed[i]``: episode i's right hidden checks of 4."""
  from types import SimpleNamespace

  from composer_jax.rl.trajectory import Rollout

  def grade(i, ok):
    return {"hidden_checks": {"passed": 4 if ok else (passed[i] if passed else 0), "total": 4},
            "report_found": True, "report_consistent": True}
  return [Rollout(f"t{gid}", gid, [], [], SimpleNamespace(flags=[], messages=[], resolved=ok,
                                                          reward=float(ok), grade=grade(i, ok)),
                  {"malformed_calls": 1} if i in malformed else {})
          for i, ok in enumerate(outcomes)]


def test_partial_credit_ranks_a_group_that_never_resolves():
  from composer_jax.config import load_config
  from composer_jax.rl import learner as L
  base = ["rl.tasks_per_step=2", "rl.group_size=3"]
  cfg = load_config(None, base + ["rl.partial_credit=0.4", "rl.dynamic_by=grade"])
  apart = _group(0, [False] * 3, passed=[1, 3, 1])  # shares 1/4, 3/4, 1/4 of 0.4
  alike = _group(1, [False] * 3, passed=[2, 2, 2], malformed=(0,))
  mixed = _group(2, [True, False, False], passed=[0, 2, 2])  # rewards 1, 0.2, 0.2
  assert [L.informative(g, cfg) for g in (apart, alike, mixed)] == [True, False, True]
  off = load_config(None, base)  # 0/1 grades: an unresolved group is all alike
  assert not L.informative(apart, off)
  stats = L.score_rollouts(L.regroup([apart, mixed]), cfg)
  np.testing.assert_allclose(stats["advantages"],
                             [-1 / 15, 2 / 15, -1 / 15, 1.6 / 3, -0.8 / 3, -0.8 / 3],
                             atol=1e-12)
  assert stats["pass_rate"] == pytest.approx(1 / 6)  # pass rates still count resolved episodes only


def test_dynamic_sampling_keeps_the_groups_that_teach_something():
  from composer_jax.config import load_config
  from composer_jax.rl import learner as L
  cfg = load_config(None, ["rl.tasks_per_step=2", "rl.group_size=3"])
  groups = [_group(0, [True] * 3), _group(1, [True, False, True]), _group(2, [False] * 3),
            _group(3, [False, False, True]), _group(4, [True, False, False])]
  flags = [L.informative(g, cfg) for g in groups]
  assert flags == [False, True, False, True, True]
  # One outcome, rewards apart by a shaping penalty: informative by reward, not by outcome (DAPO).
  shaped = _group(6, [False] * 3, malformed=(1,))
  assert cfg.rl.dynamic_by == "outcome" and not L.informative(shaped, cfg)
  by_reward = load_config(None, ["rl.tasks_per_step=2", "rl.group_size=3", "rl.dynamic_by=reward"])
  assert L.informative(shaped, by_reward)
  assert [L.informative(g, by_reward) for g in groups] == flags
  keep, good = L.dynamic_pick(groups, flags, cfg.rl.tasks_per_step)
  assert good == 2 and [g[0].task_id for g in keep] == ["t1", "t3"]  # the first two, in draw order
  flat = L.regroup(keep)
  assert [r.group for r in flat] == [0, 0, 0, 1, 1, 1]
  stats = L.score_rollouts(flat, cfg)
  np.testing.assert_allclose(stats["advantages"], [1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3])
  # None informative: the first tasks_per_step groups go to the learner (all advantages 0, so the
  # optimizer skips the update).
  dull = [groups[0], groups[2], _group(5, [True] * 3)]
  keep, good = L.dynamic_pick(dull, [L.informative(g, cfg) for g in dull], cfg.rl.tasks_per_step)
  assert good == 0 and [g[0].task_id for g in keep] == ["t0", "t2"]
  assert L.split_groups(L.regroup([groups[0], groups[2]]))[1][0].task_id == "t2"


def test_negative_weight_scales_only_the_below_mean_episodes():
  # means 0.5, 1, 0.25: the negative entries times 0.25, the positive ones and flat groups unchanged
  got = A.group_advantages(R, std_norm=False, neg_weight=0.25)
  want = [[0.5, -0.125, -0.125, 0.5], [0, 0, 0, 0], [-0.0625, -0.0625, -0.0625, 0.75]]
  np.testing.assert_allclose(got, want, atol=1e-12)
  # 0: only the episodes above their group's mean are reinforced; std_norm applies first
  got = A.group_advantages(R, std_norm=True, eps=0.0, neg_weight=0.0)
  np.testing.assert_allclose(got, [[0.866025, 0, 0, 0.866025], [0, 0, 0, 0], [0, 0, 0, 1.5]], atol=1e-6)
  np.testing.assert_array_equal(A.group_advantages(R, neg_weight=1.0), A.group_advantages(R))


def test_negative_weight_reaches_the_learner_and_keeps_informative_groups():
  """rl.adv_negative_weight=0: the learner's advantages keep only the above-mean episodes, and
  dynamic sampling still finds the same groups (a group with two grades has one above its mean)."""
  from composer_jax.config import load_config
  from composer_jax.rl import learner as L
  base = ["rl.tasks_per_step=2", "rl.group_size=3"]
  cfg = load_config(None, base + ["rl.adv_negative_weight=0.0"])
  groups = [_group(0, [True] * 3), _group(1, [True, False, True]), _group(2, [False] * 3),
            _group(3, [False, False, True])]
  assert [L.informative(g, cfg) for g in groups] == [L.informative(g, load_config(None, base))
                                                     for g in groups] == [False, True, False, True]
  stats = L.score_rollouts(L.regroup([groups[1], groups[3]]), cfg)
  np.testing.assert_allclose(stats["advantages"], [1 / 3, 0, 1 / 3, 0, 0, 2 / 3], atol=1e-12)

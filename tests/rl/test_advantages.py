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

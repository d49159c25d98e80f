"""pass@k and pass^k against exact integer combinatorics and brute-force enumeration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from composer_jax.eval.bench import (
  comb_ratio_reference,
  pass_at_k,
  pass_hat_k,
  summarize,
)


def test_against_exact_combinatorics():
  for n in range(1, 25):
    for c in range(n + 1):
      for k in range(1, n + 1):
        # float64 products vs exact integer binomials: agree to 1e-12
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb_ratio_reference(n - c, n, k), abs=1e-12)
        assert pass_hat_k(n, c, k) == pytest.approx(comb_ratio_reference(c, n, k), abs=1e-12)


def test_against_brute_force_subsets():
  for n, c in [(5, 2), (6, 3), (7, 1), (4, 4), (6, 0)]:
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(outcomes, k))
      assert pass_at_k(n, c, k) == pytest.approx(np.mean([any(s) for s in subsets]), abs=1e-12)
      assert pass_hat_k(n, c, k) == pytest.approx(np.mean([all(s) for s in subsets]), abs=1e-12)


def test_large_n_is_stable():
  assert pass_at_k(10_000, 1, 100) == pytest.approx(0.01, rel=1e-9)
  assert pass_hat_k(10_000, 9_999, 1) == pytest.approx(0.9999, rel=1e-12)
  assert 0.0 <= pass_at_k(1000, 500, 1000) <= 1.0
  with pytest.raises(ValueError):
    pass_at_k(3, 4, 1)


def test_summarize():
  rec = lambda ok, tok: {"reward": float(ok), "resolved": ok, "completion_tokens": tok,
                         "tool_calls": 2, "format_errors": 0, "wall_s": 1.0}
  s = summarize({"a": [rec(True, 10), rec(False, 30)], "b": [rec(False, 20), rec(False, 40)]}, [1, 2, 5])
  assert s["pass@1"] == pytest.approx(0.25) and s["pass@2"] == pytest.approx(0.5)
  assert s["pass^2"] == 0.0 and "pass@5" not in s  # k above n is left out
  assert s["mean_completion_tokens"] == 25 and s["per_task"]["a"]["c"] == 1
  assert math.isclose(s["mean_reward"], 0.25)

"""Reward terms against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from composer_jax.config import Config, ConfigError, RLConfig, validate
from composer_jax.rl import rewards as R


def test_concave_hand():
  # k=1, q=0.5, x=3: ((1+3)^0.5 - 1) / (1 * 0.5) = 2
  assert R.concave(3.0, 1.0, 0.5) == pytest.approx(2.0, abs=1e-12)
  # q=1: log(4) / 1 = 1.386294; q=0: linear, (4 - 1) / 1 = 3 = x; q=2: (1/4 - 1) / (1 * -1) = 0.75
  assert R.concave(3.0, 1.0, 1.0) == pytest.approx(math.log(4), abs=1e-12)
  assert R.concave(3.0, 1.0, 0.0) == pytest.approx(3.0, abs=1e-12)
  assert R.concave(3.0, 1.0, 2.0) == pytest.approx(0.75, abs=1e-12)
  # k -> 0 is x for every q; k=0.01, q=0.5, x=300: (sqrt(4) - 1) / 0.005 = 200
  assert R.concave(5.0, 0.0, 0.7) == 5.0
  assert R.concave(300.0, 0.01, 0.5) == pytest.approx(200.0, abs=1e-9)


def test_concave_near_one_is_stable():
  for q in (1 - 1e-9, 1 + 1e-9, 1 - 1e-13, 1 + 1e-15):
    assert R.concave(3.0, 1.0, q) == pytest.approx(math.log(4), rel=1e-7)
  assert R.concave(1e6, 1e-3, 1 - 1e-12) == pytest.approx(math.log1p(1e3) / 1e-3, rel=1e-8)


def test_concave_shape():
  x = np.linspace(0, 5000, 501)
  for k, q in [(0.01, 0.5), (0.001, 1.0), (0.01, 1.5), (0.1, 0.9)]:
    c = R.concave(x, k, q)
    assert c[0] == 0.0
    assert np.all(np.diff(c) > 0)  # increasing
    assert np.all(np.diff(c, 2) <= 1e-9)  # concave
    assert np.all(c <= x + 1e-9)  # below the linear cost, slope 1 at 0
  with pytest.raises(ValueError, match="x >= 0"):
    R.concave(-1.0, 0.1, 0.5)


COUNTS = {"reasoning_tokens": 100, "tool_call_tokens": 50, "tool_output_tokens": 200, "final_tokens": 30,
          "tool_calls": 3, "turns": 4}


def test_length_cost_hand():
  # 100*1 + 50*1 + 200*0.1 + 30*1 + 3*10 + 4*10 = 270
  assert R.length_cost(COUNTS, RLConfig()) == pytest.approx(270.0)
  assert R.length_cost({"turns": 2}, RLConfig(length_w_turns=2.5)) == 5.0
  with pytest.raises(KeyError, match="unknown"):
    R.length_cost({"tokens": 3}, RLConfig())


def test_length_penalty_hand():
  cfg = RLConfig(length_penalty=0.2, length_k=0.01, length_q=0.5, length_ref=1000)
  c_ref = (math.sqrt(11) - 1) / 0.005  # C(1000) = 463.324958
  # C(300) = 200; coef 0.2 * pass rate 0.75 * 200 / 463.325 = 0.0647493
  assert R.length_penalty(300, 0.75, cfg) == pytest.approx(0.2 * 0.75 * 200 / c_ref, abs=1e-12)
  assert R.length_penalty(300, 0.75, cfg) == pytest.approx(0.0647493, abs=1e-7)
  assert R.length_penalty(1000, 1.0, cfg) == pytest.approx(0.2)  # = coef at the reference
  assert R.length_penalty(300, 0.0, cfg) == 0.0  # no rollout solved it: hard, no penalty
  flat = RLConfig(length_penalty=0.2, length_by_difficulty=False)
  assert R.length_penalty(300, 0.0, flat) == pytest.approx(0.2 * 200 / c_ref, abs=1e-12)
  assert R.length_penalty(300, 0.75, RLConfig()) == 0.0  # coefficient 0: off


def test_shaping_hand():
  stats = {"malformed_calls": 2, "unknown_tools": 1, "repeated_commands": 3, "no_call_turns": 1,
           "turns": 9}
  # 2*0.05 + 1*0.05 + 3*0.02 + 1*0.05 = 0.26
  assert R.shaping_penalty(stats, RLConfig()) == pytest.approx(0.26, abs=1e-12)


def test_episode_reward_hand():
  cfg = RLConfig(length_penalty=0.2)
  stats = {"reasoning_tokens": 300, "malformed_calls": 2, "unknown_tools": 1, "repeated_commands": 3,
           "no_call_turns": 1}
  r, parts = R.episode_reward(1.0, False, stats, 0.75, cfg)
  assert parts["length_cost"] == 300 and parts["length_penalty"] == pytest.approx(0.0647493, abs=1e-7)
  assert r == pytest.approx(1 - 0.0647493 - 0.26, abs=1e-7)  # 0.6752507
  assert parts["hacked"] == 0 and parts["capped"] == 0 and parts["reward"] == r
  # a hack zeroes the grade; the penalties still apply (never above an honest failure)
  r, parts = R.episode_reward(1.0, True, stats, 0.75, cfg)
  assert r == pytest.approx(-0.3247493, abs=1e-7) and parts["hacked"] == 1 and parts["grade"] == 0
  # the cap: coef 1 -> 0.323747 + 0.26 = 0.583747 > 0.5 -> reward 1 - 0.5
  r, parts = R.episode_reward(1.0, False, stats, 0.75, RLConfig(length_penalty=1.0))
  assert r == pytest.approx(0.5) and parts["capped"] == 1
  assert parts["length_penalty"] + parts["shaping_penalty"] == pytest.approx(0.583747, abs=1e-6)


def test_resolved_always_beats_unresolved():
  rng = np.random.default_rng(0)
  cfg = RLConfig(length_penalty=2.0, length_q=0.3)
  for _ in range(200):
    def stats():
      return {k: int(rng.integers(0, 5000)) for k in R.LENGTH_KEYS} | \
          {k: int(rng.integers(0, 20)) for k in R.SHAPING_KEYS}
    p = float(rng.random())
    good, _ = R.episode_reward(1.0, False, stats(), p, cfg)
    bad, _ = R.episode_reward(0.0, False, stats(), p, cfg)
    assert good >= 1 - cfg.penalty_cap > 0 >= bad


def _details(hidden, checks=None, found=True, consistent=True):
  """Grade details: ``hidden`` (passed, total) hidden tests, ``checks`` (passed, total) hidden checks."""
  d = {"hidden": {"passed": hidden[0], "total": hidden[1]}, "report_found": found,
       "report_consistent": consistent, "fail_to_pass": {"passed": 1, "total": 3},
       "pass_to_pass": {"passed": 1, "total": 1}}
  if checks is not None:
    d["hidden_checks"] = {"passed": checks[0], "total": checks[1]}
  return d


def test_partial_credit_is_the_right_share_of_hidden_checks_and_never_reaches_a_resolved_episode():
  d = _details((0, 2), (3, 8))  # both hidden tests fail, 3 of their 8 values are right
  assert R.grade_value(d, True, 0.3) == 1.0
  assert R.grade_value(d, False, 0.0) == 0.0  # off: 0/1 grades
  assert R.grade_value(d, False, 0.3) == pytest.approx(0.3 * 3 / 8)
  # Report grading has no single checks: the share of hidden tests that pass.
  assert R.grade_value(_details((1, 2)), False, 0.3) == pytest.approx(0.15)
  # The visible test and the old one pass (FAIL_TO_PASS 1 of 3, PASS_TO_PASS 1 of 1), but no hidden
  # check does: nothing, since returning the visible tests' values would earn it.
  assert R.grade_value(_details((0, 2), (0, 8)), False, 0.3) == 0.0
  assert R.grade_value(_details((0, 0)), False, 0.3) == 0.0  # a task without hidden tests
  assert R.grade_value(_details((1, 2), (7, 8), consistent=False), False, 0.3) == 0.0  # tampered
  assert R.grade_value(_details((1, 2), (7, 8), found=False), False, 0.3) == 0.0  # no report
  assert R.grade_value({}, False, 0.3) == 0.0  # a grade that never ran
  # The largest partial credit the config allows, against the worst-penalised resolved episode.
  cfg = RLConfig(length_penalty=5.0, partial_credit=0.5)
  many = {k: 10 ** 6 for k in R.LENGTH_KEYS} | {k: 100 for k in R.SHAPING_KEYS}
  good, _ = R.episode_reward(R.grade_value(d, True, cfg.partial_credit), False, many, 1.0, cfg)
  best_bad, _ = R.episode_reward(R.grade_value(_details((1, 2), (7, 8)), False, cfg.partial_credit),
                                 False, {}, 1.0, cfg)
  assert good == pytest.approx(0.5) and best_bad == pytest.approx(0.5 * 7 / 8) and good > best_bad
  # A hacked episode earns no partial credit either: episode_reward zeroes its grade.
  r, parts = R.episode_reward(R.grade_value(d, False, 0.3), True, {}, 0.0, cfg)
  assert parts["grade"] == 0 and r == 0


def test_config_validation():
  for field, value in [("penalty_cap", 1.0), ("length_q", -0.5), ("length_ref", 0.0), ("is_clip", 1.0),
                       ("ppo_clip_low", 1.0), ("feedback_topk", 10 ** 9), ("partial_credit", 0.6),
                       ("partial_credit", -0.1)]:
    cfg = Config()
    setattr(cfg.rl, field, value)
    with pytest.raises(ConfigError, match=f"rl.{field}"):
      validate(cfg)

"""The episode reward: grade, minus a concave length penalty, minus behaviour shaping (plain Python).

Everything an episode's reward depends on is passed to ``episode_reward`` (grade, hack flag, counts,
the group's pass rate, the config), so a reward can be recomputed from a logged trajectory.

Length penalty (Composer 2): a concave cost of effort, steep for short efficient solutions and
flattening as effort grows, so a long hard solve is not punished much more than a medium one:
  C(x) = ((1 + k x)^(1-q) - 1) / (k (1 - q))       (q -> 1: log(1 + k x) / k;  k -> 0: x;  q = 0: x)
  penalty = length_penalty * s * C(x) / C(length_ref),  s = group pass rate if length_by_difficulty
x is a weighted sum of token kinds and counts (``length_cost``). Scaling by the group's pass rate
makes easy tasks (most rollouts pass) pay the most and tasks no rollout solves pay nothing.

Policy (our choice, documented in docs/rl.md): the penalties apply to every episode, resolved or
not (as Kimi k1.5 also charges long wrong answers), but their total is capped at ``rl.penalty_cap``
< 1, so with 0/1 grades a resolved episode always scores >= 1 - penalty_cap > 0 >= any unresolved
one: effort is traded off only among episodes with the same outcome. A reward-hack flag zeroes the
grade (the episode counts as unresolved) while the penalties still apply, so a hack never scores
above an honest failure of the same effort.

Partial credit (``rl.partial_credit = c``, 0 = off): an unresolved episode grades c x the share of
its task's hidden checks that saw the right value (values grading: each check is one input the agent
never saw), or of its hidden tests that pass (report grading), so a group that never resolves its
task can still rank its episodes. Only hidden tests count: a visible test can be passed by returning
the values it asserts, which would pay for overfitting the tests the agent reads. A task without
hidden tests, and a grade whose report was missing or inconsistent (tampering), earn none.
c <= 1 - penalty_cap keeps every resolved episode above every unresolved one.
"""

from __future__ import annotations

import math

import numpy as np

from composer_jax.config import RLConfig

LENGTH_KEYS = {"reasoning_tokens": "length_w_reasoning", "tool_call_tokens": "length_w_tool_call",
               "tool_output_tokens": "length_w_tool_output", "final_tokens": "length_w_final",
               "tool_calls": "length_w_calls", "turns": "length_w_turns"}
SHAPING_KEYS = {"malformed_calls": "penalty_malformed_call", "unknown_tools": "penalty_unknown_tool",
                "repeated_commands": "penalty_repeated_command", "no_call_turns": "penalty_no_call_turn"}


def concave(x, k: float, q: float):
  """C(x) = ((1 + kx)^(1-q) - 1) / (k(1-q)); a float for a scalar x, an array for an array.

  Written as expm1((1-q) log1p(kx)) / (k(1-q)), which is exact at q == 1 (log1p(kx)/k, taken
  directly) and stable next to it (expm1(a L) / a -> L without cancellation as a -> 0).
  """
  xa = np.asarray(x, dtype=np.float64)
  if np.any(xa < 0) or k < 0:
    raise ValueError(f"concave needs x >= 0 and k >= 0, got min x={xa.min()} k={k}")
  if k == 0:
    out = xa  # every member of the family is x as k -> 0
  else:
    lg = np.log1p(k * xa)
    a = 1.0 - q
    out = lg / k if a == 0 else np.expm1(a * lg) / (k * a)
  return float(out) if np.ndim(out) == 0 else out


def length_cost(counts: dict, cfg: RLConfig) -> float:
  """x = sum of the counts weighted by cfg.length_w_* (missing keys count 0)."""
  unknown = set(counts) - set(LENGTH_KEYS)
  if unknown:
    raise KeyError(f"length_cost: unknown count(s) {sorted(unknown)}; known: {sorted(LENGTH_KEYS)}")
  return float(sum(getattr(cfg, w) * float(counts.get(key, 0)) for key, w in LENGTH_KEYS.items()))


def length_penalty(x: float, pass_rate: float, cfg: RLConfig) -> float:
  """cfg.length_penalty * scale * C(x) / C(cfg.length_ref); scale = pass_rate if by difficulty."""
  if not cfg.length_penalty:
    return 0.0
  scale = float(pass_rate) if cfg.length_by_difficulty else 1.0
  ref = concave(cfg.length_ref, cfg.length_k, cfg.length_q)
  return float(cfg.length_penalty * scale * concave(x, cfg.length_k, cfg.length_q) / ref)


def shaping_penalty(stats: dict, cfg: RLConfig) -> float:
  """Sum of count * per-event penalty for malformed calls, unknown tools, repeats, call-less turns."""
  return float(sum(getattr(cfg, p) * float(stats.get(key, 0)) for key, p in SHAPING_KEYS.items()))


def grade_value(grade: dict, resolved: bool, partial_credit: float) -> float:
  """1 if resolved; else ``partial_credit`` x the right share of the hidden checks (``grade`` is
  ``grading.grade``'s details: ``hidden_checks`` under values grading, else the ``hidden`` tests),
  0 without hidden tests or where the report was missing or inconsistent."""
  if resolved:
    return 1.0
  if not partial_credit or not (grade.get("report_found") and grade.get("report_consistent")):
    return 0.0
  hidden = grade.get("hidden_checks") or grade.get("hidden", {})
  total = hidden.get("total", 0)
  return partial_credit * hidden.get("passed", 0) / total if total else 0.0


def episode_reward(grade_reward: float, hacked: bool, stats: dict, pass_rate: float,
                   cfg: RLConfig) -> tuple[float, dict]:
  """reward = grade - min(length penalty + shaping, penalty_cap); a hack zeroes the grade.

  ``stats`` holds the ``length_cost`` counts and the ``shaping_penalty`` counts (other keys are
  ignored). ``pass_rate`` is the resolved fraction of this task's rollout group. Returns the reward
  and its parts (grade, hacked, length_cost, length_penalty, shaping_penalty, penalty (after the
  cap), capped, reward).
  """
  grade = 0.0 if hacked else float(grade_reward)
  x = length_cost({k: v for k, v in stats.items() if k in LENGTH_KEYS}, cfg)
  lp = length_penalty(x, pass_rate, cfg)
  sp = shaping_penalty(stats, cfg)
  total = lp + sp
  pen = min(total, cfg.penalty_cap)
  reward = grade - pen
  parts = {"grade": grade, "hacked": int(bool(hacked)), "length_cost": x, "length_penalty": lp,
           "shaping_penalty": sp, "penalty": pen, "capped": int(total > cfg.penalty_cap),
           "reward": reward}
  if not math.isfinite(reward):
    raise ValueError(f"non-finite reward from {parts}")
  return reward, parts

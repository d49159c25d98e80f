"""Benchmark statistics: unbiased pass@k, pass^k, and the per-run summary.

From n samples of a task with c correct, pass@k = 1 - C(n-c, k) / C(n, k) (the chance that at least
one of k samples drawn without replacement is correct) and pass^k = C(c, k) / C(n, k) (the chance
that all k are). Both are averaged over tasks. Computed as running products so large n never
overflows.
"""

from __future__ import annotations

import math

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_hat_k(n: int, c: int, k: int) -> float:
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
  if c < k:
    return 0.0
  # C(c, k) / C(n, k) = prod_{i=0}^{k-1} (c - i) / (n - i)
  i = np.arange(k, dtype=np.float64)
  return float(np.prod((c - i) / (n - i)))


def summarize(results: dict[str, list[dict]], ks: list[int]) -> dict:
  """``results``: instance id -> one record per sample (reward, resolved, tokens, calls, wall...)."""
  if not results:
    raise ValueError("no results to summarise")
  n_per = {t: len(r) for t, r in results.items()}
  n = min(n_per.values())
  ks = sorted({k for k in ks if 1 <= k <= n} | {1})
  out: dict = {"tasks": len(results), "samples_per_task": n}
  for k in ks:
    out[f"pass@{k}"] = float(np.mean([pass_at_k(len(r), sum(x["resolved"] for x in r), k)
                                      for r in results.values()]))
    out[f"pass^{k}"] = float(np.mean([pass_hat_k(len(r), sum(x["resolved"] for x in r), k)
                                      for r in results.values()]))
  flat = [x for r in results.values() for x in r]
  out["mean_reward"] = float(np.mean([x["reward"] for x in flat]))
  out["mean_completion_tokens"] = float(np.mean([x["completion_tokens"] for x in flat]))
  out["mean_tool_calls"] = float(np.mean([x["tool_calls"] for x in flat]))
  out["mean_format_errors"] = float(np.mean([x["format_errors"] for x in flat]))
  out["mean_wall_s"] = float(np.mean([x["wall_s"] for x in flat]))
  out["total_wall_s"] = float(sum(x["wall_s"] for x in flat))
  out["hacks_flagged"] = int(sum(x.get("hack", False) for x in flat))
  out["per_task"] = {t: {"n": len(r), "c": int(sum(x["resolved"] for x in r)),
                         "mean_completion_tokens": float(np.mean([x["completion_tokens"] for x in r]))}
                     for t, r in sorted(results.items())}
  return out


def comb_ratio_reference(a: int, b: int, k: int) -> float:
  """C(a, k) / C(b, k) with exact integers (a test reference)."""
  return math.comb(a, k) / math.comb(b, k) if math.comb(b, k) else 0.0

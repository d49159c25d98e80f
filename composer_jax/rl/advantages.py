"""Group-relative advantages (GRPO) and the pass@k / pass^k statistics of a rollout group.

Each task is rolled out ``rl.group_size`` times; a rollout's advantage is its reward minus the mean
reward of its group, optionally divided by the group's standard deviation (GRPO). Without the std
division (Dr. GRPO's choice, our default) easy and hard groups keep their natural scale; with it every
group with any spread contributes gradients of the same size. A group whose rewards are all equal
carries no signal and gets advantage 0 exactly. ``neg_weight`` scales the negative advantages after
centring: 1 is GRPO; 0 reinforces only the episodes that beat their group's mean (the reward-filtered
self-training of RAFT / ReST, with a baseline), which sharpens the policy toward its rewarded modes
and so targets pass@1; between, a weighting in the manner of W-REINFORCE (Zhu et al. 2025, who
weigh the positive side instead; only the ratio matters to AdamW). Self-summarized episodes give
their episode's advantage to every segment (ReSum-GRPO): index the result with each segment's
episode.
"""

from __future__ import annotations

import numpy as np

# One implementation of the unbiased estimators: the evaluator's (running products, no overflow).
from composer_jax.eval.bench import pass_at_k, pass_hat_k


def group_advantages(rewards, std_norm: bool = False, eps: float = 1e-6, ddof: int = 1,
                     neg_weight: float = 1.0) -> np.ndarray:
  """[n_groups, G] rewards -> [n_groups, G] advantages (float64).

  A = r - mean_g(r), and with ``std_norm`` A / (std_g(r) + eps); then each A < 0 times
  ``neg_weight``. The std is the sample std (``ddof=1``, as GRPO implementations compute it with
  torch.std); a group with std <= eps (all rewards equal, or G == 1) gives 0.
  """
  r = np.asarray(rewards, dtype=np.float64)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [n_groups, group_size], got shape {r.shape}")
  adv = r - r.mean(axis=1, keepdims=True)
  g = r.shape[1]
  std = r.std(axis=1, ddof=ddof, keepdims=True) if g > ddof else np.zeros((r.shape[0], 1))
  flat = std <= eps
  if std_norm:
    adv = adv / np.where(flat, 1.0, std + eps)
  adv = np.where(adv < 0, neg_weight * adv, adv)
  return np.where(flat, 0.0, adv)


def group_pass_stats(resolved, ks=(1,)) -> dict:
  """Mean over groups of unbiased pass@k and pass^k from a [n_groups, G] boolean array.

  k larger than the group size is skipped (not estimable from G samples).
  """
  r = np.asarray(resolved, dtype=bool)
  n = r.shape[1]
  out = {"pass_rate": float(r.mean()) if r.size else 0.0}
  for k in ks:
    if not 1 <= k <= n:
      continue
    out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in r.sum(axis=1)]))
    out[f"pass^{k}"] = float(np.mean([pass_hat_k(n, int(c), k) for c in r.sum(axis=1)]))
  return out

"""Score vs mean completion tokens (one point per task and one for the run)."""

from __future__ import annotations


def plot_score_vs_tokens(summary: dict, path: str, title: str = "") -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
  per = summary.get("per_task", {})
  if per:
    xs = [v["mean_completion_tokens"] for v in per.values()]
    ys = [v["c"] / max(v["n"], 1) for v in per.values()]
    ax.scatter(xs, ys, s=14, alpha=0.5, label="tasks")
  ax.scatter([summary["mean_completion_tokens"]], [summary["pass@1"]], s=80, marker="*",
             color="crimson", label=f"run: pass@1={summary['pass@1']:.3f}")
  ax.set_xlabel("mean completion tokens")
  ax.set_ylabel("score (pass@1)")
  ax.set_ylim(-0.05, 1.05)
  ax.set_title(title or "score vs mean completion tokens")
  ax.legend(loc="best", fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path

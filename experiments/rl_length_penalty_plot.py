"""Plot the concave length penalty for a few (k, q): writes docs/length_penalty.png.

Left: the penalty at coefficient 1 and pass rate 1, C(x) / C(x_ref) with x_ref = 1000 (so every curve
passes through 1 at the reference effort). Right: its slope, the marginal price of one more unit of
effort, (1 + k x)^-q / C(x_ref): high for short solutions, falling as effort grows (q > 0).
Run: python experiments/rl_length_penalty_plot.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from composer_jax.rl.rewards import concave

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "length_penalty.png")
REF = 1000.0
CURVES = [(0.01, 0.0), (0.01, 0.5), (0.01, 1.0), (0.01, 1.5), (0.001, 0.5), (0.1, 0.5)]


def main(out: str = OUT) -> str:
  x = np.linspace(0, 5000, 1001)
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
  for k, q in CURVES:
    ref = concave(REF, k, q)
    label = f"k={k:g}, q={q:g}" + (" (linear)" if q == 0 else " (log)" if q == 1 else "")
    a.plot(x, concave(x, k, q) / ref, label=label)
    b.plot(x, (1 + k * x) ** (-q) / ref, label=label)
  a.axvline(REF, color="gray", lw=0.8, ls=":")
  a.axhline(1.0, color="gray", lw=0.8, ls=":")
  a.set(xlabel="weighted effort x (sum of rl.length_w_* x counts)", ylabel="C(x) / C(x_ref)",
        title="length penalty (coef 1, pass rate 1)", ylim=(0, 3))
  b.set(xlabel="weighted effort x", ylabel="dC/dx / C(x_ref)  (log scale)", yscale="log",
        title="marginal penalty per unit of effort")
  a.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(out), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


if __name__ == "__main__":
  print(main())

"""Loss gap of the low-precision MoE recipes against full precision on the real tiny model
(configs/tiny.yaml, shrunk to 2 layers / vocab 256) over a short run; writes the curves.

  PYTHONPATH=. python experiments/kernels_lowp_parity.py [--steps 100]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from experiments.common import write_result
from tests.kernels.lowp_train import train_curve


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=64)
  args = ap.parse_args(argv)
  curves, secs = {}, {}
  for p in ("bf16", "mxfp8", "nvfp4"):
    t0 = time.perf_counter()
    curves[p] = train_curve(p, args.steps, batch=args.batch, seq=args.seq)
    secs[p] = time.perf_counter() - t0
  ref = curves["bf16"]
  tail = max(args.steps // 5, 1)
  gaps = {}
  for p in ("mxfp8", "nvfp4"):
    d = curves[p] - ref
    gaps[p] = {"mean_abs_gap": float(np.abs(d).mean()), "max_abs_gap": float(np.abs(d).max()),
               "final_tail_mean_gap": float(d[-tail:].mean()),
               "final_tail_rel_gap": float(d[-tail:].mean() / ref[-tail:].mean())}
    print(f"{p}: mean |gap| {gaps[p]['mean_abs_gap']:.4f}  max {gaps[p]['max_abs_gap']:.4f}  "
          f"last-{tail} mean gap {gaps[p]['final_tail_mean_gap']:+.4f} "
          f"({100 * gaps[p]['final_tail_rel_gap']:+.2f} %)")
  print(f"bf16 CE {ref[0]:.3f} -> {ref[-tail:].mean():.3f}")
  write_result("kernels_lowp_parity", {
      "setup": {"config": "configs/tiny.yaml (n_layers=2, vocab=256, mtp off, gmm_impl=sorted)",
                "steps": args.steps, "batch": args.batch, "seq": args.seq, "optimizer": "adam 3e-3"},
      "gaps": gaps, "curves": {k: v.tolist() for k, v in curves.items()}, "seconds": secs,
  })
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Interleaved A/B of train-step variants in one process (ratios that survive a loaded machine).

Every variant (config overrides on top of --config and model.mtp_depths=0) is built and compiled
first, then the steps run in turns, one step of each per round; each variant's median is compared
with the first one's.

  python experiments/train_ab.py --rounds 4 base: chunk0:train.loss_chunk=0 blk256:model.attention_block=256
(a variant is NAME:OVERRIDE[,OVERRIDE...]; an empty override list is the config as it is)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.train_bench import synthetic_batch


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default=os.path.join(ROOT, "configs/bench.yaml"))
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("variants", nargs="+")
  args = ap.parse_args()
  import jax
  import numpy as np

  from composer_jax.config import load_config
  from composer_jax.train.loop import build_trainer, put_batch
  runs = {}
  for spec in args.variants:
    name, _, ov = spec.partition(":")
    cfg = load_config(args.config, ["model.mtp_depths=0"] + [o for o in ov.split(",") if o])
    tr = build_trainer(cfg)
    batch = put_batch(tr, synthetic_batch(cfg))
    holder = {"state": tr.state}

    def step(tr=tr, batch=batch, holder=holder):
      holder["state"], m = tr.step_fn(holder["state"], batch)
      return m["loss"]

    t0 = time.perf_counter()
    loss = float(jax.block_until_ready(step()))
    print(f"{name}: compiled + first step {time.perf_counter() - t0:.1f}s, loss {loss:.6f}", flush=True)
    runs[name] = (step, [])
  for r in range(args.rounds):
    for name, (step, times) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(step())
      times.append(time.perf_counter() - t0)
    print(f"round {r}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, (_, t) in runs.items()), flush=True)
  base = next(iter(runs))
  ref = float(np.median(runs[base][1]))
  for name, (_, times) in runs.items():
    med = float(np.median(times))
    print(f"{name}: median {med:.2f}s  speedup vs {base} {ref / med:.3f}x  (per round: "
          + ", ".join(f"{runs[base][1][i] / t:.3f}" for i, t in enumerate(times)) + ")")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Learner row layouts: one segment a row (padded) against segments packed into longer rows.

The RL update of configs/tiny.yaml (the train step with the RL loss, router replay, f32) on the
same segments laid out four ways:

- ``one_a_row_fixed``: one segment a row, ``tasks_per_step x group_size`` rows (the row count the
  unpacked learner fixes), each padded to the length bucket of the longest (``rl.pack=false``);
- ``one_a_row``: the same with as many rows as segments (rounded up to 4), which would recompile
  for every new count;
- ``packed_<L>``: first-fit decreasing into rows of L tokens, a power-of-two row count
  (``rl.pack=true`` packs into rows of ``rl.max_context``, 2048 on the tiny config).

Segments are 300-900 tokens (the tiny run logs ~520-600 a segment), 40 % of them generated.
Reported: the median seconds of one update after a warm-up that compiles it, the compile
seconds, padding (1 - tokens / row slots), and each layout's time over ``one_a_row_fixed``'s.

    python -m experiments.rl_learner_rows [--segments 8 20 32] [--iters 3]
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import numpy as np

from composer_jax.config import load_config
from composer_jax.rl import learner as L
from composer_jax.train.loop import build_trainer, put_batch
from experiments.common import write_result


def segments(n: int, cfg, seed: int, lo: int = 300, hi: int = 900) -> list[L.Row]:
  """n RL segments of lo..hi tokens, 40 % of them generated after a 200-token prompt."""
  rs = np.random.RandomState(seed)
  m = cfg.model
  out = []
  for i in range(n):
    k = int(rs.randint(lo, hi + 1))
    mask = (rs.rand(k) < 0.4).astype(np.float32)
    mask[:200] = 0  # the prompt
    out.append(L.Row(tokens=rs.randint(1, m.vocab_size, k).astype(np.int32),
                     experts=rs.randint(0, m.n_routed_experts, (k, m.n_moe_layers, m.n_experts_per_tok)
                                        ).astype(np.int32),
                     loss_mask=mask, sampler_logp=np.where(mask > 0, -1.0, 0.0).astype(np.float32),
                     advantage=float(rs.choice([-1.0, 1.0]))))
  return out


def layouts(rows: list[L.Row], cfg) -> dict:
  m, rl = cfg.model, cfg.rl
  lengths = [len(r.tokens) for r in rows]
  pack = lambda n_rows, length, bins=None: L.pack_rows(rows, n_rows, length, m.n_moe_layers,
                                                       m.n_experts_per_tok, 0, bins)
  longest = L.bucket(max(lengths), rl.max_context)
  fixed = L.row_count(len(rows), rl.tasks_per_step * rl.group_size)
  out = {"one_a_row_fixed": pack(fixed, longest), "one_a_row": pack(L.row_count(len(rows), 4), longest)}
  for length in (1024, 2048):
    bins = L.first_fit(lengths, length)
    out[f"packed_{length}"] = pack(1 << math.ceil(math.log2(len(bins))), length, bins)
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--segments", type=int, nargs="+", default=[8, 20, 32])
  ap.add_argument("--iters", type=int, default=3)
  args = ap.parse_args()
  cfg = load_config("configs/tiny.yaml", ["rl.tasks_per_step=8", "rl.group_size=4", "train.progress=false"])
  tr = build_trainer(cfg, loss_fn=L.make_rl_loss(cfg))
  results = {}
  for n in args.segments:
    rows = segments(n, cfg, seed=n)
    tokens = sum(len(r.tokens) for r in rows)
    for name, batch in layouts(rows, cfg).items():
      shape = batch["tokens"].shape
      dev = put_batch(tr, batch)
      t0 = time.perf_counter()
      tr.state, out = tr.step_fn(tr.state, dev)
      jax.block_until_ready(out)
      compile_s = time.perf_counter() - t0
      times = []
      for _ in range(args.iters):
        t0 = time.perf_counter()
        tr.state, out = tr.step_fn(tr.state, dev)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
      rec = {"rows": shape[0], "row_length": shape[1], "padding": 1 - tokens / (shape[0] * shape[1]),
             "step_s": float(np.median(times)), "first_call_s": compile_s}
      results.setdefault(f"segments_{n}", {})[name] = rec
      print(f"{n:3d} segments {name:16s} {shape[0]:3d} x {shape[1]:5d}  padding {rec['padding']:.2f}  "
            f"step {rec['step_s']:.2f} s  first call {compile_s:.1f} s", flush=True)
    base = results[f"segments_{n}"]["one_a_row_fixed"]["step_s"]
    for rec in results[f"segments_{n}"].values():
      rec["over_one_a_row_fixed"] = rec["step_s"] / base
  write_result("rl_learner_rows", {"config": "configs/tiny.yaml (f32, router replay)",
                                   "segment_tokens": "300-900, 40 % generated", "iters": args.iters,
                                   "results": results})


if __name__ == "__main__":
  main()

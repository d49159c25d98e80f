"""Blockwise attention's visit plans per batch row (``model.attention_rows``) on the RL update.

The main job's RL learner trains one segment a row, right-padded to the longest segment's length
bucket: a step of configs/tiny.yaml is 40 rows (32 segments and 8 SFT chats) of 768-1280 tokens,
filled 0.53-0.87 (``learner_fill`` in DIR/rl/metrics.jsonl). Attention is most of that update (the
model is 128 wide, the rows are ~1000 long), and with one visit plan for the whole batch every row
pays for the block pairs of the longest. With a plan per row, each row visits only its own causal
pairs (padding attends to nothing).

Timed: one RL update (the train step with the RL loss and router replay, f32) on 40 right-padded
rows of 1280 tokens whose segments are ``--lo``..``--hi`` tokens, and blockwise attention's
fwd+bwd alone on the same layout ([40, 1280, 4 heads, 48 | 32]), for each ``--rows``; the median of
``--iters`` calls after one that compiles, and each over the one-plan-per-batch figure.

    python -m experiments.attention_rows [--rows 40 8 1] [--iters 3]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import load_config
from composer_jax.model import attention as A
from composer_jax.rl import learner as L
from composer_jax.train.loop import build_trainer, put_batch
from experiments.common import write_result
from experiments.rl_learner_rows import segments

N_ROWS, LENGTH = 40, 1280


def median_s(fn, iters: int) -> tuple[float, float]:
  """(median seconds of ``iters`` calls, seconds of the first call, which compiles)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), first


def measure(rows: int, args) -> tuple[dict, float]:
  """One ``model.attention_rows`` setting: its timings, and the batch's fill."""
  cfg = load_config("configs/tiny.yaml", ["rl.tasks_per_step=8", "rl.group_size=5",
                                          "train.progress=false", f"model.attention_rows={rows}"])
  m = cfg.model
  segs = segments(N_ROWS, cfg, 0, args.lo, args.hi)
  batch = L.pack_rows(segs, N_ROWS, LENGTH, m.n_moe_layers, m.n_experts_per_tok, 0)
  tr = build_trainer(cfg, loss_fn=L.make_rl_loss(cfg))
  dev = put_batch(tr, batch)

  def update():
    tr.state, out = tr.step_fn(tr.state, dev)
    return out

  step_s, first_s = median_s(update, args.iters)
  seg = jnp.asarray(batch["segment_ids"])
  r = np.random.default_rng(0)
  q = jnp.asarray(r.normal(size=(N_ROWS, LENGTH, m.n_heads, m.qk_nope_dim + m.qk_rope_dim)) * 0.3,
                  jnp.float32)
  v = jnp.asarray(r.normal(size=(N_ROWS, LENGTH, m.n_heads, m.v_head_dim)), jnp.float32)
  attn = jax.jit(jax.grad(lambda q, k, v: A.blockwise_attention(
      q, k, v, seg, 0.1, block=m.attention_block, rows=rows)[0].sum(), argnums=(0, 1, 2)))
  attn_s, _ = median_s(lambda: attn(q, q, v), args.iters)
  fill = sum(len(s.tokens) for s in segs) / (N_ROWS * LENGTH)
  return {"update_s": step_s, "update_first_call_s": first_s, "attention_fwd_bwd_s": attn_s}, fill


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, nargs="+", default=[N_ROWS, 8, 1])
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--lo", type=int, default=300)
  ap.add_argument("--hi", type=int, default=1250)
  args = ap.parse_args()
  results, fill = {}, 0.0
  for rows in args.rows:
    rec, fill = measure(rows, args)
    results[f"rows_{rows}"] = rec
    print(f"attention_rows {rows:3d}: update {rec['update_s']:.2f} s (first call "
          f"{rec['update_first_call_s']:.1f} s), attention fwd+bwd {rec['attention_fwd_bwd_s']:.3f} s",
          flush=True)
  base = results[f"rows_{args.rows[0]}"]
  for rec in results.values():
    rec["update_over_first"] = rec["update_s"] / base["update_s"]
    rec["attention_over_first"] = rec["attention_fwd_bwd_s"] / base["attention_fwd_bwd_s"]
  write_result("attention_rows", {
      "config": "configs/tiny.yaml (f32, router replay, attention_block 128)",
      "batch": f"{N_ROWS} rows x {LENGTH}, one segment a row, segments {args.lo}-{args.hi} tokens",
      "fill": fill, "iters": args.iters, "ratios_over": f"rows_{args.rows[0]}", "results": results})


if __name__ == "__main__":
  main()

"""Compile time of a train step against depth: the Python loop of layers against the scanned stack.

For each depth (default 4, 16, 61 layers: 1 dense lead layer, the rest MoE, one MTP depth) and each
layout (``model.scan_layers`` false / true), a reduced-width Kimi-K2-shaped model (d_model 256,
8 experts top-2, vocab 2048, remat dots_no_batch as in kimi-k2.yaml) is lowered and compiled as
``jit(value_and_grad(lm_loss of the forward))`` on abstract parameters (nothing is allocated or
run). Reported: lowering (trace + StableHLO) and XLA compile seconds, and for each layout the
ratio of its time at the deepest depth to its time at the shallowest. The goal of the scanned
layout: compile at 61 layers <= 1.5x compile at 4.

  python -m experiments.scan_compile [--depths 4 16 61] [--repeats 1] [--note "..."]
Writes experiments/results/scan_compile.json.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import load_config
from composer_jax.model import abstract_model, lm_loss
from experiments.common import write_result

WIDTH = ["model.d_model=256", "model.dense_ffn_dim=512", "model.moe_ffn_dim=128",
         "model.n_routed_experts=8", "model.n_experts_per_tok=2", "model.n_group=1",
         "model.topk_group=1", "model.n_heads=4", "model.q_lora_rank=128", "model.kv_lora_rank=128",
         "model.vocab_size=2048", "model.mtp_depths=1", "model.remat=dots_no_batch",
         "model.n_dense_layers=1"]
BATCH, SEQ = 2, 128


def measure(n_layers: int, scan: bool) -> dict:
  cfg = load_config("configs/tiny.yaml", WIDTH + [f"model.n_layers={n_layers}",
                                                  f"model.scan_layers={str(scan).lower()}"])
  graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
  tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)

  def loss(params, rest, tokens):
    out = nnx.merge(graphdef, params, rest)(tokens)
    return lm_loss(out, tokens, None, cfg.model)[0]

  step = jax.jit(jax.value_and_grad(loss))  # a fresh function: nothing cached from another run
  t0 = time.perf_counter()
  lowered = step.lower(params, rest, tokens)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return {"n_layers": n_layers, "scan_layers": scan, "lower_s": t1 - t0, "compile_s": t2 - t1,
          "total_s": t2 - t0}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--depths", type=int, nargs="+", default=[4, 16, 61])
  ap.add_argument("--repeats", type=int, default=1, help="keep the fastest of N (load noise)")
  ap.add_argument("--note", default="")
  args = ap.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  measure(min(args.depths), True)  # warm-up: the process's first compile also loads XLA's pieces
  load_before = os.getloadavg()
  rows = []
  for scan in (True, False):
    for n in args.depths:
      best = min((measure(n, scan) for _ in range(args.repeats)), key=lambda r: r["total_s"])
      rows.append(best)
      print(best, flush=True)
  load_after = os.getloadavg()
  ratios = {}
  lo, hi = min(args.depths), max(args.depths)
  for scan in (True, False):
    name = "scan" if scan else "loop"
    by = {r["n_layers"]: r for r in rows if r["scan_layers"] == scan}
    for key in ("compile_s", "total_s"):
      ratios[f"{name}_{key}_{hi}_over_{lo}"] = by[hi][key] / by[lo][key]
  at_hi = {r["scan_layers"]: r for r in rows if r["n_layers"] == hi}
  ratios[f"loop_over_scan_total_s_at_{hi}"] = at_hi[False]["total_s"] / at_hi[True]["total_s"]
  for k, v in ratios.items():
    print(f"{k}: {v:.2f}")
  note = (f"taken under load: 1-minute load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after, on a {os.cpu_count()}-core machine shared with other work"
          + (f"; {args.note}" if args.note else ""))
  write_result("scan_compile", {
      "setup": {"base": "configs/tiny.yaml", "overrides": WIDTH, "batch": BATCH, "seq_len": SEQ,
                "step": "jit(value_and_grad(lm_loss)) lowered and compiled on abstract params",
                "repeats": args.repeats, "goal": "scan compile at 61 layers <= 1.5x at 4"},
      "rows": rows, "ratios": ratios, "note": note})


if __name__ == "__main__":
  main()

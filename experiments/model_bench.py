"""Forward+backward throughput of configs/bench.yaml and the decode cache footprint.

Prints tokens/s, model FLOP/s and their ratio to this machine's measured matmul FLOP/s (same run),
and the latent cache bytes per token per layer against expanded per-head K/V. Writes
experiments/results/model_bench.json.

  python -m experiments.model_bench [--batch 4] [--seq 512] [overrides ...]
"""

from __future__ import annotations

import argparse

import jax
from flax import nnx

from composer_jax.config import load_config
from composer_jax.model import build_model, flops_per_token, lm_loss
from composer_jax.model.cache import cache_elements_per_token_per_layer
from experiments.common import matmul_peak_flops, time_fn, write_result


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="configs/bench.yaml")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args()
  cfg = load_config(args.config, [f"data.seq_len={args.seq}"] + args.overrides)
  model = build_model(cfg)
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (args.batch, args.seq), 0, cfg.model.vocab_size)

  @jax.jit
  def fwd_bwd(state, tokens):
    def loss_fn(s):
      return lm_loss(nnx.merge(graphdef, s)(tokens), tokens, None, cfg.model)[0]
    return jax.value_and_grad(loss_fn)(state)

  pn = 8192 if jax.default_backend() == "gpu" else 2048  # a GPU needs a big product to reach its peak
  peak_before = matmul_peak_flops(pn, dtype=cfg.model.compute_dtype)
  sec = time_fn(fwd_bwd, state, tokens, warmup=1, iters=args.iters)
  # this 2-core machine's matmul rate swings 120-185 GFLOP/s between minutes: measure it on both
  # sides of the step and divide by the higher (the conservative ratio)
  peak = max(peak_before, matmul_peak_flops(pn, dtype=cfg.model.compute_dtype))
  n_tok = args.batch * args.seq
  tok_s = n_tok / sec
  model_flops = flops_per_token(cfg, args.seq) * tok_s
  k2 = load_config("configs/kimi-k2.yaml").model
  elems = cache_elements_per_token_per_layer(k2)
  expanded = k2.n_heads * (k2.qk_nope_dim + k2.v_head_dim)
  res = {
      "config": args.config, "batch": args.batch, "seq_len": args.seq,
      "gmm_impl": cfg.model.gmm_impl, "compute_dtype": cfg.model.compute_dtype,
      "step_seconds": sec, "tokens_per_s": tok_s, "model_flops_per_s": model_flops,
      "matmul_peak_flops_per_s": peak, "matmul_peak_flops_before_step": peak_before,
      "mfu_vs_measured_peak": model_flops / peak,
      "kimi_k2_cache_elements_per_token_per_layer": elems,
      "kimi_k2_cache_bytes_per_token_per_layer_bf16": 2 * elems,
      "kimi_k2_expanded_kv_elements_per_token_per_layer": expanded,
      "cache_reduction_factor": expanded / elems,
  }
  print(f"fwd+bwd {args.config} b={args.batch} s={args.seq}: {tok_s:,.0f} tokens/s, "
        f"{model_flops / 1e9:.1f} GFLOP/s = {100 * model_flops / peak:.1f}% of measured matmul peak "
        f"({peak / 1e9:.1f} GFLOP/s)")
  print(f"K2 decode cache: {elems} elements ({2 * elems} B bf16) per token per layer vs {expanded} "
        f"expanded ({expanded / elems:.1f}x)")
  # a GPU run keeps its own file beside the CPU figures
  write_result("model_bench" if jax.default_backend() == "cpu" else f"model_bench_{jax.default_backend()}", res)


if __name__ == "__main__":
  main()

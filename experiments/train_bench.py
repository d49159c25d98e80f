"""Training throughput and evidence of learning.

1. Our jitted train step on configs/bench.yaml: tokens/s, and model FLOP/s divided by this machine's
   measured matmul FLOP/s (same run).
2. The same config's training step (forward, backward, AdamW) in HF transformers'
   DeepseekV3ForCausalLM on PyTorch CPU, measured in the same run: our tokens/s ÷ its tokens/s.
   HF has no MTP training path, so the ratio is taken with model.mtp_depths=0 for both; our step
   with the config's MTP depth is reported too.
3. Held-out bits per byte before and after a short run of configs/tiny.yaml.

  python experiments/train_bench.py [--iters 3] [--tiny-steps 60] [--skip-hf] [--with-mtp] [k=v ...]
Writes experiments/results/train_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.common import matmul_peak_flops, time_fn, write_result


def synthetic_batch(cfg, seed: int = 0) -> dict:
  """Random tokens, two packed documents per row (segment ids and positions like real batches)."""
  import numpy as np

  from composer_jax.data.pipeline import target_mask
  b, s = cfg.data.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(seed)
  seg = np.where(np.arange(s) < s // 2, 1, 2)[None].repeat(b, 0).astype(np.int32)
  pos = np.where(seg == 1, np.arange(s), np.arange(s) - s // 2).astype(np.int32)
  return {"tokens": rng.integers(0, cfg.model.vocab_size, (b, s)).astype(np.int32),
          "segment_ids": seg, "positions": pos, "loss_mask": target_mask(seg)}


def bench_ours(cfg, iters: int) -> dict:
  import jax

  from composer_jax.model import count_params, flops_per_token
  from composer_jax.train.loop import build_trainer, put_batch
  tr = build_trainer(cfg)
  batch = put_batch(tr, synthetic_batch(cfg))
  holder = {"state": tr.state}

  def step():
    holder["state"], m = tr.step_fn(holder["state"], batch)
    return m["loss"]

  t0 = time.perf_counter()
  jax.block_until_ready(step())
  compile_s = time.perf_counter() - t0
  sec = time_fn(step, warmup=1, iters=iters)
  tokens = cfg.data.batch_size * cfg.data.seq_len
  fpt = flops_per_token(cfg, cfg.data.seq_len)
  return {"step_s": sec, "tokens_per_s": tokens / sec, "model_flops_per_s": fpt * tokens / sec,
          "flops_per_token": fpt, "first_step_s_incl_compile": compile_s,
          "params": count_params(cfg)}


def hf_config(cfg):
  from transformers import DeepseekV3Config
  m = cfg.model
  return DeepseekV3Config(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.dense_ffn_dim,
      moe_intermediate_size=m.moe_ffn_dim, num_hidden_layers=m.n_layers,
      first_k_dense_replace=m.n_dense_layers, num_attention_heads=m.n_heads,
      num_key_value_heads=m.n_heads, q_lora_rank=m.q_lora_rank or None,
      kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_dim, qk_rope_head_dim=m.qk_rope_dim,
      v_head_dim=m.v_head_dim, n_routed_experts=m.n_routed_experts,
      num_experts_per_tok=m.n_experts_per_tok, n_shared_experts=m.n_shared_experts,
      n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob,
      routed_scaling_factor=m.routed_scaling_factor, max_position_embeddings=m.max_seq_len,
      rope_theta=m.rope_theta, rms_norm_eps=m.rms_eps, tie_word_embeddings=m.tie_embeddings,
      attention_bias=False)


def bench_hf(cfg, iters: int) -> dict:
  import numpy as np
  import torch
  from transformers import DeepseekV3ForCausalLM
  torch.manual_seed(0)
  torch.set_num_threads(os.cpu_count() or 1)
  model = DeepseekV3ForCausalLM(hf_config(cfg)).float().train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
  ids = torch.from_numpy(synthetic_batch(cfg)["tokens"].astype(np.int64))

  def step():
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss)

  step()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  sec = sorted(times)[len(times) // 2]
  tokens = cfg.data.batch_size * cfg.data.seq_len
  return {"step_s": sec, "tokens_per_s": tokens / sec, "torch": torch.__version__,
          "torch_threads": torch.get_num_threads(),
          "params": sum(p.numel() for p in model.parameters())}


def tiny_learning(steps: int) -> dict:
  from composer_jax.config import load_config
  from composer_jax.train.loop import run
  out = tempfile.mkdtemp(prefix="tiny_bench_")
  cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"),
                    [f"train.steps={steps}", "train.progress=false"])
  t0 = time.perf_counter()
  run(cfg, out)
  wall = time.perf_counter() - t0
  with open(os.path.join(out, "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f]
  evals = [(r["step"], r["eval_bpb"]) for r in recs if "eval_bpb" in r]
  losses = [r["loss"] for r in recs if "loss" in r]
  return {"run_dir": out, "steps": steps, "wall_s": wall, "eval_bpb": evals,
          "bpb_before": evals[0][1], "bpb_after": evals[-1][1],
          "loss_first": losses[0], "loss_last": losses[-1]}


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default=os.path.join(ROOT, "configs/bench.yaml"))
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--tiny-steps", type=int, default=60)
  ap.add_argument("--skip-hf", action="store_true")
  ap.add_argument("--with-mtp", action="store_true", help="also time our step with the MTP depth")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args()
  from composer_jax.config import load_config
  cfg = load_config(args.config, args.overrides)
  no_mtp = load_config(args.config, list(args.overrides) + ["model.mtp_depths=0"])
  peak = matmul_peak_flops()
  print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s")
  result = {"config": os.path.relpath(args.config, ROOT), "overrides": args.overrides,
            "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
            "matmul_peak_flops": peak}
  ours = bench_ours(no_mtp, args.iters)
  ours["mfu_vs_measured_matmul"] = ours["model_flops_per_s"] / peak
  result["ours_no_mtp"] = ours
  print(f"ours (no MTP): {ours['tokens_per_s']:.0f} tok/s, "
        f"{ours['mfu_vs_measured_matmul']:.1%} of measured matmul FLOP/s")
  if args.with_mtp and cfg.model.mtp_depths:
    mtp = bench_ours(cfg, args.iters)
    mtp["mfu_vs_measured_matmul"] = mtp["model_flops_per_s"] / peak
    result["ours_with_mtp"] = mtp
    print(f"ours (MTP {cfg.model.mtp_depths}): {mtp['tokens_per_s']:.0f} tok/s")
  if not args.skip_hf:
    hf = bench_hf(no_mtp, args.iters)
    result["hf_deepseek_v3"] = hf
    result["speedup_vs_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
    print(f"HF DeepseekV3 (torch CPU): {hf['tokens_per_s']:.0f} tok/s -> ours / HF = "
          f"{result['speedup_vs_hf']:.2f}x (goal >= 1.05x, aiming for 1.2x)")
  if args.tiny_steps:
    tiny = tiny_learning(args.tiny_steps)
    result["tiny_learning"] = tiny
    print(f"tiny: held-out {tiny['bpb_before']:.3f} -> {tiny['bpb_after']:.3f} bits/byte after "
          f"{tiny['steps']} steps ({tiny['wall_s']:.0f}s)")
  write_result("train_bench", result)
  return 0


if __name__ == "__main__":
  sys.exit(main())

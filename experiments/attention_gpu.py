"""GPU attention: every implementation behind ``model.attention_impl`` on the real device.

1. Numerics at 2K (K2 head dims, bf16 inputs, 2 packed documents; cuDNN unpacked): output and
   input gradients of each implementation against the dense path computed in float32, as the max
   absolute error over the max magnitude.
2. fwd+bwd time against sequence length (1K ... 32K, batch 1, ``--heads`` heads, qk 192 / v 128,
   bf16), packed (dense, blockwise, pallas_gpu) and unpacked (the same plus cudnn, which has no
   segment input), with each step's causal FLOP/s as a fraction of the bf16 matmul peak measured
   in the same run.

  python -m experiments.attention_gpu [--seqs 1024 ...] [--heads 16]
Needs a GPU; elsewhere it says so and writes nothing. Writes experiments/results/attention_gpu.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from composer_jax.model.attention import attention
from experiments.attention_bench import inputs
from experiments.common import matmul_peak_flops, time_fn, write_result

DK, DV = 192, 128


def make_step(impl, scale, packed):
  def loss(q, k, v, seg, g):
    o, _ = attention(q, k, v, seg if packed else None, scale=scale, impl=impl, block=128)
    return jnp.sum(o.astype(jnp.float32) * g)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def numerics(impls, s, h):
  q, k, v, seg, g = inputs(1, s, h, DK, DV, 2, jnp.bfloat16)
  out = {}
  for packed in (True, False):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_o = attention(*f32, seg if packed else None, scale=DK ** -0.5, impl="dense")[0]
    ref_g = make_step("dense", DK ** -0.5, packed)(*f32, seg, g)[1]
    for impl in impls:
      if impl == "cudnn" and packed:
        continue
      key = f"{impl}{'' if packed else '_unpacked'}"
      fwd = lambda q, k, v, sg, impl=impl, packed=packed: attention(
          q, k, v, sg if packed else None, scale=DK ** -0.5, impl=impl, block=128)[0]
      try:
        o = jax.jit(fwd)(q, k, v, seg)
        grads = make_step(impl, DK ** -0.5, packed)(q, k, v, seg, g)[1]
      except Exception as e:  # noqa: BLE001 - one kernel failing to compile is a finding
        out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        continue
      out[key] = {"out": rel_err(o, ref_o),
                  **{f"d{n}": rel_err(a, r) for n, a, r in zip("qkv", grads, ref_g)}}
  return out


def timing(impl, s, h, packed, peak, max_seconds):
  args = inputs(1, s, h, DK, DV, 2, jnp.bfloat16)
  step = make_step(impl, DK ** -0.5, packed)
  row = {"impl": impl, "seq": s, "heads": h, "packed": packed}
  try:
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    row["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row["temp_bytes"] = mem.temp_size_in_bytes if mem is not None else None
    sec = time_fn(compiled, *args, warmup=2, iters=5)
  except Exception as e:  # noqa: BLE001 - an out-of-memory or unsupported shape ends that impl's sweep
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row
  flops = h * s * s * (3 * DK + 3 * DV)  # causal half of fwd QK, PV + bwd dV, dP, dQ, dK, 2/MAC
  row.update(fwd_bwd_s=sec, causal_tflop_per_s=flops / sec / 1e12,
             frac_of_bf16_peak=flops / sec / peak)
  row["slow"] = sec > max_seconds
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seqs", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384, 32768])
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--impls", nargs="*", default=["dense", "blockwise", "pallas_gpu", "cudnn"])
  ap.add_argument("--max-seconds", type=float, default=0.5, help="end an impl's sweep after a step this long")
  args = ap.parse_args()
  if jax.default_backend() != "gpu":
    print(f"backend is {jax.default_backend()}: this benchmark needs a GPU; nothing measured")
    return 0
  peak = matmul_peak_flops(8192, "bfloat16")
  print(f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
  num = numerics(args.impls, 2048, 4)
  print("numerics (max abs err / max |ref|):", num, flush=True)
  rows = []
  save = lambda: write_result("attention_gpu", {
      "bf16_matmul_peak_flops": peak, "qk_dim": DK, "v_dim": DV, "numerics_2k": num, "timing": rows})
  for packed in (True, False):
    for impl in args.impls:
      if impl == "cudnn" and packed:
        continue
      for s in args.seqs:
        row = timing(impl, s, args.heads, packed, peak, args.max_seconds)
        rows.append(row)
        print(row, flush=True)
        save()  # after every row: a run cut short keeps what it measured
        if "error" in row or row["slow"]:
          break
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

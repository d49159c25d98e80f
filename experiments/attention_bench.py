"""Attention forward+backward: time and memory against sequence length, old (dense) and new paths.

1. K2 head dims (qk 192, v 128), ``--heads`` heads, batch 1, two packed documents per row: each
   implementation runs jitted value_and_grad at 1K ... 32K until a step exceeds ``--max-seconds`` or
   XLA's buffer assignment exceeds ``--max-gb`` (the dense [h, s, s] scores stop first).
   Memory is XLA's static buffer assignment of the compiled step (temporaries + arguments + outputs;
   on CPU that is the peak the executable can reach).
2. The bench.yaml attention shape (batch 8 x 512, 12 heads, qk 96, v 64): dense against blockwise at
   several block sizes (a block >= the sequence is the dense product itself).

  python -m experiments.attention_bench [--seqs 1024 2048 ...] [--max-seconds 30] [--note "..."]
Writes experiments/results/attention_bench.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import ModelConfig
from composer_jax.model.attention import attention, resolve_impl
from experiments.common import time_fn, write_result


def make_step(impl: str, block: int, scale: float):
  def loss(q, k, v, seg, g):
    o, _ = attention(q, k, v, seg, scale=scale, impl=impl, block=block)
    return jnp.sum(o.astype(jnp.float32) * g)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(b, s, h, dk, dv, docs, dtype):
  r = np.random.default_rng(0)
  f = lambda *shape: jnp.asarray(r.normal(size=shape), dtype)
  seg = jnp.asarray(np.broadcast_to(1 + np.arange(s) * docs // s, (b, s)).astype(np.int32))
  return f(b, s, h, dk), f(b, s, h, dk), f(b, s, h, dv), seg, f(b, s, h, dv)


def measure(impl, block, shape, docs, dtype, iters, max_gb):
  b, s, h, dk, dv = shape
  args = inputs(b, s, h, dk, dv, docs, dtype)
  step = make_step(impl, block, dk ** -0.5)
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  peak = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
  row = {"impl": impl, "block": block, "batch": b, "seq": s, "heads": h, "qk_dim": dk, "v_dim": dv,
         "compile_s": compile_s, "temp_bytes": mem.temp_size_in_bytes, "peak_bytes": peak}
  if peak > max_gb * 2 ** 30:
    row["skipped"] = f"needs {peak / 2 ** 30:.1f} GiB > --max-gb {max_gb}"
    return row
  sec = time_fn(compiled, *args, warmup=1, iters=iters)
  # model FLOPs of a causal row: fwd QK, PV and bwd dV, dP, dQ, dK over s^2/2 pairs, 2 per MAC
  # (no recompute, no discount for packing)
  flops = b * h * s * s * (3 * dk + 3 * dv)
  row.update({"fwd_bwd_s": sec, "causal_gflop_per_s": flops / sec / 1e9})
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seqs", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384, 32768])
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--block", type=int, default=ModelConfig().attention_block)
  ap.add_argument("--docs", type=int, default=2, help="packed documents per row")
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--max-seconds", type=float, default=30.0, help="stop an impl after a step this long")
  ap.add_argument("--max-gb", type=float, default=8.0, help="skip steps whose buffers exceed this")
  ap.add_argument("--bench-blocks", type=int, nargs="*", default=[128, 256, 512])
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--note", default="", help="stored with the results (e.g. 'taken under load')")
  args = ap.parse_args()
  dtype = jnp.dtype(args.dtype)
  new_impl = resolve_impl("auto", max(args.seqs))

  scaling = []
  for impl in ("dense", new_impl):
    for s in args.seqs:
      row = measure(impl, args.block, (1, s, args.heads, 192, 128), args.docs, dtype, args.iters,
                    args.max_gb)
      scaling.append(row)
      print(row, flush=True)
      if "skipped" in row or row["fwd_bwd_s"] > args.max_seconds:
        break

  bench_shape = (8, 512, 12, 96, 64)
  shape_rows = [measure("dense", 512, bench_shape, args.docs, dtype, args.iters, args.max_gb)]
  for blk in args.bench_blocks:
    shape_rows.append(measure("blockwise", blk, bench_shape, args.docs, dtype, args.iters,
                              args.max_gb))
  for row in shape_rows:
    print(row, flush=True)
  write_result("attention_bench", {
      "note": args.note, "dtype": args.dtype, "docs_per_row": args.docs, "new_impl": new_impl,
      "scaling_k2_head_dims": scaling, "bench_yaml_shape": shape_rows})


if __name__ == "__main__":
  main()

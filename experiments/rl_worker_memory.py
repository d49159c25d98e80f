"""A rollout worker's host memory: its measured peak against the preflight's estimate.

``rl/preflight.py::worker_bytes`` refuses ``rl.num_workers`` that cannot fit before the main job
starts. Its estimate is a floor: a runtime constant (Python, Ray's core worker, the JAX runtime and
the sampler's compiled programs) plus the broadcast weights plus, on a CPU sampler, the latent cache
counted ``CACHE_COPIES`` times. This script spawns one real worker (the tiny config, and the tiny
config with a 4x decode batch and with 16x the experts), sends it weights, plays two units of 2 tasks
x group_size episodes, and reads the worker's peak resident memory (VmHWM) from /proc. It prints
measured / estimated for each and how the peak moved with the cache and the weights, which is what
``WORKER_RUNTIME_MB`` and ``CACHE_COPIES`` were set from.

  python -m experiments.rl_worker_memory
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import write_result

MiB = 2**20
CASES = {"tiny": [], "decode_batch_x4": ["rl.decode_batch=64"],
         "experts_x16": ["model.n_routed_experts=256", "model.moe_ffn_dim=256"]}


def _peak(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def measure(overrides: list[str], tasks: str) -> dict:
  import ray
  from flax import nnx

  from composer_jax.config import load_config
  from composer_jax.model.build import build_model
  from composer_jax.rl.orchestrator import Orchestrator
  from composer_jax.rl.preflight import worker_bytes
  cfg = load_config("configs/tiny.yaml", [f"rl.tasks={tasks}", "rl.async=true", "rl.num_workers=1",
                                          *overrides])
  weights = nnx.split(build_model(cfg), nnx.Param, ...)[1:]
  orch = Orchestrator(cfg, "configs/tiny-base/tokenizer.json", log=lambda m: None)
  try:
    pid = orch.worker_info()[0]["pid"]
    spawned = _peak(pid)
    orch.broadcast(weights, 0)
    tokens = 0
    for _ in range(2):
      orch.submit([(0, 0), (1, 1)])
      results: list = []
      while not results:
        results, lost = orch.wait(timeout=1.0)
        assert not lost, "the worker died"
      tokens += results[0]["tokens"]
    peak = _peak(pid)
  finally:
    orch.shutdown()
    ray.shutdown()
  est = worker_bytes(cfg)
  return {"overrides": overrides, "peak_mib": peak / MiB, "spawned_mib": spawned / MiB,
          "tokens": tokens, "estimate_mib": est["total"] / MiB, "params_mib": est["params"] / MiB,
          "cache_mib": est["cache"] / MiB, "measured_over_estimate": peak / est["total"]}


def main() -> None:
  from composer_jax.env import synthetic
  from composer_jax.rl.preflight import CACHE_COPIES
  tasks = tempfile.mkdtemp(prefix="worker_memory_tasks_")
  synthetic.generate(4, seed=0, out=tasks, split="train")
  out = {name: measure(ov, tasks) for name, ov in CASES.items()}
  for name, r in out.items():
    print(f"{name}: peak {r['peak_mib']:.0f} MiB (at spawn {r['spawned_mib']:.0f}), estimate "
          f"{r['estimate_mib']:.0f} MiB (weights {r['params_mib']:.0f}, cache {r['cache_mib']:.0f}): "
          f"measured / estimate {r['measured_over_estimate']:.2f}")
  base, big, wide = out["tiny"], out["decode_batch_x4"], out["experts_x16"]
  # The raw cache (the estimate's share / CACHE_COPIES) and the weights, against what the peak did.
  out["peak_per_cache_byte"] = ((big["peak_mib"] - base["peak_mib"])
                                / ((big["cache_mib"] - base["cache_mib"]) / CACHE_COPIES))
  out["peak_per_weight_byte"] = ((wide["peak_mib"] - base["peak_mib"])
                                 / (wide["params_mib"] - base["params_mib"]))
  print(f"peak per cache byte {out['peak_per_cache_byte']:.2f}, per weight byte "
        f"{out['peak_per_weight_byte']:.2f}; load {os.getloadavg()[0]:.2f}")
  out["load_1min_at_end"] = os.getloadavg()[0]
  write_result("rl_worker_memory", out)


if __name__ == "__main__":
  main()

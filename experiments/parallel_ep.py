"""Expert parallelism on the fake 8-device CPU mesh: all-to-all vs all-gather, time and bytes.

One MoE layer (forward + backward of the routed experts) with expert=8. Bytes moved per device per
layer forward (the backward moves the same again):
  ragged all-to-all  rows actually sent and received (what GPU/TPU move)
  padded all-to-all  the CPU stand-in: every chunk padded to the worst case (n x T_loc x k rows)
  all-gather         tokens, ids and weights of the whole group in, partial outputs reduce-scattered
Run with balanced and with fully skewed routing.  python experiments/parallel_ep.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import MeshConfig, ModelConfig
from composer_jax.parallel.experts import expert_parallel_moe
from composer_jax.parallel.mesh import build_mesh
from composer_jax.parallel.rules import activate, make_rules
from experiments.common import time_fn, write_result

N, T, K, E, D, F = 8, 4096, 4, 32, 256, 128  # global tokens T; per device T/N


def bytes_moved(ids: np.ndarray, itemsize: int = 4) -> dict:
  t_loc = T // N
  dest = (ids // (E // N)).reshape(N, t_loc * K)  # destination rank of each row, per source
  sent = np.array([[np.sum(dest[s] == r) for r in range(N)] for s in range(N)])
  off = sent - np.diag(np.diag(sent))  # rows that leave the device
  ragged = (off.sum(1) + off.sum(0)).max() * D * itemsize  # send + receive, busiest device
  padded = 2 * (N - 1) * t_loc * K * D * itemsize
  gather = (N - 1) * t_loc * (D + 2 * K) * itemsize + (N - 1) * t_loc * D * itemsize
  return {"ragged_all_to_all": int(ragged), "padded_all_to_all": int(padded),
          "all_gather": int(gather)}


def main() -> None:
  cfg = ModelConfig(d_model=D, moe_ffn_dim=F, n_routed_experts=E, n_experts_per_tok=K)
  mesh = build_mesh(MeshConfig(data=1, expert=N))
  r = np.random.default_rng(0)
  x = jnp.asarray(r.normal(size=(T, D)), jnp.float32)
  w = jnp.asarray(r.random((T, K)), jnp.float32)
  ws = [jnp.asarray(r.normal(size=s) * 0.05, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
  routings = {"balanced": np.stack([r.permutation(E)[:K] for _ in range(T)]).astype(np.int32),
              "skewed": np.tile(np.arange(K, dtype=np.int32), (T, 1))}
  out = {"shape": {"devices": N, "tokens": T, "top_k": K, "experts": E, "d_model": D, "ffn": F},
         "results": {}}
  for name, ids in routings.items():
    moved = bytes_moved(ids)
    res = {"bytes_per_device_forward": moved}
    for strategy in ("all_to_all", "all_gather"):
      def loss(x, *ws, strategy=strategy, ids=ids):
        return (expert_parallel_moe(x, jnp.asarray(ids), w, *ws, cfg=cfg, mesh=mesh,
                                    strategy=strategy) ** 2).sum()
      with activate(mesh, make_rules()):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        sec = time_fn(step, x, *ws, warmup=1, iters=5)
      res[f"{strategy}_step_s"] = sec
    res["all_gather_over_all_to_all_time"] = res["all_gather_step_s"] / res["all_to_all_step_s"]
    res["bytes_ratio_all_gather_over_ragged"] = moved["all_gather"] / max(moved["ragged_all_to_all"], 1)
    out["results"][name] = res
    print(f"{name:9s} fwd+bwd: all_to_all {res['all_to_all_step_s'] * 1e3:7.1f} ms, all_gather "
          f"{res['all_gather_step_s'] * 1e3:7.1f} ms (ratio {res['all_gather_over_all_to_all_time']:.2f});"
          f" bytes/device fwd: ragged {moved['ragged_all_to_all'] / 2**20:.2f} MiB, padded "
          f"{moved['padded_all_to_all'] / 2**20:.2f} MiB, all_gather {moved['all_gather'] / 2**20:.2f} MiB")
  write_result("parallel_ep", out)


if __name__ == "__main__":
  main()

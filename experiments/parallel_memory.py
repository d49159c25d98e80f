"""Per-device memory of Kimi K2 (1.03T parameters) on a few pod meshes, from ``sharding_plan``.

Nothing is allocated: shapes come from eval_shape, specs from the rule table on an AbstractMesh.
Parameters in bf16; the optimizer state is ``jax.eval_shape`` of the configured optimizer's init
(Muon momentum on matrices, AdamW moments elsewhere, the float32 master copy of
``optim.master_dtype``), sharded like its parameters. One AdamW row and one row without the master
copy (``optim.master_dtype=none``) for comparison. Activations and gradients not counted.

  python experiments/parallel_memory.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax.config import load_config
from composer_jax.train.plan import sharding_plan
from experiments.common import write_result

GIB = 2 ** 30
MESHES = [  # (devices, overrides)
    (256, {"fsdp": 32, "expert": 8}),
    (512, {"fsdp": 64, "expert": 8}),
    (1024, {"fsdp": 64, "expert": 16}),
    (2048, {"data": 2, "fsdp": 64, "expert": 16}),
    (512, {"fsdp": 16, "expert": 8, "tensor": 4}),
    (512, {"fsdp": 512, "expert": 1}),  # no expert parallelism: pure FSDP
]


def main() -> None:
  rows = []
  runs = ([("muon", "float32", m) for m in MESHES] + [("adamw", "float32", MESHES[1]),
                                                      ("muon", "none", MESHES[1])])
  for optim, master, (n, axes) in runs:
    over = [f"mesh.{a}={axes.get(a, 1)}" for a in ("data", "fsdp", "expert", "tensor", "context")]
    cfg = load_config("configs/kimi-k2.yaml", over + [f"optim.name={optim}", "optim.qk_clip=0",
                                                       f"optim.master_dtype={master}"])
    plan = sharding_plan(cfg, n_devices=n)
    t = plan["totals"]
    experts = sum(r["param_bytes"] for r in plan["params"] if ".mlp.w_" in r["name"])
    row = {"devices": n, "mesh": {a: s for a, s in plan["mesh"].items() if s > 1},
           "optimizer": plan["optimizer"], "param_gib": t["param_bytes_per_device"] / GIB,
           "expert_param_gib": experts / GIB, "opt_gib": t["opt_bytes_per_device"] / GIB,
           "total_gib": t["total_bytes_per_device"] / GIB}
    rows.append(row)
    print(f"{n:5d} devices {row['mesh']!s:44s} {optim:6s} master={master:7s} "
          f"params {row['param_gib']:7.2f} GiB "
          f"(experts {row['expert_param_gib']:6.2f})  opt {row['opt_gib']:7.2f}  "
          f"total {row['total_gib']:7.2f} GiB/device")
  base = rows[1]["total_gib"]
  print(f"ratio total/device, 512 devices: fsdp64 x expert8 vs fsdp512 = "
        f"{base / rows[5]['total_gib']:.3f}; muon vs adamw (fsdp64 x expert8) = "
        f"{base / rows[-2]['total_gib']:.3f}; with vs without the f32 master copy = "
        f"{base / rows[-1]['total_gib']:.3f}")
  write_result("parallel_memory", {"model": "configs/kimi-k2.yaml", "global_param_gib":
                                   plan["totals"]["global_param_bytes"] / GIB, "rows": rows})


if __name__ == "__main__":
  main()

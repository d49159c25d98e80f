"""A rollout worker spanning hosts (``rl.worker_hosts``, a gang). (1) It is fed in blocks
(rl/weights.py): the share of a full update's bytes each gang member fetches, per config and layout,
computed on the abstract model (no weights allocated; fake CPU devices stand in for the gang's).
(2) On the tiny config's weights through a local Ray object store: what blocks cost the learner (one
put per block instead of one per update) and what one member's fetch of its blocks costs against a
whole update's fetch. (3) Decoding: the wall time of one unit of episodes (random tiny weights, the
same episodes both ways) on a gang of 2 actors x 2 fake CPU devices over the time on one actor with
4 devices, the same 4-device mesh: what member 0's per-call broadcast and the collectives between
processes cost. Fake CPU devices on one machine, so (3) measures overheads, not a cluster.

  python experiments/rl_gang.py [--reps 5] [--units 2]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=32"  # before jax starts

import argparse
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.common import write_result

# (config, hosts, devices per host, rl.worker_mesh)
LAYOUTS = [("configs/tiny.yaml", 2, 4, "{expert: 8}"),
           ("configs/tiny.yaml", 2, 4, "{expert: 2, tensor: 4}"),
           ("configs/kimi-k2.yaml", 2, 8, "{expert: 16}"),
           ("configs/kimi-k2.yaml", 4, 8, "{expert: 32}"),
           ("configs/kimi-k2.yaml", 2, 8, "{expert: 8, tensor: 2}")]


def _gang(path: str, hosts: int, devices: int, mesh: str):
  """(cfg, leaf names, abstract leaves, block grids, shardings) of a gang's layout."""
  import jax
  from flax import nnx

  from composer_jax.config import MeshConfig, load_config
  from composer_jax.model.build import abstract_model
  from composer_jax.parallel.mesh import build_mesh
  from composer_jax.rl import worker_devices as WD
  cfg = load_config(path, [f"rl.worker_hosts={hosts}", f"rl.worker_devices={devices}",
                           f"rl.worker_mesh={mesh}", "rl.learner_sampler=mesh", "rl.decode_batch=64"])
  tree = nnx.split(abstract_model(cfg), nnx.Param, ...)[1:]
  grids = WD.block_grids(cfg, tree)
  m = build_mesh(MeshConfig(**WD.mesh_sizes(cfg), rules=dict(cfg.mesh.rules)),
                 devices=jax.devices()[: hosts * devices])
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = [jax.tree_util.keystr(k) for k, _ in leaves]
  return cfg, names, [v for _, v in leaves], grids, WD.leaf_shardings(cfg, tree, m)


def member_shares() -> list[dict]:
  import jax

  from composer_jax.rl import weights as W
  rows = []
  for path, hosts, devices, mesh in LAYOUTS:
    _, names, leaves, grids, shardings = _gang(path, hosts, devices, mesh)
    size = {}
    for n, v, g in zip(names, leaves, grids):
      nbytes = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize // int(np.prod(g) if g else 1)
      step = [d // k for d, k in zip(v.shape, g)]
      for c in np.ndindex(*g):
        size[W.piece_name(n, tuple((i * s, (i + 1) * s) for i, s in zip(c, step)))] = nbytes
    full = sum(size.values())
    devs = jax.devices()[: hosts * devices]
    shares = []
    for h in range(hosts):  # the mesh is laid over the members' devices process by process
      want = W.wants(names, [v.shape for v in leaves], shardings,
                     devices=set(devs[h * devices:(h + 1) * devices]))
      shares.append(sum(b for p, b in size.items() if want(p)) / full)
    row = {"config": path, "hosts": hosts, "devices_per_host": devices, "worker_mesh": mesh,
           "full_gib": full / 2**30, "blocks": len(size), "member_share_min": min(shares),
           "member_share_max": max(shares)}
    print(f"{path} {hosts} x {devices} {mesh}: full {full / 2**30:.2f} GiB in {len(size)} blocks; "
          f"each member fetches {min(shares):.3f}-{max(shares):.3f} of it")
    rows.append(row)
  return rows


def tiny_costs(reps: int) -> dict:
  """Publish (learner) and fetch (one member) times of a full update of the tiny policy, whole
  and in blocks, through a local Ray object store."""
  import jax
  import ray
  from flax import nnx

  from composer_jax.model.build import build_model
  from composer_jax.rl import weights as W
  cfg, names, leaves, grids, shardings = _gang("configs/tiny.yaml", 2, 4, "{expert: 8}")
  model = build_model(cfg)
  tree = nnx.split(model, nnx.Param, ...)[1:]
  want = W.wants(names, [v.shape for v in leaves], shardings, devices=set(jax.devices()[:4]))
  ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
           num_cpus=2, object_store_memory=256 * 2**20, _system_config={"preallocate_plasma_memory": True})
  out = {}
  try:
    for kind, g, w in (("whole", None, None), ("blocks", grids, want)):
      pub_s, get_s = [], []
      for r in range(reps + 1):
        pub = W.Publisher(full_sync_every=1, delta=False, put=ray.put, grids=g)
        t0 = time.perf_counter()
        chain = pub.publish(tree, r)
        t1 = time.perf_counter()
        rx = W.Receiver(get=ray.get, copy=False, want=w)
        rx.apply(chain)
        t2 = time.perf_counter()
        if r:  # the first is a warm-up
          pub_s.append(t1 - t0)
          get_s.append(t2 - t1)
      out[kind] = {"publish_ms": 1e3 * float(np.median(pub_s)), "fetch_ms": 1e3 * float(np.median(get_s)),
                   "fetched_mib": rx.fetched_bytes / 2**20, "full_mib": pub.last_bytes / 2**20}
      print(f"tiny, {kind}: publish {out[kind]['publish_ms']:.1f} ms, one member's fetch "
            f"{out[kind]['fetch_ms']:.1f} ms ({out[kind]['fetched_mib']:.2f} of "
            f"{out[kind]['full_mib']:.2f} MiB)")
  finally:
    ray.shutdown()
  out["publish_ratio_blocks_over_whole"] = out["blocks"]["publish_ms"] / out["whole"]["publish_ms"]
  return out


def gang_decode(units: int) -> dict:
  """Seconds per unit (16 episodes: 2 tasks x 8) on one actor with 4 devices and on a 2 x 2 gang."""
  import tempfile

  import ray
  from flax import nnx

  from composer_jax.config import load_config
  from composer_jax.env import synthetic
  from composer_jax.model.build import build_model
  from composer_jax.rl.orchestrator import Orchestrator
  tasks = tempfile.mkdtemp(prefix="gang_tasks_")
  synthetic.generate(4, seed=0, out=tasks, split="train")
  tok = "configs/tiny-base/tokenizer.json"
  common = [f"rl.tasks={tasks}", "rl.async=true", "rl.num_workers=1", "rl.object_store_mb=128",
            "rl.weight_delta=false", "rl.learner_sampler=mesh", "rl.worker_mesh={expert: 2, tensor: 2}",
            "rl.group_size=8", "rl.decode_batch=16", "env.max_turns=4"]
  weights = None
  out: dict = {}
  for name, layout in (("one", ["rl.worker_devices=4"]), ("gang", ["rl.worker_hosts=2", "rl.worker_devices=2"])):
    cfg = load_config("configs/tiny.yaml", common + layout)
    if weights is None:
      weights = nnx.split(build_model(cfg), nnx.Param, ...)[1:]
    orch = Orchestrator(cfg, tok, log=lambda m: None)
    try:
      orch.broadcast(weights, 0)
      secs, tokens = [], 0
      for i in range(units + 1):
        t0 = time.perf_counter()
        orch.submit([(0, 0), (1, 1)])
        results: list = []
        while not results:
          results, lost = orch.wait(timeout=1.0)
          assert not lost, f"{name}: a worker died"
        if i:  # the first compiles
          secs.append(time.perf_counter() - t0)
          tokens += results[0]["tokens"]
    finally:
      orch.shutdown()
      ray.shutdown()
    out[name] = {"unit_s": float(np.median(secs)), "tokens_per_s": tokens / sum(secs)}
    print(f"decode, {name}: {out[name]['unit_s']:.1f} s a unit, {out[name]['tokens_per_s']:.0f} tokens/s")
  out["gang_over_one"] = out["gang"]["unit_s"] / out["one"]["unit_s"]
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--units", type=int, default=2, help="timed units per layout, after one warm-up")
  args = ap.parse_args()
  shares = member_shares()
  costs = tiny_costs(args.reps)
  decode = gang_decode(args.units)
  load = os.getloadavg()[0]
  print(f"publish in blocks / whole: {costs['publish_ratio_blocks_over_whole']:.2f}x; a unit on the "
        f"gang / on one actor: {decode['gang_over_one']:.2f}x (load {load:.2f})")
  write_result("rl_gang", {"member_shares": shares, "tiny_costs": costs, "decode": decode,
                           "reps": args.reps, "load_1min_at_end": load})


if __name__ == "__main__":
  main()

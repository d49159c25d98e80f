"""Weight broadcast: (1) time to deliver one weight update to N local Ray workers through the object
store (one put, N gets, each worker copying the tensors into its own buffers: the transport alone)
divided by the time of the plain memory copies of the same bytes (N copies in one process); (2) the
same for the path an RL step takes (``Publisher.publish``: encode, one put, hashes only in delta
mode; each worker's swap: get, decode, a hash check in delta mode, ``jax.device_put``, which on CPU
aliases the store's buffers instead of copying them), with full and with delta updates;
(3) delta bytes / full bytes after one RL step, in bf16 and in f32.

"One RL step" here: the tiny MoE of the tests scaled up a little, a policy-gradient loss
(-advantage x log p of sampled tokens, advantages +-1) on random token rows, one AdamW step from
fresh Adam state at a typical RL learning rate, applied to float32 master weights; the bf16 policy is
the cast of the master weights before and after (what the rollout workers hold). Tokens absent from
the batch keep their embedding rows bit-identical; in bf16 an update smaller than half an ulp leaves
the weight unchanged, which is why bf16 deltas are small and f32 deltas are not.

  python experiments/rl_broadcast.py [--mb 64] [--workers 2,4] [--reps 10] [--warmup 10]
      [--store-mb 512] [--lrs 1e-6,1e-5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import write_result


def _payload(mb: int) -> list[np.ndarray]:
  import ml_dtypes
  rng = np.random.default_rng(0)
  n = mb * 2**20 // 2 // 16
  return [rng.standard_normal(n).astype(ml_dtypes.bfloat16) for _ in range(16)]


def broadcast_ratio(mb: int, n_workers: int, reps: int, warmup: int = 10, store_mb: int = 0) -> dict:
  import ray

  from composer_jax.config import load_config
  from composer_jax.rl import weights as W
  from composer_jax.rl.orchestrator import _local_ray

  @ray.remote(num_cpus=0)
  class Sink:
    def __init__(self):
      self.bufs = None

    def take(self, chain):
      t0 = time.perf_counter()
      upd = ray.get(chain[-1][2])
      t1 = time.perf_counter()
      if self.bufs is None or [b.shape for b in self.bufs] != [a.shape for a in upd.data]:
        self.bufs = [np.empty_like(a) for a in upd.data]
      for b, a in zip(self.bufs, upd.data):
        np.copyto(b, a)
      return t1 - t0, time.perf_counter() - t1

  @ray.remote(num_cpus=0)
  class Worker:
    """The rollout worker's own path (rollout_worker._swap): Receiver.apply (get, decode; a hash
    check in delta mode) with the store's buffers as views, then weights.to_device of every tensor
    (on CPU it aliases the aligned buffers; the fraction of bytes aliased is returned)."""

    def __init__(self):
      self.rx = W.Receiver(get=ray.get, copy=False)

    def swap(self, chain):
      import jax
      t0 = time.perf_counter()
      self.rx.apply(chain)
      t1 = time.perf_counter()
      self.params = jax.block_until_ready(W.to_device(self.rx.arrays))
      t2 = time.perf_counter()
      shared = sum(a.nbytes for a, p in zip(self.rx.arrays, self.params)
                   if p.unsafe_buffer_pointer() == a.ctypes.data)
      return t1 - t0, t2 - t1, shared / sum(a.nbytes for a in self.rx.arrays)

  # The RL run's own local Ray (rl.object_store_mb > 0: a store of that size, preallocated).
  ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
           **_local_ray(load_config(None, [f"rl.object_store_mb={store_mb}"]).rl))
  try:
    sinks = [Sink.remote() for _ in range(n_workers)]
    ray.get([s.take.remote([(0, "full", ray.put(W.encode_full(0, ["x"], [np.zeros(4, np.float32)])))])
             for s in sinks])
    arrays = _payload(mb)
    nbytes = sum(a.nbytes for a in arrays)
    names = [f"t{i}" for i in range(len(arrays))]
    upd = W.encode_full(0, names, arrays)  # raw bits (uint16 views), XXH3 hashes; encode timed below
    bc, cp, puts, gets, copies, first = [], [], [], [], [], []
    dst = [[np.empty_like(a) for a in arrays] for _ in range(n_workers)]
    for v in range(reps + warmup):
      upd.version = v + 1
      t0 = time.perf_counter()
      ref = ray.put(upd)
      tp = time.perf_counter()
      got = ray.get([s.take.remote([(v + 1, "full", ref)]) for s in sinks])
      t1 = time.perf_counter()
      for d in dst:
        for b, a in zip(d, arrays):
          np.copyto(b, a)
      t2 = time.perf_counter()
      del ref
      if v < warmup:
        # The store's allocator reaches a steady state only after a few puts of this size (the first
        # ones fault in fresh shared-memory pages); an RL run broadcasts every step.
        first.append(t1 - t0)
      else:
        bc.append(t1 - t0)
        cp.append(t2 - t1)
        puts.append(tp - t0)
        gets.append(max(g for g, _ in got))
        copies.append(max(c for _, c in got))
    real = {kind: _real_path(ray, W, Worker, arrays, n_workers, reps, warmup, kind)
            for kind in ("full", "delta")}
    # The full path with checksums (encode on the learner, decode + verify on a worker).
    t0 = time.perf_counter()
    full = W.encode_full(1, names, arrays)
    t1 = time.perf_counter()
    W.decode(full, None)
    t2 = time.perf_counter()
  finally:
    ray.shutdown()
  b, c = float(np.median(bc)), float(np.median(cp))
  med = lambda x: float(np.median(x))
  return {"bytes": nbytes, "workers": n_workers, "broadcast_s": b, "memcpy_n_copies_s": c,
          "ratio": b / c, "ratio_best": min(bc) / min(cp), "goal": "<= 1.5",
          "put_s": med(puts), "worker_get_s": med(gets), "worker_copy_s": med(copies),
          "memcpy_one_copy_s": c / n_workers, "encode_full_with_crc_s": t1 - t0,
          "decode_full_with_crc_s": t2 - t1, "warmup_rounds": warmup, "object_store_mb": store_mb,
          "warmup_broadcast_s": [round(x, 4) for x in first],
          "real_path": {k: {**v, "ratio": v["broadcast_s"] / c} for k, v in real.items()},
          "note": "broadcast = ray.put + every worker's ray.get and copy into its own buffers; "
                  "denominator = the same N copies by np.copyto in one process"}


def _real_path(ray, W, Worker, arrays, n_workers: int, reps: int, warmup: int, kind: str) -> dict:
  """What an RL step pays: Publisher.publish (encode, hash if delta, one put) on the learner, then
  every worker's swap (get, decode, hash check if delta, jax.device_put). ``kind="delta"``: every
  version after the first full one is a delta in which ~3.4 % of the bf16 elements changed (the
  changed fraction measured after one AdamW step at lr 1e-6, below)."""
  import ml_dtypes
  workers = [Worker.remote() for _ in range(n_workers)]
  pub = W.Publisher(full_sync_every=10**9 if kind == "delta" else 1, delta=kind == "delta", put=ray.put)
  rng = np.random.default_rng(1)
  cur = [a.copy() for a in arrays]
  ray.get([w.swap.remote(pub.publish(cur, 0)) for w in workers])  # imports jax, first full copy
  pubs, swaps, totals, nbytes, aliased = [], [], [], [], []
  for v in range(1, reps + warmup + 1):
    if kind == "delta":  # flip the low mantissa bit of ~3.4 % of the elements
      cur = [a.copy() for a in cur]  # new host arrays, as the learner's device_get gives (prev kept)
      for a in cur:
        idx = rng.integers(0, a.size, int(0.034 * a.size))
        a.view(np.uint16)[idx] ^= 1
    t0 = time.perf_counter()
    chain = pub.publish(cur, v)
    t1 = time.perf_counter()
    got = ray.get([w.swap.remote(chain) for w in workers])
    t2 = time.perf_counter()
    if v > warmup:
      pubs.append(t1 - t0)
      swaps.append(max(a + b for a, b, _ in got))
      aliased.append(min(f for _, _, f in got))
      totals.append(t2 - t0)
      nbytes.append(pub.last_bytes)
  for w in workers:
    ray.kill(w)
  assert all(a.dtype == ml_dtypes.bfloat16 for a in cur)
  med = lambda x: float(np.median(x))
  return {"broadcast_s": med(totals), "publish_s": med(pubs), "worker_swap_s": med(swaps),
          "bytes_sent": med(nbytes), "worker_bytes_aliasing_the_store": min(aliased)}


def delta_ratio(lrs: list[float]) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from composer_jax.config import load_config
  from composer_jax.model.build import build_model
  from composer_jax.rl import weights as W
  from composer_jax.rl.losses import token_logprobs
  cfg = load_config(None, [
      "model.vocab_size=4096", "model.d_model=128", "model.n_layers=4", "model.n_dense_layers=1",
      "model.dense_ffn_dim=256", "model.n_heads=4", "model.q_lora_rank=0", "model.kv_lora_rank=32",
      "model.qk_nope_dim=16", "model.qk_rope_dim=16", "model.v_head_dim=16", "model.n_routed_experts=8",
      "model.moe_ffn_dim=64", "model.n_group=2", "model.topk_group=2", "model.mtp_depths=0",
      "model.max_seq_len=256", "model.param_dtype=float32"])
  model = build_model(cfg)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(0)
  b, s = 8, 128
  tokens = jnp.asarray(rng.integers(0, 1024, (b, s)), jnp.int32)  # a quarter of the vocabulary
  seg = jnp.ones((b, s), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  adv = jnp.asarray(rng.choice([-1.0, 1.0], b), jnp.float32)

  def loss(p):
    out = nnx.merge(graphdef, p, rest)(tokens, seg, pos, mtp=False)
    return -(token_logprobs(out.logits, tokens, 1.0).mean(-1) * adv).mean()

  grads = jax.jit(jax.grad(loss))(params)
  out = []
  for lr in lrs:
    opt = optax.adamw(lr, weight_decay=0.1)
    upd, _ = opt.update(grads, opt.init(params), params)
    new = optax.apply_updates(params, upd)
    for dtype in (jnp.bfloat16, jnp.float32):
      names, old_a = W.flatten(jax.tree.map(lambda x, d=dtype: x.astype(d), params))
      _, new_a = W.flatten(jax.tree.map(lambda x, d=dtype: x.astype(d), new))
      t0 = time.perf_counter()
      d = W.encode_delta(1, 0, names, old_a, new_a)
      t1 = time.perf_counter()
      assert all(np.array_equal(W._bits(x), W._bits(y)) for x, y in zip(W.decode(d, old_a), new_a))
      full = sum(a.nbytes for a in new_a)
      changed = sum(int((W._bits(x) != W._bits(y)).sum()) for x, y in zip(old_a, new_a))
      total = sum(a.size for a in new_a)
      out.append({"lr": lr, "dtype": jnp.dtype(dtype).name, "full_bytes": full, "delta_bytes": d.nbytes,
                  "ratio": d.nbytes / full, "changed_elements_frac": changed / total,
                  "encode_s": t1 - t0, "encode_mb_per_s": full / 2**20 / (t1 - t0)})
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mb", type=int, default=64)
  ap.add_argument("--workers", default="2,4", help="worker counts, one run each")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=10)
  ap.add_argument("--store-mb", type=int, default=512, help="rl.object_store_mb (0 = Ray's default, lazy)")
  ap.add_argument("--lrs", default="1e-6,1e-5")
  ap.add_argument("--note", default="")
  a = ap.parse_args(argv)
  runs = []
  for n in [int(x) for x in a.workers.split(",")]:
    bc = broadcast_ratio(a.mb, n, a.reps, a.warmup, a.store_mb)
    runs.append(bc)
    print(f"broadcast {bc['bytes'] / 2**20:.0f} MiB to {n} workers, each copying it: {bc['broadcast_s'] * 1e3:.1f} ms "
          f"vs {n} memcpy {bc['memcpy_n_copies_s'] * 1e3:.1f} ms -> {bc['ratio']:.2f}x "
          f"(after {a.warmup} warm-up rounds; first round {bc['warmup_broadcast_s'][0] * 1e3:.1f} ms)")
    for kind, r in bc["real_path"].items():
      print(f"  the RL path, {kind} updates: {r['broadcast_s'] * 1e3:.1f} ms -> {r['ratio']:.2f}x "
            f"(publish {r['publish_s'] * 1e3:.1f} ms, slowest worker swap {r['worker_swap_s'] * 1e3:.1f} ms, "
            f"{r['bytes_sent'] / 2**20:.1f} MiB sent, {r['worker_bytes_aliasing_the_store']:.0%} of a worker's "
            "weight bytes alias the store)")
  deltas = delta_ratio([float(x) for x in a.lrs.split(",")])
  for d in deltas:
    print(f"lr {d['lr']:g} {d['dtype']}: delta/full {d['ratio']:.4f} "
          f"(changed elements {d['changed_elements_frac']:.4f})")
  write_result("rl_broadcast", {"broadcast": runs, "delta": deltas, "note": a.note})
  return 0


if __name__ == "__main__":
  sys.exit(main())

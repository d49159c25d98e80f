"""RL decode throughput -> experiments/results/rl_decode.json.

1. Decode tokens/s at 4K context (bench config): the absorbed MLA path over the latent cache against
   two re-expanded K/V paths: (a) the latent cache expanded through kv_b at every step (what a
   non-absorbed MLA decode does), (b) a conventional cache holding per-head keys and values
   (n_heads * (qk_head + v_head) numbers per token per layer instead of kv_lora + rope).
2. The decode-path fixes, before/after, on the bench config at rl.decode_batch rows, 256 tokens
   filled of a 4096-slot cache: attention over the whole cache vs a bucketed view; the training
   grouped-matmul block layout vs the per-pair small-batch MoE dispatch.
3. Engine rollout tokens/s (continuous batching, 2x as many episodes as slots) on tiny and bench.

    python -m experiments.rl_decode [--quick]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from composer_jax.config import load_config
from composer_jax.model import build_model, init_cache
from composer_jax.model import mla as mla_mod
from composer_jax.model import moe as moe_mod
from composer_jax.model.cache import Cache, bucket
from composer_jax.rl.sampler import Engine, Request
from composer_jax.train.step import split_model
from experiments.common import write_result

# -- re-expanded K/V paths (benchmark only) ---------------------------------------------------------


def _attend_expanded(self, q_nope, q_pe, k_nope, k_pe, v, q_idx, kv_len):
  """Per-head attention of new queries over expanded keys/values (k_pe shared across heads)."""
  b, t = k_nope.shape[:2]
  scores = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=jnp.float32)
            + jnp.einsum("bqhd,bkd->bhqk", q_pe, k_pe, preferred_element_type=jnp.float32))
  k_idx = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
  mask = mla_mod.attention_mask(q_idx, k_idx, k_valid=k_idx < kv_len[:, None])
  probs = mla_mod.masked_softmax(scores * self.scale, mask).astype(v.dtype)
  return self._out(jnp.einsum("bhqk,bkhd->bqhd", probs, v))


def expand_each_step(self, x, cos, sin, cache, seg=None):
  """(a) Latent cache, but keys/values re-expanded through kv_b over the whole view every step."""
  cfg = self.cfg
  q_nope, q_pe = self._query(x, cos, sin)
  c, k_pe = self._latent(x, cos, sin)
  start = cache.index
  cache = cache.write(c, k_pe)
  view = cache.view or cache.max_len
  kv = self.kv_b(cache.c[:, :view])
  k_nope, v = kv[..., : cfg.qk_nope_dim], kv[..., cfg.qk_nope_dim:]
  q_idx = start[:, None] + jnp.arange(x.shape[1])[None]
  return _attend_expanded(self, q_nope, q_pe, k_nope, cache.k_pe[:, :view], v, q_idx, cache.index), cache


@struct.dataclass
class KVLayerCache:
  """(b) A conventional per-head cache: keys (nope part; the rope key stays shared) and values."""
  k: jax.Array  # [b, T, h, qk_nope]
  k_pe: jax.Array  # [b, T, rope]
  v: jax.Array  # [b, T, h, v_head]
  index: jax.Array
  view: int = struct.field(pytree_node=False, default=0)

  @property
  def max_len(self):
    return self.k.shape[1]


def expanded_cache_attention(self, x, cos, sin, cache, seg=None):
  if not isinstance(cache, KVLayerCache):
    return expand_each_step(self, x, cos, sin, cache, seg)
  cfg = self.cfg
  q_nope, q_pe = self._query(x, cos, sin)
  c, k_pe = self._latent(x, cos, sin)
  kv = self.kv_b(c)
  k_new, v_new = kv[..., : cfg.qk_nope_dim], kv[..., cfg.qk_nope_dim:]
  start = cache.index
  upd = jax.vmap(lambda buf, new, i: jax.lax.dynamic_update_slice_in_dim(buf, new, i, axis=0))
  cache = cache.replace(k=upd(cache.k, k_new, start), k_pe=upd(cache.k_pe, k_pe, start),
                        v=upd(cache.v, v_new, start), index=start + x.shape[1])
  view = cache.view or cache.max_len
  q_idx = start[:, None] + jnp.arange(x.shape[1])[None]
  out = _attend_expanded(self, q_nope, q_pe, cache.k[:, :view], cache.k_pe[:, :view],
                         cache.v[:, :view], q_idx, cache.index)
  return out, cache


def kv_cache(cfg, b, t, index, view):
  m = cfg.model
  dt = jnp.float32
  layers = tuple(KVLayerCache(jnp.zeros((b, t, m.n_heads, m.qk_nope_dim), dt), jnp.zeros((b, t, m.qk_rope_dim), dt),
                              jnp.zeros((b, t, m.n_heads, m.v_head_dim), dt), jnp.full((b,), index, jnp.int32),
                              view) for _ in range(m.n_layers))
  return Cache(layers)


# -- measurements -----------------------------------------------------------------------------------


def decode_stepper(model, cache):
  """A compiled decode step (one token per row) at the cache's fill; calling it runs one step and
  returns its seconds. The cache is donated and updated in place (as the engine does); the fill is
  held constant. Compiled at creation, so the patches a variant needs apply only while it traces."""
  graphdef, state = nnx.split(model)
  tok = jnp.ones((cache.index.shape[0], 1), jnp.int32)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(state, cache, tok):
    out = nnx.merge(graphdef, state)(tok, cache=cache, mtp=False)
    return out.logits, out.cache.with_index(cache.index)

  box = [cache]

  def run():
    t0 = time.perf_counter()
    logits, box[0] = step(state, box[0], tok)
    jax.block_until_ready(logits)
    return time.perf_counter() - t0

  run()  # compile
  return run


def interleaved(steppers: dict, rounds: int) -> dict:
  """Median seconds per variant, the variants timed in turn each round: on a shared, loaded machine
  drift then hits every variant alike, so the ratios hold even when the absolute figures do not."""
  times = {n: [] for n in steppers}
  for _ in range(rounds):
    for n, run in steppers.items():
      times[n].append(run())
  return {n: float(np.median(t)) for n, t in times.items()}


def filled_cache(cfg, b, max_len, fill, view=0):
  c = init_cache(cfg.model, b, max_len).with_index(np.full((b,), fill, np.int32))
  return c.with_view(view) if view else c


def bench_4k(cfg, model, batch, iters, ctx=4096):
  view = bucket(ctx, ctx + 64)
  steppers = {"absorbed": decode_stepper(model, filled_cache(cfg, batch, ctx + 64, ctx - 1, view))}
  orig = mla_mod.MLA.absorbed
  try:
    mla_mod.MLA.absorbed = expand_each_step
    steppers["expand_each_step"] = decode_stepper(model, filled_cache(cfg, batch, ctx + 64, ctx - 1, view))
    mla_mod.MLA.absorbed = expanded_cache_attention
    steppers["expanded_kv_cache"] = decode_stepper(model, kv_cache(cfg, batch, ctx + 64, ctx - 1, view))
  finally:
    mla_mod.MLA.absorbed = orig
  sec = interleaved(steppers, iters)
  out = {"context": ctx, "batch": batch, "rounds": iters}
  out.update({f"{n}_tokens_per_s": batch / t for n, t in sec.items()})
  out["absorbed_over_expand_each_step"] = sec["expand_each_step"] / sec["absorbed"]
  out["absorbed_over_expanded_kv_cache"] = sec["expanded_kv_cache"] / sec["absorbed"]
  m = cfg.model
  out["cache_numbers_per_token_per_layer"] = {"latent": m.kv_lora_rank + m.qk_rope_dim,
                                              "expanded": m.n_heads * (m.qk_head_dim + m.v_head_dim)}
  return out


def bench_fixes(cfg, model, iters):
  """before: attention over the whole cache, the training grouped-matmul layout; after: the
  bucketed view and the decode dispatch (per-pair for <= PER_PAIR_MAX pairs)."""
  b, max_len, fill = cfg.rl.decode_batch, 4096, 256  # a long-context RL cache, early in the episode
  view = bucket(fill + 1, max_len, 64)
  orig = moe_mod.moe_dispatch

  def training_layout(*a, **k):
    return orig(*a, **{**k, "per_pair_max": 0})

  steppers = {}
  for name, v, train_layout in (("before", 0, True), ("view_only", view, True),
                                ("dispatch_only", 0, False), ("after", view, False)):
    moe_mod.moe_dispatch = training_layout if train_layout else orig
    try:
      steppers[name] = decode_stepper(model, filled_cache(cfg, b, max_len, fill, v))
    finally:
      moe_mod.moe_dispatch = orig
  sec = interleaved(steppers, iters)
  res = {"batch": b, "max_len": max_len, "filled": fill, "view": view, "rounds": iters}
  res.update({f"{n}_tokens_per_s": b / t for n, t in sec.items()})
  res["after_over_before"] = sec["before"] / sec["after"]
  return res


def bench_engine(cfg, model, prompt_len, new_tokens, episodes):
  graphdef, params, rest = split_model(model)
  slots = cfg.rl.decode_batch
  rs = np.random.RandomState(0)
  v = cfg.model.vocab_size

  def reqs(tag):
    return [Request((tag, i), [int(t) for t in rs.randint(0, v, prompt_len)], new_tokens, ())
            for i in range(episodes)]

  eng = Engine(graphdef, params, rest, cfg, n_slots=slots, max_len=cfg.rl.max_context, seed=0)

  def play(tag):
    out = []
    pending = reqs(tag)
    for r in pending[:slots]:
      eng.submit(r)
    queue = pending[slots:]
    while eng.busy():
      for g in eng.step():
        out.append(g)
        eng.release(g.key)
        if queue:
          eng.submit(queue.pop(0))
    return out

  play("warm")  # compiles every bucket used
  steps0, t0 = eng.stats["steps"], time.perf_counter()
  gens = play("timed")
  sec = time.perf_counter() - t0
  n = sum(len(g.tokens) for g in gens)
  return {"slots": slots, "episodes": episodes, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
          "generated_tokens": n, "seconds": sec, "rollout_tokens_per_s": n / sec,
          "model_calls": eng.stats["steps"] - steps0}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="fewer iterations, shorter rollouts")
  args = ap.parse_args()
  iters = 3 if args.quick else 7
  res = {}
  tiny = load_config("configs/tiny.yaml")
  # per-layer modules: the expanded-K/V variant patches one KVLayerCache per layer
  bench = load_config("configs/bench.yaml", ["model.scan_layers=false"])
  bm = build_model(bench, seed=0)
  res["decode_4k_bench"] = bench_4k(bench, bm, batch=4, iters=iters)
  print(res["decode_4k_bench"], flush=True)
  res["decode_fixes_bench"] = bench_fixes(bench, bm, iters=2 * iters)
  print(res["decode_fixes_bench"], flush=True)
  tm = build_model(tiny, seed=0)
  res["engine_tiny"] = bench_engine(tiny, tm, prompt_len=64, new_tokens=64 if args.quick else 128,
                                    episodes=2 * tiny.rl.decode_batch)
  print(res["engine_tiny"], flush=True)
  res["engine_bench"] = bench_engine(bench, bm, prompt_len=64, new_tokens=16 if args.quick else 32,
                                     episodes=2 * bench.rl.decode_batch)
  print(res["engine_bench"], flush=True)
  res["note"] = ("float32 params and compute (the configs' dtypes); tokens/s = rows / median step "
                 "seconds, the variants of one comparison timed in turn each round; engine: generated "
                 "tokens / wall seconds after a warm-up run")
  backend = jax.default_backend()
  write_result("rl_decode" if backend == "cpu" else f"rl_decode_{backend}", res)


if __name__ == "__main__":
  main()

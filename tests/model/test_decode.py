"""The decode path the RL sampler stands on: ragged batches, bounded attention, overflow refused, the
small-batch MoE dispatch, and router replay with missing routes. The reference is always the training
forward (expanded attention, grouped matmul) of each sequence on its own, float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.model import init_cache, routing
from composer_jax.model.cache import bucket, check_room
from composer_jax.model.moe import (
  decode_layout,
  dropless_moe,
  moe_dispatch,
  per_pair_moe,
)
from tests.model.test_numerics import close, make


@pytest.fixture(scope="module")
def setup():
  return make()


def _ragged_run(model, cfg, seqs, prompt_lens, steps, view=None):
  """Prefill prompts of different lengths in one batch, then decode ``steps`` tokens per row; row 1
  sits out step 1 (fed nothing). Returns per-row lists of logits at every fed valid position."""
  b, max_len = len(seqs), 32
  run = nnx.jit(lambda m, t, sg, c: m(t, segment_ids=sg, cache=c))
  s = max(prompt_lens)
  toks = np.zeros((b, s), np.int32)
  seg = np.zeros((b, s), np.int32)
  for r, (q, n) in enumerate(zip(seqs, prompt_lens)):
    toks[r, :n], seg[r, :n] = q[:n], 1
  cache = init_cache(cfg.model, b, max_len)
  if view:
    cache = cache.with_view(view)
  out = run(model, toks, seg, cache)
  got = [[np.asarray(out.logits[r, :n])] for r, n in enumerate(prompt_lens)]
  cache, pos = out.cache, list(prompt_lens)
  for step in range(steps):
    active = [not (r == 1 and step == 1) for r in range(b)]
    toks = np.array([[seqs[r][pos[r]] if active[r] else 0] for r in range(b)], np.int32)
    seg = np.array([[int(a)] for a in active], np.int32)
    out = run(model, toks, seg, cache)
    cache = out.cache
    for r in range(b):
      if active[r]:
        got[r].append(np.asarray(out.logits[r]))
        pos[r] += 1
  return [np.concatenate(g, 0) for g in got], cache, pos


def test_ragged_batch_decode_matches_per_sequence_forward(setup):
  """Prompts of 5, 9 and 2 tokens share one prefill, then 4 decode steps (one row idle for a step):
  every row's logits equal its own full forward (2e-5 relative to the largest logit)."""
  cfg, model, _ = setup
  lens = [5, 9, 2]
  seqs = [np.asarray(jax.random.randint(jax.random.PRNGKey(20 + r), (16,), 0, 97)) for r in range(3)]
  # Attention reads a bounded view (16 of the 32 slots: a bucket >= the longest row).
  got, cache, pos = _ragged_run(model, cfg, seqs, lens, steps=4, view=bucket(12, 32))
  np.testing.assert_array_equal(np.asarray(cache.index), pos)
  assert pos == [9, 12, 6] and cache.layers[0].view == 16
  # Training forward, each row on its own (rows of a causal forward never mix; the tail past pos[r]
  # is not compared, so one batched call is each sequence's own forward).
  full = nnx.jit(lambda m, t: m(t).logits)(model, jnp.asarray(np.stack(seqs)[:, :12]))
  for r in range(3):
    close(got[r], full[r, : pos[r]], rtol=2e-5)


def test_overflow_is_refused_in_one_line(setup):
  cfg, model, _ = setup
  cache = init_cache(cfg.model, 2, 8)
  with pytest.raises(ValueError, match="decode cache overflow: row 1 holds 0 tokens \\+ 9 new > max_len 8"):
    model(jnp.zeros((2, 9), jnp.int32), segment_ids=jnp.asarray([[1] * 3 + [0] * 6, [1] * 9]), cache=cache)
  check_room([7, 3], [1, 5], 8)  # exactly full is fine
  with pytest.raises(ValueError, match="row 0 holds 8 tokens"):
    check_room([8, 0], [1, 0], 8)
  assert [bucket(n, 64) for n in (1, 16, 17, 40, 65)] == [16, 16, 32, 64, 64]


def test_decode_layout_by_backend():
  """CPU/TPU decode: per-pair up to 64 pairs, then 16-row blocks while groups average <= 8 rows;
  GPU decode and every quantized recipe: the training layout (None)."""
  for backend in ("cpu", "tpu"):
    assert decode_layout(18, 8, "bf16", backend) == "per_pair"
    assert decode_layout(90, 16, "bf16", backend) == 16
    assert decode_layout(200, 16, "bf16", backend) is None
    assert decode_layout(18, 8, "mxfp8", backend) is None
  assert {decode_layout(p, 16, "bf16", "gpu") for p in (18, 90, 200)} == {None}


def test_per_pair_dispatch_equals_grouped_matmul(setup):
  """The small-batch dispatch (one (token, slot) pair at a time) against the training grouped matmul and a
  float64 NumPy sum over experts: 1e-5 relative, float32."""
  _, model, _ = setup
  layer = model.layers[1].mlp
  w = [getattr(layer, n)[...] for n in ("w_gate", "w_up", "w_down")]
  rs = np.random.RandomState(3)
  x = jnp.asarray(rs.randn(6, 32), jnp.float32)
  ids = jnp.asarray(np.stack([rs.choice(8, 3, replace=False) for _ in range(6)]), jnp.int32)
  gate = jnp.asarray(rs.rand(6, 3), jnp.float32)
  small = per_pair_moe(x, ids, gate, *w)
  close(small, dropless_moe(x, ids, gate, *w), rtol=1e-5)
  per_pair = decode_layout(18, 8, "bf16", jax.default_backend()) == "per_pair"  # all but GPU
  close(moe_dispatch(x, ids, gate, *w), small if per_pair else dropless_moe(x, ids, gate, *w), rtol=0)
  close(moe_dispatch(x, ids, gate, *w, per_pair_max=0), dropless_moe(x, ids, gate, *w), rtol=0)
  # Past the per-pair bound (90 pairs > 64) decode keeps the grouped matmul, on 16-row blocks.
  xl = jnp.asarray(rs.randn(30, 32), jnp.float32)
  idl = jnp.asarray(np.stack([rs.choice(8, 3, replace=False) for _ in range(30)]), jnp.int32)
  gl = jnp.asarray(rs.rand(30, 3), jnp.float32)
  close(moe_dispatch(xl, idl, gl, *w), dropless_moe(xl, idl, gl, *w), rtol=1e-6)
  xd, wd = np.asarray(x, np.float64), [np.asarray(a, np.float64) for a in w]
  silu = lambda v: v / (1 + np.exp(-v))
  want = np.stack([sum(gate[t, j] * (silu(xd[t] @ wd[0][e]) * (xd[t] @ wd[1][e])) @ wd[2][e]
                       for j, e in enumerate(np.asarray(ids[t]))) for t in range(6)])
  close(small, want, rtol=1e-5)


def test_replay_with_missing_routes_uses_the_live_router(setup):
  """Tokens whose recorded ids contain -1 are routed live (all k slots); the others replay exactly."""
  cfg, _, _ = setup
  rs = np.random.RandomState(4)
  logits = jnp.asarray(rs.randn(5, 8), jnp.float32)
  bias = jnp.asarray(0.1 * rs.randn(8), jnp.float32)
  live, _, scores = routing.route(logits, bias, cfg.model)
  replay = np.array([[0, 1, 2], [-1, -1, -1], [7, 6, 5], [3, -1, 4], [5, 4, 3]], np.int32)
  ids, w, _ = routing.route(logits, bias, cfg.model, jnp.asarray(replay))
  want = replay.copy()
  want[[1, 3]] = np.asarray(live)[[1, 3]]
  np.testing.assert_array_equal(ids, want)
  s = np.asarray(scores, np.float64)
  sel = np.take_along_axis(s, want, 1)
  np.testing.assert_allclose(w, sel / sel.sum(1, keepdims=True) * 2.5, rtol=1e-6)

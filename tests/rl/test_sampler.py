"""The rollout engine against the training forward: token-in-token-out, log-probs, routed experts,
continuous batching, context overflow; and the sampling rule against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import load_config
from composer_jax.model import build_model
from composer_jax.rl.sampler import Engine, Request, sample, truncate
from composer_jax.train.step import split_model
from tests.model.test_numerics import OVR

V = 97


def _cfg(extra=()):
  return load_config("configs/tiny.yaml", OVR + ["rl.temperature=0.7", "rl.top_p=0.95"] + list(extra))


def _setup(extra=()):
  cfg = _cfg(extra)
  model = build_model(cfg, seed=3)
  for i, layer in enumerate(model.moe_modules()):  # a non-zero selection bias, as in training
    layer.router_bias.set_value(0.05 * jax.random.normal(jax.random.PRNGKey(10 + i), layer.router_bias.shape))
  return cfg, model


@pytest.fixture(scope="module")
def setup():
  return _setup()


def _log_softmax64(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_sampling_rule_against_numpy():
  rs = np.random.RandomState(0)
  logits = jnp.asarray(rs.randn(3, 6) * 2, jnp.float32)
  key = jax.random.PRNGKey(1)
  ids, logp = sample(logits, key, temperature=0.0)
  np.testing.assert_array_equal(ids, np.argmax(np.asarray(logits), -1))
  np.testing.assert_allclose(logp, _log_softmax64(logits)[np.arange(3), ids], atol=1e-6)
  # top-k / top-p by hand on one row: probs .5 .2 .15 .1 .05 -> top_p=.8 keeps 3 ids, top_k=2 keeps 2
  p = np.array([[0.5, 0.2, 0.15, 0.1, 0.05]])
  sc = jnp.asarray(np.log(p), jnp.float32)
  assert np.isfinite(np.asarray(truncate(sc, top_p=0.8))).sum() == 3
  assert np.isfinite(np.asarray(truncate(sc, top_p=0.86))).sum() == 4
  assert np.isfinite(np.asarray(truncate(sc, top_k=2))).sum() == 2
  assert np.isfinite(np.asarray(truncate(sc, top_k=2, top_p=0.1))).sum() == 1
  # Draw frequencies follow the truncated, renormalised distribution (4 sigma on 20k draws); the
  # reported log-prob is the full-vocabulary one at temperature T.
  n = 20000
  rows = jnp.tile(sc * 0.5, (n, 1))  # T = 0.5 undoes the 0.5 scaling: the distribution is p
  ids, logp = sample(rows, jax.random.PRNGKey(2), temperature=0.5, top_p=0.8)
  freq = np.bincount(np.asarray(ids), minlength=5) / n
  want = np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85
  assert np.all(np.abs(freq - want) <= 4 * np.sqrt(want * (1 - want) / n) + 1e-9), freq
  np.testing.assert_allclose(logp, np.log(p[0])[np.asarray(ids)], atol=1e-5)


def _nucleus_by_sorting(scaled, top_k, top_p):
  """NumPy reference of the truncation rule: sort, keep the top-k (and ids tied with the k-th), then
  the smallest prefix whose mass reaches top_p (first id always) and every id tied with its last."""
  keep = np.zeros(scaled.shape, bool)
  for r, row in enumerate(np.asarray(scaled, np.float64)):
    order = np.argsort(-row, kind="stable")
    if top_k:  # ids tied with the k-th logit stay in
      order = order[row[order] >= row[order[top_k - 1]]]
    p = np.exp(row[order] - row[order].max())
    p /= p.sum()
    n = max(1, int(np.sum(np.cumsum(p) - p < top_p)))
    keep[r] = row >= row[order[n - 1]]
  return keep


@pytest.mark.parametrize("top_k", [0, 40])
def test_nucleus_bisection_equals_sorting(top_k):
  """truncate finds the nucleus by bisection on the logit value; it keeps exactly the ids the
  sorted definition keeps: 64 rows of 2048 logits at several scales (peaked to flat), with ties,
  at top_p from 0.05 to 0.99."""
  rs = np.random.RandomState(0)
  rows = rs.randn(64, 2048) * np.repeat([0.1, 1.0, 3.0, 8.0], 16)[:, None]
  rows[::7, :50] = rows[::7, :1]  # 50-way ties at the top
  rows[1::5] = np.round(rows[1::5], 1)  # many ties everywhere
  rows = rows.astype(np.float32)
  for top_p in (0.05, 0.5, 0.9, 0.99):
    got = np.isfinite(np.asarray(truncate(jnp.asarray(rows), top_k, top_p)))
    want = _nucleus_by_sorting(rows, top_k, top_p)
    assert (got != want).sum() == 0, (top_p, np.nonzero((got != want).any(1))[0])


def trainer_view(model, keys, seqs, fed, temperature):
  """The trainer's view of finished episodes: one batched forward, each row right-padded (causal
  rows are independent). Checks token in, token out (the fed tokens plus the final token are the
  sequence); returns float64 log_softmax(logits / T) [b, s, V] and the routing [n_moe, b, s, k]."""
  n = max(len(s) for s in seqs.values())
  batch = np.zeros((len(keys), n), np.int32)
  for r, k in enumerate(keys):
    assert fed[k] + [seqs[k][-1]] == seqs[k]  # token-in-token-out
    batch[r, : len(seqs[k])] = seqs[k]
  out = nnx.jit(lambda m, t: m(t, return_routing=True))(model, jnp.asarray(batch))
  return _log_softmax64(np.asarray(out.logits) / temperature), np.asarray(out.routed_experts)


@pytest.mark.parametrize("prefill_rows,scan", [(0, False), (1, False), (2, False), (2, True)])
def test_engine_matches_training_forward_over_multiturn_episodes(setup, prefill_rows, scan):
  """Four episodes on three slots (the fourth waits for a release; its 19-token prompt is prefilled
  in two chunks while the others decode), two turns each, weights swapped
  (same values, new version) mid-run. For every episode: the fed tokens, concatenated, plus the final
  token, are its whole sequence; each sampled log-prob equals log_softmax(logits / T) of the training
  forward on that sequence (1e-5 absolute, float32); each fed token's experts equal the forward's
  return_routing choices. Prefills ride in the mixed call (prefill_rows=0), or go in calls of their
  own over one row, or over two rows (one reading row padded with a slot that feeds nothing, whose
  cache must come back untouched), also with the MoE layers' caches stacked (model.scan_layers)."""
  cfg, model = _setup(["model.scan_layers=true"]) if scan else setup
  graphdef, params, rest = split_model(model)
  eng = Engine(graphdef, params, rest, cfg, n_slots=3, max_len=128, seed=5, prefill_chunk=16,
               prefill_rows=prefill_rows)
  rs = np.random.RandomState(7)
  prompts = {k: [int(t) for t in rs.randint(0, V, n)] for k, n in zip("abcd", (5, 11, 3, 19))}
  stops = tuple(range(0, V, 9))  # some ids stop a turn early
  seqs = {k: list(p) for k, p in prompts.items()}
  fed = {k: [] for k in prompts}
  gens = {k: [] for k in prompts}
  where = {k: [] for k in prompts}
  for k, prompt in prompts.items():
    eng.submit(Request(k, prompt, 6, stops))
  assert eng.free_slots() == 3
  steps = 0
  while eng.busy():
    for g in eng.step():
      k = g.key
      gens[k].append(g)
      fed[k] += [int(t) for t in g.context_tokens]
      where[k].append(len(seqs[k]) + np.arange(len(g.tokens)))  # sequence positions of the ids
      seqs[k] += [int(t) for t in g.tokens]
      assert g.context_experts.dtype == np.int8
      assert g.context_experts.shape == (len(g.context_tokens), cfg.model.n_moe_layers, 3)
      assert len(g.logprobs) == len(g.tokens) >= 1
      turn_stops = tuple(range(V)) if (k == "c" and len(gens[k]) == 2) else stops
      assert g.finish == ("stop" if g.tokens[-1] in turn_stops else "length")
      assert all(t not in turn_stops for t in g.tokens[:-1])
      if g.finish == "length":
        assert len(g.tokens) == (6 if len(gens[k]) == 1 else 5)
      if len(gens[k]) == 1:  # a tool observation, then the second turn; "c" must stop at once
        obs = [int(t) for t in rs.randint(0, V, 4)]
        seqs[k] += obs
        eng.submit(Request(k, obs, 5, tuple(range(V)) if k == "c" else stops))
      else:
        eng.release(k)
    steps += 1
    if steps == 4:
      eng.set_weights(params, rest, version=1)
    if steps == 1:  # "a", "b", "c" hold the slots; "d" waits for a release
      assert eng.free_slots() == 0 and eng._slot_of.keys() == {"a", "b", "c"}
  assert all(len(g) == 2 for g in gens.values())
  assert gens["c"][1].finish == "stop" and len(gens["c"][1].tokens) == 1
  assert {int(v) for g in gens.values() for gg in g for v in gg.token_versions} == {0, 1}
  assert eng.stats["tokens_decoded"] == sum(len(gg.tokens) for g in gens.values() for gg in g)
  keys = list(prompts)
  logp_all, routing = trainer_view(model, keys, seqs, fed, cfg.rl.temperature)
  for r, k in enumerate(keys):
    for g, at in zip(gens[k], where[k]):  # the id at position i is sampled from the logits at i - 1
      np.testing.assert_allclose(g.logprobs, logp_all[r, at - 1, np.asarray(g.tokens)], atol=1e-5)
    n_fed = len(fed[k])
    want = routing[:, r, :n_fed].transpose(1, 0, 2)
    got = np.concatenate([g.context_experts for g in gens[k]]).astype(np.int32)
    np.testing.assert_array_equal(got, want)


def test_context_full_stops_the_turn(setup):
  """A turn that runs out of cache stops with finish="context" (its last token never fed); a turn
  whose tokens cannot be read at all is refused the same way, feeding nothing."""
  cfg, model = setup
  graphdef, params, rest = split_model(model)
  eng = Engine(graphdef, params, rest, cfg, n_slots=2, max_len=20, seed=1)
  g, = eng.run([Request("x", list(range(1, 13)), 30, ())])
  assert g.finish == "context" and len(g.tokens) == 9 and len(g.context_tokens) == 20
  g2, = eng.run([Request("x", [5, 6], 4, ())])
  assert g2.finish == "context" and len(g2.tokens) == 0 and len(g2.context_tokens) == 0
  eng.release("x")
  assert eng.free_slots() == 2 and not eng.busy()
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    eng.submit(Request("y", [1], 0, ()))
  eng.submit(Request("z", [1], 1, ()))
  with pytest.raises(ValueError, match="still waiting"):
    eng.release("z")
  # Explicit keys: one seed replays the same draws (the compiled call is shared); another differs.
  again = [Engine(graphdef, params, rest, cfg, n_slots=2, max_len=20, seed=s).run(
      [Request("x", list(range(1, 13)), 30, ())])[0].tokens for s in (1, 2)]
  np.testing.assert_array_equal(again[0], g.tokens)
  assert not np.array_equal(again[1], g.tokens)


def test_engines_of_one_model_share_the_compiled_call(setup):
  """Two loads of one run give equal but distinct graphdefs: their engines share one jitted call
  (and so its compiled buckets); another sampling rule or another model structure gets its own."""
  cfg, model = setup
  g1, params, rest = split_model(model)
  g2 = split_model(build_model(cfg, seed=4))[0]
  assert g1 is not g2
  e1, e2 = (Engine(g, params, rest, cfg, n_slots=2, max_len=20) for g in (g1, g2))
  assert e1._fn is e2._fn
  assert Engine(g1, params, rest, _cfg(["rl.temperature=0.9"]), n_slots=2, max_len=20)._fn is not e1._fn
  small = _cfg(["model.n_layers=2"])
  g3, p3, r3 = split_model(build_model(small, seed=3))
  assert Engine(g3, p3, r3, small, n_slots=2, max_len=20)._fn is not e1._fn

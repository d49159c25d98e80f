"""Speculative decoding with the MTP head (rl.speculative_mtp): the verification rule against NumPy
(emitted ids distributed as the target, acceptance = sum min(p, q)), and the engine with drafts
against the training forward and against the engine without them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import ConfigError, load_config
from composer_jax.model import build_model
from composer_jax.rl.sampler import Engine, Request, sample
from composer_jax.rl.sampling import speculative_verify
from composer_jax.train.step import split_model
from tests.model.test_numerics import OVR
from tests.rl.test_sampler import trainer_view

V = 97


def _cfg(extra=()):
  return load_config("configs/tiny.yaml", OVR + list(extra))


def _softmax64(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _within(freq, want, n, sigmas=4.5):
  return np.all(np.abs(freq - want) <= sigmas * np.sqrt(want * (1 - want) / n) + 1e-9)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_verification_emits_the_target_distribution(top_p):
  """40k rows, one target and one draft distribution over 6 ids (T = 0.5). The draft is sampled from
  q as the engine samples it. Whatever was drafted, the first emitted id follows the target p
  (truncated to the top-p nucleus and renormalised, computed here in NumPy), the draft is kept with
  probability sum_i min(p_i, q_i), the bonus id after a kept draft follows the position-1 target,
  and the reported log-probs are log_softmax(logits / T) of the full vocabulary. Rows without a
  draft sample p directly."""
  n, t = 40000, 0.5
  p_logits = np.array([2.0, 1.5, 0.3, 0.0, -1.0, -3.0])
  q_logits = np.array([0.0, 2.2, 1.0, -0.5, 0.5, 0.0])  # a poor drafter
  b_logits = np.array([-1.0, 0.0, 3.0, 0.5, 0.0, 1.0])

  def nucleus(logits):  # NumPy: the top-p nucleus of softmax(logits / T), renormalised
    pr = _softmax64(logits / t)
    order = np.argsort(-pr)
    keep = np.zeros_like(pr, bool)
    keep[order[(np.cumsum(pr[order]) - pr[order]) < top_p]] = True
    out = np.where(keep, pr, 0)
    return out / out.sum()

  p, q, pb = nucleus(p_logits), nucleus(q_logits), nucleus(b_logits)
  tile = lambda a: jnp.tile(jnp.asarray(a, jnp.float32)[None], (n, 1))
  draft, _ = sample(tile(q_logits), jax.random.PRNGKey(0), t, 0, top_p)
  np.testing.assert_allclose(np.bincount(np.asarray(draft), minlength=6) / n, q, atol=0.015)
  target = jnp.stack([tile(p_logits), tile(b_logits)], axis=1)
  has = jnp.arange(n) % 4 != 0  # every fourth row has no draft
  ids, logp, count = speculative_verify(target, tile(q_logits), draft, has, jax.random.PRNGKey(1), t,
                                        0, top_p)
  ids, logp, count, has = (np.asarray(a) for a in (ids, logp, count, has))
  first = ids[:, 0]
  for rows in (has, ~has):
    assert _within(np.bincount(first[rows], minlength=6) / rows.sum(), p, rows.sum()), rows.sum()
  assert np.all(count[~has] == 1)
  kept = count == 2
  np.testing.assert_array_equal(first[kept], np.asarray(draft)[kept])
  accept = np.minimum(p, q).sum()  # the textbook acceptance rate of one draft
  assert abs(kept[has].mean() - accept) < 4.5 * np.sqrt(accept * (1 - accept) / has.sum())
  assert _within(np.bincount(ids[kept, 1], minlength=6) / kept.sum(), pb, kept.sum())
  full = [np.log(_softmax64(lg / t)) for lg in (p_logits, b_logits)]
  np.testing.assert_allclose(logp[:, 0], full[0][first], atol=1e-5)
  np.testing.assert_allclose(logp[kept, 1], full[1][ids[kept, 1]], atol=1e-5)


def test_greedy_verification_by_hand():
  target = jnp.asarray([[[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]],  # argmax 1: draft 1 kept, bonus 0
                        [[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]],  # draft 2 rejected: emits 1
                        [[5.0, 3.0, 1.0], [0.0, 0.0, 9.0]]])  # no draft: emits 0
  ids, logp, count = speculative_verify(target, jnp.zeros((3, 3)), jnp.asarray([1, 2, 1]),
                                        jnp.asarray([True, True, False]), jax.random.PRNGKey(0), 0.0)
  np.testing.assert_array_equal(count, [2, 1, 1])
  np.testing.assert_array_equal(np.asarray(ids)[:, 0], [1, 1, 0])
  assert int(ids[0, 1]) == 0
  lsm = np.log(_softmax64(np.asarray(target)))
  np.testing.assert_allclose(logp[:, 0], lsm[np.arange(3), 0, [1, 1, 0]], atol=1e-6)


@pytest.fixture(scope="module")
def model():
  m = build_model(_cfg(), seed=3)
  for i, layer in enumerate(m.moe_modules()):  # a non-zero selection bias, as in training
    layer.router_bias.set_value(0.05 * jax.random.normal(jax.random.PRNGKey(10 + i), layer.router_bias.shape))
  return m


def _episodes(eng, prompts, stops, rs, new_tokens=(9, 7)):
  """Two turns per episode (the second after a 4-token observation); the episodes' sequences, the
  tokens fed, and their generations in order."""
  seqs = {k: list(p) for k, p in prompts.items()}
  fed = {k: [] for k in prompts}
  gens = {k: [] for k in prompts}
  for k, prompt in prompts.items():
    eng.submit(Request(k, prompt, new_tokens[0], stops))
  while eng.busy():
    for g in eng.step():
      k = g.key
      assert len(g.logprobs) == len(g.tokens) == len(g.token_versions) >= 1
      assert g.finish == ("stop" if g.tokens[-1] in stops else "length")
      assert all(int(t) not in stops for t in g.tokens[:-1])
      if g.finish == "length":
        assert len(g.tokens) == new_tokens[len(gens[k])]
      gens[k].append((len(seqs[k]), g))
      fed[k] += [int(t) for t in g.context_tokens]
      seqs[k] += [int(t) for t in g.tokens]
      if len(gens[k]) == 1:
        obs = [int(t) for t in rs.randint(0, V, 4)]
        seqs[k] += obs
        eng.submit(Request(k, obs, new_tokens[1], stops))
      else:
        eng.release(k)
  return seqs, fed, gens


@pytest.mark.parametrize("prefill_rows", [0, 2])
def test_drafting_engine_matches_the_training_forward(model, prefill_rows):
  """At T = 30 the target and the untrained drafter are both near uniform, so most drafts are kept
  (bonus tokens, turns ending on a kept draft that is rolled back) and some are rejected. Over five
  two-turn episodes on three slots (prompts prefilled in chunks while others decode): token in,
  token out; every log-prob equals log_softmax(logits / T) of one training forward (1e-5); every fed
  token's experts equal the forward's routing; the engine emits more than one token per decode call."""
  cfg = _cfg(["rl.temperature=30", "rl.speculative_mtp=true"])
  graphdef, params, rest = split_model(model)
  eng = Engine(graphdef, params, rest, cfg, n_slots=3, max_len=64, seed=5, prefill_chunk=16,
               prefill_rows=prefill_rows)  # 2: compact prefill calls gather the MTP cache rows too
  rs = np.random.RandomState(7)
  prompts = {k: [int(t) for t in rs.randint(0, V, n)] for k, n in zip("abcde", (5, 11, 3, 19, 6))}
  seqs, fed, gens = _episodes(eng, prompts, tuple(range(0, V, 11)), rs)
  st = eng.stats
  assert st["drafts"] >= 20 and 0.5 < eng.acceptance_rate() < 1.0, dict(st)
  assert st["tokens_decoded"] == sum(len(g.tokens) for gs in gens.values() for _, g in gs)
  keys = list(prompts)
  logp_all, routing = trainer_view(model, keys, seqs, fed, cfg.rl.temperature)
  for r, k in enumerate(keys):
    for start, g in gens[k]:
      at = start + np.arange(len(g.tokens))
      np.testing.assert_allclose(g.logprobs, logp_all[r, at - 1, g.tokens], atol=1e-5)
    got = np.concatenate([g.context_experts for _, g in gens[k]]).astype(np.int32)
    np.testing.assert_array_equal(got, routing[:, r, : len(fed[k])].transpose(1, 0, 2))


@pytest.fixture(scope="module")
def counting_model():
  """The small model trained 50 steps (lr 1e-2) on sequences counting by 3 mod V: the main head and
  the MTP head both learn the pattern, so greedy drafts are mostly right."""
  from composer_jax.data.pipeline import target_mask
  from composer_jax.train.loop import build_trainer, put_batch
  cfg = _cfg(["optim.lr=1e-2", "optim.warmup_steps=5", "optim.schedule=constant",
              "data.batch_size=16", "data.seq_len=24"])
  tr = build_trainer(cfg)
  rs = np.random.RandomState(0)
  seg = np.ones((16, 24), np.int32)
  for _ in range(50):
    toks = ((rs.randint(0, V, (16, 1)) + 3 * np.arange(24)[None]) % V).astype(np.int32)
    batch = {"tokens": toks, "segment_ids": seg, "positions": np.tile(np.arange(24, dtype=np.int32), (16, 1)),
             "loss_mask": target_mask(seg)}
    tr.state, metrics = tr.step_fn(tr.state, put_batch(tr, batch))
  assert float(metrics["mtp_ce"]) < 0.5, float(metrics["mtp_ce"])
  return tr.graphdef, tr.state["params"], tr.state["rest"]


def test_near_greedy_drafting_changes_nothing(counting_model):
  """At T = 1e-3 sampling is argmax: on the counting model the engine with drafts emits exactly the
  tokens, fed tokens and turn ends of the engine without them, in fewer model calls (measured 26
  against 44). Rejections are covered at T = 30 above and by the rule's own tests."""
  runs = {}
  for spec in (False, True):
    cfg = _cfg(["rl.temperature=0.001", f"rl.speculative_mtp={str(spec).lower()}"])
    eng = Engine(*counting_model, cfg, n_slots=2, max_len=64, seed=spec, prefill_chunk=16)
    rs = np.random.RandomState(3)
    prompts = {k: [(s0 + 3 * j) % V for j in range(n)] for k, n, s0 in zip("abc", (7, 18, 4), (5, 40, 90))}
    runs[spec] = _episodes(eng, prompts, (95,), rs, new_tokens=(12, 10)), dict(eng.stats)
  (seqs0, fed0, _), st0 = runs[False]
  (seqs1, fed1, _), st1 = runs[True]
  assert seqs0 == seqs1 and fed0 == fed1
  assert st1["tokens_decoded"] == st0["tokens_decoded"]
  assert st1["drafts_kept"] > st1["drafts"] // 2, st1
  assert st1["steps"] < 0.7 * st0["steps"], (st0["steps"], st1["steps"])


def test_drafting_needs_an_mtp_head():
  with pytest.raises(ConfigError, match="rl.speculative_mtp=true drafts with the MTP head"):
    _cfg(["model.mtp_depths=0", "rl.speculative_mtp=true"])

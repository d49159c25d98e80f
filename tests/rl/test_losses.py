"""RL losses against hand-computed examples and float64 NumPy references (value and gradient)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import RLConfig
from composer_jax.model.loss import shifted_ce
from composer_jax.rl import losses

LN = math.log
# Jitted entry points: eager dispatch of many tiny ops costs more here than one compile.
token_logprobs = jax.jit(losses.token_logprobs, static_argnames=("temperature", "with_entropy"))
teacher_targets = jax.jit(losses.teacher_targets, static_argnames=("topk",))
feedback_kl = jax.jit(losses.feedback_kl, static_argnames=("topk", "per_token"))


def policy_loss(logp, batch, cfg, denom=None):
  return jax.jit(lambda lp, b, d: losses.policy_loss(lp, b, cfg, d))(logp, batch, denom)


def _grad(fn, *args):
  return jax.jit(jax.grad(fn))(*args)


# ------------------------------------------------------------------------------------------------
# token_logprobs
# ------------------------------------------------------------------------------------------------

def test_token_logprobs_hand():
  # row 0 probs [1/4, 1/2, 1/4]; row 1 probs [3/5, 1/5, 1/5]; row 2 never predicts anything
  logits = jnp.array([[[0.0, LN(2), 0.0], [LN(3), 0.0, 0.0], [5.0, -1.0, 2.0]]])
  tokens = jnp.array([[2, 1, 0]])
  lp, ent = token_logprobs(logits, tokens, with_entropy=True)
  np.testing.assert_allclose(lp, [[0.0, LN(0.5), LN(0.6)]], atol=1e-6)  # target-aligned, row 0 = 0
  h0 = -(2 * 0.25 * LN(0.25) + 0.5 * LN(0.5))  # 1.039721
  h1 = -(0.6 * LN(0.6) + 2 * 0.2 * LN(0.2))  # 0.950271
  np.testing.assert_allclose(ent, [[0.0, h0, h1]], atol=1e-6)
  # temperature 2: row 0 probs proportional to [1, sqrt 2, 1] -> p(1) = sqrt2 / (2 + sqrt2) = 0.414214
  lp2 = token_logprobs(logits, tokens, temperature=2.0)
  assert float(lp2[0, 1]) == pytest.approx(LN(math.sqrt(2) / (2 + math.sqrt(2))), abs=1e-6)


def test_token_logprobs_matches_shifted_ce():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 7, 11)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 11, (2, 7)), jnp.int32)
  mask = jnp.ones((2, 7)).at[:, 0].set(0.0)  # target-aligned: position 0 has no prediction
  ce, n, _ = jax.jit(lambda lg, t, m: shifted_ce(lg, t, m, None, 1))(logits, tokens, mask)
  lp = token_logprobs(logits, tokens)
  assert float(-(lp * mask).sum() / mask.sum()) == pytest.approx(float(ce), rel=1e-6)
  assert float(n) == 12


# ------------------------------------------------------------------------------------------------
# policy_loss: a hand example (numbers written out) ...
# ------------------------------------------------------------------------------------------------

def _hand_batch(with_ref=False):
  # row 0: A = +1, ratios r = [1.5, 0.5], sampler ratios exp(old - sampler) = [3, 0.8]
  # row 1: A = -2, ratio r = 0.7, sampler ratio 1; position 2 is padding holding garbage (50)
  old = np.array([[0.0, -1.0, -1.0], [0.0, -0.5, 50.0]])
  logp = np.array([[0.0, -1.0 + LN(1.5), -1.0 + LN(0.5)], [0.0, -0.5 + LN(0.7), -50.0]])
  sampler = np.array([[0.0, -1.0 - LN(3.0), -1.0 + LN(1.25)], [0.0, -0.5, 9.0]])
  batch = {"old_logp": old, "sampler_logp": sampler, "advantages": np.array([1.0, -2.0]),
           "loss_mask": np.array([[0, 1, 1], [0, 1, 0]], np.float32)}
  if with_ref:  # ref - logp = [ln 2, 0] on row 0, -ln 2 on row 1
    batch["ref_logp"] = logp + np.array([[0.0, LN(2), 0.0], [0.0, -LN(2), 0.0]])
  return jnp.asarray(logp, jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}


def test_policy_loss_hand_token_mean():
  logp, batch = _hand_batch()
  loss, m = policy_loss(logp, batch, RLConfig())
  # per token w * max(-A r, -A clip(r, 0.8, 1.28)):
  #   row 0 t1: r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped), w = min(3, 2) = 2  -> -2.56
  #   row 0 t2: r=0.5 -> max(-0.5, -0.8) = -0.5,  w = 0.8                      -> -0.40
  #   row 1 t1: r=0.7 -> max(1.4, 1.6) = 1.6 (clipped), w = 1                    -> +1.60
  assert float(loss) == pytest.approx((-2.56 - 0.4 + 1.6) / 3, abs=1e-6)  # -0.453333
  assert float(m["clip_frac"]) == pytest.approx(2 / 3, abs=1e-6)
  assert float(m["clip_frac_low"]) == pytest.approx(1 / 3, abs=1e-6)
  assert float(m["clip_frac_high"]) == pytest.approx(1 / 3, abs=1e-6)
  assert float(m["is_weight_mean"]) == pytest.approx((2 + 0.8 + 1) / 3, abs=1e-6)
  assert float(m["is_clipped_frac"]) == pytest.approx(1 / 3, abs=1e-6)
  assert float(m["train_infer_logprob_abs_diff"]) == pytest.approx((LN(3) + LN(1.25)) / 3, abs=1e-6)
  # k3 of KL(old||new): r - 1 - ln r = 0.094535, 0.193147, 0.056675
  k3 = [r - 1 - LN(r) for r in (1.5, 0.5, 0.7)]
  assert float(m["approx_kl"]) == pytest.approx(sum(k3) / 3, abs=1e-6)
  assert float(m["tokens"]) == 3 and np.isfinite(float(loss))


def test_policy_loss_hand_variants():
  logp, batch = _hand_batch()
  cfg = RLConfig()
  # seq_sum: row sums -2.96 and 1.6, mean over 2 sequences
  loss, _ = policy_loss(logp, batch, dataclasses.replace(cfg, loss_agg="seq_sum"))
  assert float(loss) == pytest.approx((-2.96 + 1.6) / 2, abs=1e-6)  # -0.68
  # sequence-level IS: row 0 geometric mean sqrt(3 * 0.8) = 1.549193 (< 2, kept), row 1: 1
  loss, m = policy_loss(logp, batch, dataclasses.replace(cfg, is_level="sequence"))
  assert float(loss) == pytest.approx((math.sqrt(2.4) * (-1.28 - 0.5) + 1.6) / 3, abs=1e-6)
  assert float(m["is_clipped_frac"]) == 0.0
  # IcePop mask: ratio 3 leaves [0.5, 2] -> that token is zeroed; 0.8 and 1 are kept as they are
  loss, m = policy_loss(logp, batch, dataclasses.replace(cfg, is_mode="mask"))
  assert float(loss) == pytest.approx((0.0 - 0.4 + 1.6) / 3, abs=1e-6)
  assert float(m["is_clipped_frac"]) == pytest.approx(1 / 3, abs=1e-6)
  # per-token advantages equal to the broadcast per-sequence ones give the same loss
  b2 = dict(batch, advantages=jnp.array([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]))
  assert float(policy_loss(logp, b2, cfg)[0]) == pytest.approx((-2.56 - 0.4 + 1.6) / 3, abs=1e-6)
  # an explicit global divisor (micro-batching): sum / 6
  assert float(policy_loss(logp, batch, cfg, denom=6.0)[0]) == pytest.approx(-1.36 / 6, abs=1e-6)


def test_policy_loss_hand_kl_and_gradient():
  logp, batch = _hand_batch(with_ref=True)
  cfg = RLConfig(kl_coef=0.1)
  loss, m = policy_loss(logp, batch, cfg)
  # k3 = e^d - d - 1 with d = ref - logp: ln2 -> 0.306853, 0 -> 0, -ln2 -> 0.193147 (sum 0.5)
  assert float(loss) == pytest.approx(-1.36 / 3 + 0.1 * 0.5 / 3, abs=1e-6)
  assert float(m["ref_kl"]) == pytest.approx(0.5 / 3, abs=1e-6)
  g = _grad(lambda lp: losses.policy_loss(lp, batch, cfg)[0], logp)
  # clipped tokens give no PG gradient; row 0 t2: w (-A r) / N = 0.8 * -0.5 / 3 = -0.133333;
  # KL: kl_coef (1 - e^d) / N = 0.1 * (1 - 2) / 3, 0, 0.1 * (1 - 0.5) / 3
  want = [[0.0, -0.1 / 3, -0.4 / 3], [0.0, 0.05 / 3, 0.0]]
  np.testing.assert_allclose(g, want, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# ... and a float64 NumPy reference on random inputs (value, analytic gradient, finite differences)
# ------------------------------------------------------------------------------------------------

def _np_policy_loss(logp, b, cfg):
  m = b["loss_mask"]
  adv = np.broadcast_to(b["advantages"][:, None], m.shape)
  r = np.exp(np.where(m > 0, logp - b["old_logp"], 0))
  pg = np.maximum(-adv * r, -adv * np.clip(r, 1 - cfg.ppo_clip_low, 1 + cfg.ppo_clip_high))
  d = np.where(m > 0, b["old_logp"] - b["sampler_logp"], 0)
  if cfg.is_level == "sequence":
    d = np.broadcast_to((d * m).sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1), m.shape)
  ir = np.exp(d)
  w = np.where((ir >= 1 / cfg.is_clip) & (ir <= cfg.is_clip), ir, 0) if cfg.is_mode == "mask" \
      else np.minimum(ir, cfg.is_clip)
  dk = np.where(m > 0, b["ref_logp"] - logp, 0)
  tok = w * pg + cfg.kl_coef * (np.exp(dk) - dk - 1)
  div = (m.sum(1) > 0).sum() if cfg.loss_agg == "seq_sum" else m.sum()
  return (tok * m).sum() / max(div, 1)


@pytest.mark.parametrize("over", [{}, {"loss_agg": "seq_sum"}, {"is_level": "sequence"},
                                  {"is_mode": "mask", "loss_agg": "seq_sum"}])
def test_policy_loss_random_vs_numpy(over):
  rng = np.random.default_rng(1)
  b, s = 3, 6
  cfg = RLConfig(kl_coef=0.05, **over)
  old = rng.normal(-2, 0.5, (b, s))
  logp = old + rng.normal(0, 0.3, (b, s))
  batch = {"old_logp": old, "sampler_logp": old + rng.normal(0, 0.5, (b, s)),
           "ref_logp": old + rng.normal(0, 0.2, (b, s)), "advantages": rng.normal(0, 1, b),
           "loss_mask": (rng.random((b, s)) < 0.7).astype(np.float64)}
  batch["loss_mask"][:, 0] = 0
  batch["loss_mask"][2] = 0  # a sequence with no trained token (padding row)
  jb = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}
  f = jax.jit(lambda lp: losses.policy_loss(lp, jb, cfg)[0])
  assert float(f(jnp.asarray(logp, jnp.float32))) == pytest.approx(_np_policy_loss(logp, batch, cfg),
                                                                   abs=1e-5)
  g = np.asarray(_grad(f, jnp.asarray(logp, jnp.float32)), np.float64)
  eps = 1e-6  # central differences of the float64 reference (ratios sit away from the clip kinks)
  fd = np.zeros_like(logp)
  for i in np.ndindex(*logp.shape):
    e = np.zeros_like(logp)
    e[i] = eps
    fd[i] = (_np_policy_loss(logp + e, batch, cfg) - _np_policy_loss(logp - e, batch, cfg)) / (2 * eps)
  np.testing.assert_allclose(g, fd, atol=2e-5)
  assert np.abs(fd).max() > 1e-3  # the check is not vacuous
  assert np.all(g[2] == 0) and np.all(g[:, 0] == 0)


def _np_logp_entropy(logits, tokens):
  z = logits - logits.max(-1, keepdims=True)
  logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
  lp = np.take_along_axis(logq[:, :-1], tokens[:, 1:, None], -1)[..., 0]
  ent = -(np.exp(logq) * logq).sum(-1)[:, :-1]
  pad = lambda x: np.pad(x, ((0, 0), (1, 0)))  # target-aligned: row t is about x_t
  return pad(lp), pad(ent)


@pytest.mark.parametrize("coef", [-0.3, 0.2])
def test_policy_loss_entropy_term_vs_numpy(coef):
  """rl.entropy_coef through the logits: value and gradient against a float64 reference."""
  rng = np.random.default_rng(2)
  b, s, v = 2, 4, 5
  logits = rng.normal(0, 1.5, (b, s, v))
  tokens = rng.integers(0, v, (b, s))
  lp0, _ = _np_logp_entropy(logits, tokens)
  batch = {"old_logp": lp0 + rng.normal(0, 0.1, (b, s)), "advantages": np.array([0.7, -0.4]),
           "loss_mask": np.array([[0, 1, 1, 1], [0, 1, 0, 1]], np.float64)}
  batch["sampler_logp"] = batch["old_logp"] + rng.normal(0, 0.1, (b, s))
  batch["ref_logp"] = batch["old_logp"]
  cfg = RLConfig(entropy_coef=coef)

  def ref(lg):
    lp, ent = _np_logp_entropy(lg, tokens)
    m = batch["loss_mask"]
    return _np_policy_loss(lp, batch, cfg) - coef * (ent * m).sum() / m.sum()

  jb = {k: jnp.asarray(x, jnp.float32) for k, x in batch.items() if k != "ref_logp"}
  jt = jnp.asarray(tokens, jnp.int32)

  def f(lg):
    lp, ent = losses.token_logprobs(lg, jt, with_entropy=True)
    return losses.policy_loss(lp, dict(jb, entropy=ent), cfg)[0]

  lg = jnp.asarray(logits, jnp.float32)
  assert float(jax.jit(f)(lg)) == pytest.approx(ref(logits), abs=1e-5)
  without = dataclasses.replace(cfg, entropy_coef=0.0)
  lp, ent = token_logprobs(lg, jt, with_entropy=True)
  gap = float(f(lg)) - float(policy_loss(lp, dict(jb, entropy=ent), without)[0])
  assert gap == pytest.approx(-coef * float((ent * jb["loss_mask"]).sum() / 5), abs=1e-6)
  g = np.asarray(_grad(f, lg), np.float64)
  eps, fd = 1e-6, np.zeros_like(logits)
  for i in np.ndindex(*logits.shape):
    e = np.zeros_like(logits)
    e[i] = eps
    fd[i] = (ref(logits + e) - ref(logits - e)) / (2 * eps)
  np.testing.assert_allclose(g, fd, atol=2e-5)
  assert np.all(g[:, -1] == 0)  # the last row predicts nothing


def test_entropy_coef_sign():
  """A step against the gradient lowers the entropy for coef < 0 and raises it for coef > 0
  (zero advantages: the entropy term is the whole loss)."""
  lg = jnp.array([[[1.0, 0.5, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]]])
  tok = jnp.array([[0, 1]])
  batch = {"old_logp": jnp.zeros((1, 2)), "sampler_logp": jnp.zeros((1, 2)),
           "advantages": jnp.zeros(1), "loss_mask": jnp.array([[0.0, 1.0]])}

  def ent_after(coef):
    def f(z):
      lp, ent = losses.token_logprobs(z, tok, with_entropy=True)
      return losses.policy_loss(lp, dict(batch, old_logp=jax.lax.stop_gradient(lp), sampler_logp=
                                         jax.lax.stop_gradient(lp), entropy=ent),
                                RLConfig(entropy_coef=coef))[0]
    z = lg - 0.5 * jax.grad(f)(lg)
    return float(token_logprobs(z, tok, with_entropy=True)[1][0, 1])

  h0 = float(token_logprobs(lg, tok, with_entropy=True)[1][0, 1])
  assert ent_after(-0.5) < h0 - 1e-3 and ent_after(0.5) > h0 + 1e-3


def test_policy_loss_jits():
  logp, batch = _hand_batch()
  loss, m = jax.jit(lambda lp, b: losses.policy_loss(lp, b, RLConfig()))(logp, batch)
  assert float(loss) == pytest.approx(-1.36 / 3, abs=1e-6) and "clip_frac" in m


# ------------------------------------------------------------------------------------------------
# feedback_kl
# ------------------------------------------------------------------------------------------------

def _at_row1(rows):
  """A [1, 3, ...] target-aligned teacher array whose row 1 is ``rows`` (rows 0 and 2: junk)."""
  rows = jnp.asarray(rows)
  return jnp.stack([jnp.full_like(rows, 7), rows, jnp.full_like(rows, 3)])[None]


def _student(probs):
  """Raw student logits [1, 3, V] whose row 0 (which predicts x_1) has ``probs``."""
  z = jnp.log(jnp.asarray(probs, jnp.float32))
  return jnp.stack([z, jnp.zeros_like(z) + jnp.arange(z.shape[0]), -jnp.arange(z.shape[0]) * 1.0])[None]


MASK = jnp.array([[0.0, 1.0, 0.0]])  # the target message is the single token x_1


def test_feedback_kl_full_hand_and_alignment():
  t = {"logp": _at_row1(jnp.log(jnp.array([0.5, 0.25, 0.25])))}
  kl, m = feedback_kl(_student([0.25, 0.5, 0.25]), t, MASK, topk=0)
  # 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0.25 ln 1 = 0.25 ln 2 = 0.173287
  assert float(kl) == pytest.approx(0.25 * LN(2), abs=1e-6)
  assert float(m["feedback_tokens"]) == 1
  # the same rows through teacher_targets (the teacher's logits row predicting x_1)
  tt = teacher_targets(jnp.log(jnp.array([[0.5, 0.25, 0.25]])), 0)
  kl2, _ = feedback_kl(_student([0.25, 0.5, 0.25]), {"logp": _at_row1(tt["logp"][0])}, MASK, 0)
  assert float(kl2) == pytest.approx(0.25 * LN(2), abs=1e-6)


def test_feedback_kl_tail_bucket_hand():
  teacher_p = jnp.array([[0.5, 0.3, 0.1, 0.1]])
  student = _student([0.25, 0.25, 0.25, 0.25])
  t1 = teacher_targets(jnp.log(teacher_p), 1)
  assert t1["idx"].tolist() == [[0]] and float(jnp.exp(t1["tail_logp"][0])) == pytest.approx(0.5, abs=1e-6)
  t1 = {k: _at_row1(v[0]) for k, v in t1.items()}
  kl, _ = feedback_kl(student, t1, MASK, topk=1)
  # buckets {0}, tail: teacher [0.5, 0.5], student [0.25, 0.75]: 0.5 ln 2 + 0.5 ln(2/3) = 0.143841
  assert float(kl) == pytest.approx(0.5 * LN(2) + 0.5 * LN(0.5 / 0.75), abs=1e-6)
  # gradient wrt the student logits of row 0: p_v (1 - pT_bucket / pS_bucket)
  g = _grad(lambda z: losses.feedback_kl(z, t1, MASK, 1)[0], student)
  np.testing.assert_allclose(g[0, 0], [0.25 * (1 - 2), *[0.25 * (1 - 0.5 / 0.75)] * 3], atol=1e-6)
  assert np.all(np.asarray(g[0, 1:]) == 0)  # rows predicting untrained tokens get nothing
  # K = 2: buckets {0}, {1}, tail: teacher [0.5, 0.3, 0.2], student [0.25, 0.25, 0.5]
  t2 = {k: _at_row1(v[0]) for k, v in teacher_targets(jnp.log(teacher_p), 2).items()}
  kl, _ = feedback_kl(student, t2, MASK, topk=2)
  assert float(kl) == pytest.approx(0.5 * LN(2) + 0.3 * LN(1.2) + 0.2 * LN(0.4), abs=1e-6)  # 0.218012
  # without the exact tail the bucket is rebuilt as 1 - sum(p_k)
  t2.pop("tail_logp")
  assert float(feedback_kl(student, t2, MASK, topk=2)[0]) == pytest.approx(0.218012, abs=1e-5)


def test_feedback_kl_full_equals_topk_vocab():
  rng = np.random.default_rng(3)
  b, s, v = 2, 5, 9
  student = jnp.asarray(rng.normal(0, 2, (b, s, v)), jnp.float32)
  teach_logits = jnp.asarray(rng.normal(0, 2, (b * s, v)), jnp.float32)
  mk = (rng.random((b, s)) < 0.7).astype(np.float32)
  mk[:, 0] = 0
  mask = jnp.asarray(mk)
  full = {"logp": teacher_targets(teach_logits, 0)["logp"].reshape(b, s, v)}
  topv = {k: x.reshape(b, s, *x.shape[1:]) for k, x in teacher_targets(teach_logits, v).items()}
  vg = jax.jit(jax.value_and_grad(lambda z, t, k: losses.feedback_kl(z, t, mask, k)[0]), static_argnums=2)
  (kf, gf), (kv, gv) = vg(student, full, 0), vg(student, topv, v)
  assert float(kf) == pytest.approx(float(kv), abs=1e-5) and float(kf) > 0.1
  np.testing.assert_allclose(gf, gv, atol=1e-6)
  assert np.all(np.isfinite(np.asarray(gv)))
  # full-vocab gradient = (softmax(student) - p_teacher) * mask / N at the row before each target
  pt = np.exp(np.asarray(full["logp"], np.float64))
  ps = np.asarray(jax.nn.softmax(student), np.float64)
  want = np.zeros((b, s, v))
  want[:, :-1] = (ps[:, :-1] - pt[:, 1:]) * mk[:, 1:, None] / mk.sum()
  np.testing.assert_allclose(gf, want, atol=1e-5)
  # top-k is a lower bound of the full KL (bucketing merges outcomes: data processing)
  t3 = {k: x.reshape(b, s, *x.shape[1:]) for k, x in teacher_targets(teach_logits, 3).items()}
  assert float(vg(student, t3, 3)[0]) <= float(kf) + 1e-6
  _, _, per_tok = feedback_kl(student, full, mask, 0, per_token=True)
  assert per_tok.shape == (b, s) and float(per_tok.sum() / mask.sum()) == pytest.approx(float(kf), abs=1e-6)


# ------------------------------------------------------------------------------------------------
# Packed rows: several sequences a row, told apart by segment ids, give the one-row-each loss
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [{}, {"loss_agg": "seq_sum"}, {"is_level": "sequence"},
                                     {"is_level": "sequence", "is_mode": "mask", "loss_agg": "seq_sum"}])
def test_policy_loss_on_packed_rows_equals_one_row_per_sequence(variant):
  """Five sequences of 3-7 tokens, one a row (the reference: row semantics, tested by hand above)
  and packed two or three a row with segment ids and per-token advantages: same loss, metrics and
  gradient (float32, atol 1e-6)."""
  cfg = dataclasses.replace(RLConfig(is_clip=1.5), **variant)
  rng = np.random.default_rng(3)
  lens = [5, 3, 7, 4, 6]
  seqs = []
  for n in lens:
    m = (rng.random(n) < 0.7).astype(np.float32)
    m[0] = 0.0  # position 0 of a sequence predicts nothing
    old = rng.normal(-1.0, 0.5, n)
    seqs.append({"loss_mask": m, "old_logp": old, "sampler_logp": old + rng.normal(0, 0.4, n),
                 "logp": old + rng.normal(0, 0.3, n), "adv": rng.normal()})
  one = {k: np.zeros((5, 8), np.float32) for k in ("loss_mask", "old_logp", "sampler_logp", "logp")}
  one["advantages"] = np.array([s["adv"] for s in seqs], np.float32)
  bins = [[2, 1], [4, 0], [3]]  # 10, 11 and 4 tokens in rows of 12
  packed = {k: np.zeros((3, 12), np.float32) for k in ("loss_mask", "old_logp", "sampler_logp", "logp",
                                                       "advantages")}
  packed["segment_ids"] = np.zeros((3, 12), np.int32)
  where = {}
  for row, members in enumerate(bins):
    at = 0
    for sid, i in enumerate(members, start=1):
      where[i] = (row, at)
      n = lens[i]
      for k in ("loss_mask", "old_logp", "sampler_logp", "logp"):
        one[k][i, :n] = seqs[i][k]
        packed[k][row, at:at + n] = seqs[i][k]
      packed["advantages"][row, at:at + n] = seqs[i]["adv"]
      packed["segment_ids"][row, at:at + n] = sid
      at += n
  as_j = lambda b: {k: jnp.asarray(v) for k, v in b.items() if k != "logp"}
  l1, m1 = policy_loss(jnp.asarray(one["logp"]), as_j(one), cfg)
  l2, m2 = policy_loss(jnp.asarray(packed["logp"]), as_j(packed), cfg)
  assert float(l2) == pytest.approx(float(l1), abs=1e-6)
  for k in ("pg_loss", "tokens", "clip_frac", "ratio_mean", "is_weight_mean", "is_clipped_frac"):
    assert float(m2[k]) == pytest.approx(float(m1[k]), abs=1e-6), k
  g1 = _grad(lambda lp: losses.policy_loss(lp, as_j(one), cfg)[0], jnp.asarray(one["logp"]))
  g2 = _grad(lambda lp: losses.policy_loss(lp, as_j(packed), cfg)[0], jnp.asarray(packed["logp"]))
  for i, (row, at) in where.items():
    np.testing.assert_allclose(g2[row, at:at + lens[i]], g1[i, :lens[i]], atol=1e-6)
  assert float(m1["is_clipped_frac"]) > 0 or cfg.is_level == "sequence"  # the cap is exercised

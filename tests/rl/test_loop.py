"""RL end to end on a tiny model: the real engine, sandbox and grader; router replay's train/infer
gap; metrics, checkpoints and resume of ``composer-jax rl``; eval with a run directory as policy."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import load_config
from composer_jax.env import sandbox
from composer_jax.rl import learner as L
from tests.rl.conftest import DYNAMIC, MODEL, RL

pytestmark = pytest.mark.skipif(not sandbox.bwrap_available(),
                                reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")

def _rl_cfg(world, *extra):
  _, _, tasks = world
  return load_config(None, MODEL + RL + [f"rl.tasks={tasks}"] + list(extra))


@pytest.mark.slow
def test_rl_loop_metrics_checkpoint_resume_and_eval(world, capsys):
  from composer_jax.cli import main
  root, init, tasks = world
  out = root / "rl"
  over = MODEL + RL + [f"rl.tasks={tasks}", "rl.feedback_kl_coef=0.1", "rl.feedback_topk=8",
                       "rl.length_penalty=0.05", "rl.pack_length=1024"]
  assert main(["rl", "configs/tiny.yaml", "--out", str(out), "--init", init, "rl.steps=1", *over]) == 0
  need = {"step", "reward_mean", "pass_rate", "pass@1", "pass@2", "completion_tokens_mean",
          "train_infer_logprob_abs_diff", "routing_mismatch_frac", "length_penalty_mean", "feedback_kl",
          "hints", "summaries", "flagged_hacks", "rollout_s", "grading_s", "learn_s", "loss", "grad_norm"}
  # Resume continues the task stream (no task repeats within an epoch of the 4 tasks) and the
  # weight version.
  assert main(["rl", "configs/tiny.yaml", "--out", str(out), "--resume", "rl.steps=2", *over]) == 0
  recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == [1, 2]
  assert need <= set(recs[0]), need - set(recs[0])
  for r in recs:
    assert all(np.isfinite(v) for v in r.values() if isinstance(v, float))
    # Rollouts were sampled with the weights being trained, and the learner replays their routes.
    assert r["train_infer_logprob_abs_diff"] < 1e-4 and r["routing_mismatch_frac"] < 0.01
    assert r["completion_tokens_mean"] > 0 and r["version"] == r["step"]
    # rl.pack_length: the step's 4 segments go into a power-of-two count of rows of 1024 tokens
    rows = r["learner_rows"]
    assert r["learner_row_length"] == 1024 and rows & (rows - 1) == 0 and 1 <= rows <= r["segments"] == 4
    assert 0 < r["learner_fill"] <= 1
  tasks_seen = [json.loads(x)["task"] for x in (out / "rollouts.jsonl").read_text().splitlines()]
  assert len(tasks_seen) == 8 and len(set(tasks_seen)) == 4  # each of the 4 tasks, twice (a group)
  assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]
  assert os.path.exists(out / "plots" / "reward_mean.png")
  # Missing tasks fail in one line before anything compiles.
  capsys.readouterr()
  assert main(["rl", "configs/tiny.yaml", "--out", str(root / "x"), "--init", init, *MODEL,
               "rl.tasks=/nonexistent"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "rl.tasks" in err[0]
  # The trained run directory is a policy for `eval`.
  ev = root / "eval"
  assert main(["eval", "--tasks", tasks, "--policy", str(out), "--out", str(ev), "--samples", "1",
               "--limit", "2"]) == 0
  summary = json.loads((ev / "summary.json").read_text())
  assert summary["tasks"] == 2 and summary["policy"] == "model" and summary["mean_completion_tokens"] > 0
  # The same evaluation with the sampler over 2 devices (the checkpoint restored slice by slice onto
  # an expert=2 mesh) plays the same episodes.
  ev2 = root / "eval2"
  assert main(["eval", "--tasks", tasks, "--policy", str(out), "--out", str(ev2), "--samples", "1",
               "--limit", "2", "--set", "rl.worker_devices=2", "--set", "rl.worker_mesh={expert: 2}"]) == 0
  def episodes(d):
    rows = [json.loads(x) for x in (d / "trajectories.jsonl").read_text().splitlines()]
    return sorted((r["instance_id"], json.dumps(r["messages"])) for r in rows)
  assert episodes(ev2) == episodes(ev)


def _sampled_batch(cfg, graphdef, params, rest, tok, tasks):
  """Two short episodes from the engine, packed into a learner batch."""
  from composer_jax.env.tasks import load_tasks
  from composer_jax.rl.agent import Job, RolloutRunner
  from composer_jax.rl.sampler import Engine
  engine = Engine(graphdef, params, rest, cfg, n_slots=2, max_len=cfg.rl.max_context, seed=11)
  rollouts = RolloutRunner(engine, tok, cfg).run([Job(t, i) for i, t in enumerate(load_tasks(tasks)[:2])])
  rows, _ = L.segment_rows(rollouts, [1.0, -1.0])
  length = L.bucket(max(len(r.tokens) for r in rows), cfg.rl.max_context)
  m = cfg.model
  return L.pack_rows(rows, 2, length, m.n_moe_layers, m.n_experts_per_tok, tok.pad_id)


# The sequence-level variant is slow-marked (30 s on 2 cores); packing is checked by the first.
@pytest.mark.parametrize("variant", [[], pytest.param(["rl.loss_agg=seq_sum", "rl.is_level=sequence"],
                                                      marks=pytest.mark.slow)])
def test_packed_learner_rows_give_the_one_row_each_loss_and_gradient(world, variant):
  """Two sampled episodes with advantages +1 and -0.5, one a row (padded) and packed into one row of
  max_context: the RL loss (model forward with router replay, segment-masked attention, restarted
  positions) and its gradient agree within float32 noise (rtol 1e-4)."""
  from flax import nnx

  from composer_jax.env.tasks import load_tasks
  from composer_jax.rl.agent import Job, RolloutRunner
  from composer_jax.rl.loop import load_policy
  from composer_jax.rl.sampler import Engine
  _, init, tasks = world
  cfg = _rl_cfg(world, "rl.max_new_tokens=24", *variant)
  _, tok, graphdef, params, rest = load_policy(init)
  engine = Engine(graphdef, params, rest, cfg, n_slots=2, max_len=cfg.rl.max_context, seed=11)
  rollouts = RolloutRunner(engine, tok, cfg).run([Job(t, i) for i, t in enumerate(load_tasks(tasks)[:2])])
  rows, _ = L.segment_rows(rollouts, [1.0, -0.5])
  lengths = [len(r.tokens) for r in rows]
  m = cfg.model
  flat = L.pack_rows(rows, len(rows), L.bucket(max(lengths), cfg.rl.max_context), m.n_moe_layers,
                     m.n_experts_per_tok, tok.pad_id)
  bins = L.first_fit(lengths, cfg.rl.max_context)
  assert len(bins) == 1 and len(rows) >= 2  # the episodes share one row
  packed = L.pack_rows(rows, 1, cfg.rl.max_context, m.n_moe_layers, m.n_experts_per_tok, tok.pad_id, bins)
  loss_fn = L.make_rl_loss(cfg)

  def loss(p, batch):
    out = loss_fn(nnx.merge(graphdef, p, rest), {k: jnp.asarray(v) for k, v in batch.items()}, cfg)
    return out[0], out[1]

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))  # compiled: half the time of op by op
  (l1, m1), g1 = grad(params, flat)
  (l2, m2), g2 = grad(params, packed)
  assert abs(float(l1)) > 0.1 and float(l2) == pytest.approx(float(l1), rel=1e-4)
  assert float(m1["tokens"]) == float(m2["tokens"]) > 0
  assert float(m2["train_infer_logprob_abs_diff"]) < 1e-4 and float(m2["routing_mismatch_frac"]) < 0.01
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * scale), g1, g2)


def test_sft_mix_adds_its_coefficient_times_the_chats_cross_entropy(world):
  """PPO-ptx: with SFT rows in the batch, the RL loss grows by exactly rl.sft_mix_coef times the mean
  cross-entropy of the chats' assistant tokens (computed here from the logits by log_softmax), and
  the policy-gradient part is unchanged by the extra rows."""
  from flax import nnx

  from composer_jax.data.sft import encode_chat
  from composer_jax.data.tokenizer import load_tokenizer
  from composer_jax.rl.loop import load_policy
  _, init, tasks = world
  _, tok, graphdef, params, rest = load_policy(init)
  tok = load_tokenizer(os.path.join(init, "tokenizer.json"))
  cfg = _rl_cfg(world, "rl.max_new_tokens=24")
  batch = _sampled_batch(cfg, graphdef, params, rest, tok, tasks)
  chats = [encode_chat([{"role": "user", "content": "Fix the bug in util.py."},
                        {"role": "assistant", "content": "I will look at util.py first."}], tok),
           encode_chat([{"role": "user", "content": "Run the tests."},
                        {"role": "assistant", "content": "python run_tests.py"}], tok)]
  m = cfg.model
  length = batch["tokens"].shape[1]
  mixed = L.interleave(batch, L.sft_rows(chats, 2, length, m.n_moe_layers, m.n_experts_per_tok,
                                         tok.pad_id), 1)

  def run(c, b):  # compiled: a fraction of the time of op by op
    fn = jax.jit(lambda p, b: L.make_rl_loss(c)(nnx.merge(graphdef, p, rest), b, c))
    loss, met, out = fn(params, {k: jnp.asarray(v) for k, v in b.items()})
    return loss, met, out.logits

  base, base_m, _ = run(cfg, batch)
  coef = 0.3
  loss, met, logits = run(_rl_cfg(world, "rl.max_new_tokens=24", f"rl.sft_mix_coef={coef}",
                                  "rl.sft_mix_path=x.jsonl"), mixed)
  logits = np.asarray(logits, np.float64)[2:]  # the SFT rows
  lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  toks, sm = mixed["tokens"][2:], mixed["sft_mask"][2:]
  nll = -np.take_along_axis(lp[:, :-1], toks[:, 1:, None], -1)[..., 0]  # row t predicts token t+1
  ce = float((nll * sm[:, 1:]).sum() / sm.sum())
  assert float(met["sft_mix_ce"]) == pytest.approx(ce, rel=1e-5)
  assert float(loss) == pytest.approx(float(base) + coef * ce, rel=1e-5)
  assert float(met["pg_loss"]) == pytest.approx(float(base_m["pg_loss"]), abs=1e-6)
  assert sm.sum() > 0 and sm[:, 0].sum() == 0


def test_router_replay_closes_the_train_infer_gap(world):
  """Same weights, float32: with replay the trainer's log-probs match the sampler's within 1e-5. With
  the router nudged (what one update does), live routing departs from the recorded one; replay keeps
  the sampled experts and the gap stays far smaller than without it."""
  from flax import nnx

  from composer_jax.data.tokenizer import load_tokenizer
  from composer_jax.rl.loop import load_policy
  _, init, tasks = world
  cfg = _rl_cfg(world, "rl.max_new_tokens=24", "rl.temperature=1.0")
  _, tok, graphdef, params, rest = load_policy(init)
  tok = load_tokenizer(os.path.join(init, "tokenizer.json"))
  batch = _sampled_batch(cfg, graphdef, params, rest, tok, tasks)

  metrics = {}
  for replay in (True, False):  # compiled: a fraction of the time of op by op
    c = _rl_cfg(world, f"rl.router_replay={str(replay).lower()}")
    metrics[replay] = jax.jit(lambda p, b, c=c: L.make_rl_loss(c)(nnx.merge(graphdef, p, rest), b, c)[1])

  def gap(p, replay: bool):
    m = metrics[replay](p, {k: jnp.asarray(v) for k, v in batch.items()})
    return float(m["train_infer_logprob_abs_diff"]), float(m["routing_mismatch_frac"])

  same, mism = gap(params, True)
  assert same <= 1e-5 and mism < 0.01, (same, mism)
  def nudge(path, x):  # the router matrices only (the selection bias is not a Param)
    name = jax.tree_util.keystr(path)
    return x + 0.5 * jax.random.normal(jax.random.PRNGKey(len(name)), x.shape) if "'router'" in name else x

  nudged = jax.tree_util.tree_map_with_path(nudge, params)
  with_replay, mism_replay = gap(nudged, True)
  without, mism_live = gap(nudged, False)
  assert mism_replay > 0.05 and mism_live > 0.05  # the router now disagrees with the recorded routes
  assert with_replay < without, (with_replay, without)


@pytest.mark.parametrize("curriculum", ["none", "family"])
def test_dynamic_sampling_draws_more_groups_and_skips_a_step_without_signal(world, curriculum):
  """The random policy fails every episode and, without shaping penalties, every group scores 0
  alike: DAPO's dynamic sampling draws 2 rounds x 2 groups, finds none to learn from, and the
  optimizer leaves the weights and its own state exactly as they were (optim.skip_zero_grads).
  The family curriculum sees every drawn group's outcomes."""
  from composer_jax.rl.loop import RLRun
  root, init, _ = world
  run = RLRun(_rl_cfg(world, "rl.steps=1", f"rl.curriculum={curriculum}", *DYNAMIC),
              str(root / f"dynamic-{curriculum}"), init=init, log=lambda m: None)
  before = jax.tree.map(np.asarray, (run.tr.state["params"], run.tr.state["opt_state"]))
  rec = run.step(1)
  assert (rec["groups_drawn"], rec["groups_informative"], rec["trained_groups"]) == (4, 0, 2)
  assert rec["update_skipped"] == 1 and rec["grad_norm"] == 0 and rec["pass_rate"] == 0
  after = jax.tree.map(np.asarray, (run.tr.state["params"], run.tr.state["opt_state"]))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  logged = [json.loads(x) for x in (root / f"dynamic-{curriculum}" / "rollouts.jsonl").read_text().splitlines()]
  assert len(logged) == 8 and [r["trained"] for r in logged] == [True] * 4 + [False] * 4
  st = run.checkpoint_data(1)["tasks"]
  if curriculum == "none":
    assert st["pos"] == 4  # all 4 tasks of the stream's first epoch were played
  else:  # 4 groups drawn by family, each observed: no wins, and 4 x 2 episodes counted (decayed)
    assert st["draws"] == 4 and sum(st["wins"]) == 0
    assert 2 * 4 * 0.8 ** 3 <= sum(st["tries"]) <= 8
  run.rollout_file.close()
  run.metrics.close()
  run.ck.close()


# Micro-batched (accum 2) is slow-marked (35 s on 2 cores); the epochs logic is checked at accum 1.
@pytest.mark.parametrize("accum", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_epochs_reuse_a_steps_rollouts_for_more_updates(world, accum):
  """rl.epochs=2: two optimizer updates per step on the same rollouts, the schedule spans them all,
  and the second pass is off the sampling weights (its PPO ratio departs from 1). Its old_logp are
  the first pass's log-probs (out of the train step, micro-batched or not): they match a separate
  forward, and so do the updated weights. The random policy resolves nothing, so one episode of
  each group is marked resolved to give a gradient."""
  from composer_jax.rl.agent import Job
  from composer_jax.rl.loop import RLRun
  from composer_jax.train.loop import put_batch
  root, init, _ = world
  run = RLRun(_rl_cfg(world, "rl.steps=2", "rl.epochs=2", f"train.grad_accum={accum}"),
              str(root / f"epochs{accum}"), init=init, log=lambda m: None)
  try:
    assert run.cfg.train.steps == 4
    rollouts = run.runner.run([Job(run.tasks[g], g, s) for g in range(2) for s in range(2)])
    first = {}
    for r in rollouts:
      first.setdefault(r.group, r)
    for r in first.values():
      r.traj.reward, r.traj.resolved = 1.0, True
    before = jax.tree.map(jnp.copy, run.tr.state)
    rec = run.learn(1, rollouts, None, 0.0)
    assert int(run.tr.state["step"]) == 2
    assert rec["update_skipped"] == 0 and abs(rec["ratio_mean"] - 1.0) > 1e-6, rec
    # The first pass's log-probs stood in for a separate forward before the updates: the same
    # two updates with old_logp from the logp function give the same weights.
    after = run.tr.state
    batch, _ = run._batch(rollouts, L.score_rollouts(rollouts, run.cfg, ks=(1, 2)), 1)
    assert batch["old_is_current"].all()
    old = np.asarray(run.logp_fn(before["params"], before["rest"], batch))
    _, out = run.tr.step_fn(jax.tree.map(jnp.copy, before), put_batch(run.tr, batch))
    m = batch["segment_ids"] > 0
    np.testing.assert_allclose(np.asarray(out["rows"]["logp"])[m], old[m], atol=2e-5)
    batch.update(old_logp=old, old_is_current=np.zeros_like(batch["old_is_current"]))
    run.tr.state = before
    for _ in range(2):
      run.tr.state, _ = run.tr.step_fn(run.tr.state, put_batch(run.tr, batch))
    for a, b in zip(jax.tree.leaves(after["params"]), jax.tree.leaves(run.tr.state["params"]), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  finally:
    run.rollout_file.close()
    run.metrics.close()
    run.ck.close()

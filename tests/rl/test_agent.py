"""The rollout runner's bookkeeping with a scripted engine: token in, token out, spans, summaries,
continuous batching over fewer slots than episodes, rewards and the learner batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from composer_jax.config import load_config
from composer_jax.data import chat
from composer_jax.data.tokenizer import train_bpe
from composer_jax.env import sandbox
from composer_jax.env.protocol import format_call
from composer_jax.env.tasks import read_text
from composer_jax.rl import learner as L
from composer_jax.rl.agent import Job, RolloutRunner
from composer_jax.rl.sampler import Generation
from tests.rl.scripted import N_MOE, K, ScriptedEngine


@pytest.fixture(scope="module")
def tok():
  text = [read_text(chat.__file__), format_call("create", {"path": "a.py", "content": "x = 1\n"})] * 3
  return train_bpe(text, 600)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  from composer_jax.env import synthetic
  out = tmp_path_factory.mktemp("syn")
  synthetic.generate(2, seed=3, out=str(out))
  from composer_jax.env.tasks import load_tasks
  return load_tasks(str(out))


def _cfg(**rl):
  over = [f"model.n_layers={N_MOE + 1}", "model.n_dense_layers=1", f"model.n_experts_per_tok={K}",
          "model.max_seq_len=4096", "rl.max_new_tokens=512", "env.timeout_s=10"]
  over += [f"rl.{k}={v}" for k, v in rl.items()]
  return load_config(None, over)


needs_bwrap = pytest.mark.skipif(not sandbox.bwrap_available(),
                                 reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")


def _first_user_task(req, tok, tasks):
  text = tok.decode(req.new_tokens)
  return next(t for t in tasks if t.prompt() in text)


@needs_bwrap
def test_runner_token_in_token_out_and_slots(tok, tasks):
  cfg = _cfg(decode_batch=2)
  owner = {}

  def script(req, n):
    if req.key not in owner:
      owner[req.key] = _first_user_task(req, tok, tasks)
    t = owner[req.key]
    if n == 0:
      calls = [format_call("create", {"path": rel, "content": read_text(f"{t.gold_dir}/{rel}")})
               for rel in t.gold_files]
      return "Restoring.\n" + "\n".join(calls)
    return format_call("submit", {})

  engine = ScriptedEngine(tok, script, n_slots=2)
  runner = RolloutRunner(engine, tok, cfg)
  jobs = [Job(t, g, s) for g, t in enumerate(tasks) for s in range(2)]
  rollouts = runner.run(jobs)
  assert engine.max_held <= 2 and len(engine.released) == 4  # 4 episodes through 2 slots
  for r, job in zip(rollouts, jobs):
    assert r.task_id == job.task.instance_id and r.resolved and r.traj.reward == 1.0
    (seg,) = r.segments
    # The segment is the exact fed/produced stream: prompt as SFT encodes it, then the turns.
    prompt = chat.encode_segments(r.traj.messages[:2], tok)[0] + tok.encode(chat.generation_prompt())
    assert seg.tokens[: len(prompt)].tolist() == prompt
    assert len(r.spans) == 2 and [s.env_turn for s in r.spans] == [0, 1]
    for span in r.spans:
      body = seg.tokens[span.body_start:span.body_end]
      assert body[-1] == tok.token_id(chat.IM_END) and seg.loss_mask[span.body_start:span.body_end].all()
      assert seg.loss_mask[span.header_start:span.body_start].sum() == 0
      assert (seg.versions[span.body_start:span.body_end] == 7).all()
    assert seg.loss_mask.sum() == sum(s.body_end - s.body_start for s in r.spans)
    assert (seg.experts[-1] == -1).all() and (seg.experts[:-1] >= 0).all()  # last token never fed
    # The observation between the turns is the tool message exactly as chat encodes it.
    obs = chat.encode_segments([r.traj.messages[3]], tok)[0]
    a, b = r.spans[0].body_end, r.spans[1].header_start
    assert seg.tokens[a:b].tolist() == obs
  # Rewards, advantages and the learner batch.
  stats = L.score_rollouts(rollouts, cfg, ks=[1, 2])
  assert stats["pass_rate"] == 1.0 and np.allclose(stats["advantages"], 0.0)
  rows, where = L.segment_rows(rollouts, stats["advantages"])
  n = L.row_count(len(rows), 4)
  length = L.bucket(max(len(r.tokens) for r in rows), cfg.rl.max_context)
  batch = L.pack_rows(rows, n, length, N_MOE, K, tok.pad_id)
  assert batch["tokens"].shape == (4, length) and batch["experts"].shape == (4, length, N_MOE, K)
  for i, (ri, si) in enumerate(where):
    seg = rollouts[ri].segments[si]
    assert (batch["tokens"][i, :len(seg)] == seg.tokens).all()
    assert (batch["segment_ids"][i, len(seg):] == 0).all()
    assert np.allclose(batch["sampler_logp"][i, :len(seg)], seg.sampler_logp)


@needs_bwrap
def test_play_admits_a_later_batch_into_the_slots_a_batch_frees(tok, tasks):
  """``RolloutRunner.play`` (an async worker's units): a batch that arrives mid-run takes the slot
  that a finished episode of the earlier batch frees, before that batch is done; each batch's
  rollouts come back once, in job order, when its last episode is graded."""
  cfg = _cfg(decode_batch=2)
  long_task, short_task = tasks
  owner, events = {}, []

  def script(req, n):
    if req.key not in owner:
      owner[req.key] = _first_user_task(req, tok, tasks)
    if owner[req.key] is long_task and n < 5:  # five turns of tools before it submits
      return format_call("view", {"path": "."})
    return format_call("submit", {})

  engine = ScriptedEngine(tok, script, n_slots=2)
  engine_submit = engine.submit
  engine.submit = lambda req: (events.append(("submit", req.key)), engine_submit(req))[1]
  runner = RolloutRunner(engine, tok, cfg)
  done, pulls = {}, []

  def on_done(name):
    return lambda rs: (events.append(("done", name)), done.setdefault(name, []).append(rs))

  feed = [[([Job(long_task, 0), Job(short_task, 1)], on_done("first"))],
          [([Job(short_task, 2, 0), Job(short_task, 2, 1)], on_done("second"))]]

  def pull(idle):
    pulls.append(idle)
    if feed:
      return feed.pop(0)
    return None if len(done) == 2 else []

  runner.play(pull)
  assert sorted(done) == ["first", "second"] and all(len(v) == 1 for v in done.values())
  (first,), (second,) = done["first"], done["second"]
  assert [(r.group, r.task_id) for r in first] == [(0, long_task.instance_id), (1, short_task.instance_id)]
  assert [r.group for r in second] == [2, 2] and all(r.traj.submitted for r in first + second)
  assert engine.max_held <= 2 and len(engine.released) == 4
  # The later batch's first episode started before the earlier batch was done: in the slot that
  # the earlier batch's first finished episode freed (episodes in the order they were first fed).
  keys = list(dict.fromkeys(k for what, k in events if what == "submit"))
  assert len(keys) == 4
  assert events.index(("submit", keys[2])) < events.index(("done", "first"))
  assert runner.stats["episodes"] == 4 and pulls[0] and not all(pulls)  # idle: nothing in flight


@needs_bwrap
def test_self_summarization_starts_a_new_segment(tok, tasks):
  cfg = _cfg(decode_batch=1, summary_trigger_tokens=1, max_summaries=1)
  task = tasks[0]

  def script(req, n):
    text = tok.decode(req.new_tokens)
    if "Summarise your work" in text:
      return "I looked at the file; nothing changed yet."
    if n == 0:
      return format_call("view", {"path": "."})
    return format_call("submit", {})

  engine = ScriptedEngine(tok, script, n_slots=1)
  (r,) = RolloutRunner(engine, tok, cfg).run([Job(task, 0)])
  assert r.summaries == 1 and len(r.segments) == 2 and r.segments[0].summary
  assert [s.segment for s in r.spans] == [0, 0, 1] and r.spans[1].env_turn == -1
  second = tok.decode(r.segments[1].tokens)
  assert "Summary of your earlier work" in second and "I looked at the file" in second
  assert task.prompt() in second  # the new segment restarts from the system prompt and the task
  assert r.traj.submitted and not r.resolved  # submitting without the fix scores 0


@needs_bwrap
def test_feedback_teacher_context_inserts_the_hint(tok, tasks):
  cfg = _cfg(decode_batch=1, feedback_kl_coef=0.1, feedback_topk=4)

  def script(req, n):
    return format_call("open_file", {"path": "x.py"}) if n == 0 else format_call("submit", {})

  (r,) = RolloutRunner(ScriptedEngine(tok, script, 1), tok, cfg).run([Job(tasks[0], 0)])
  rows, where = L.segment_rows([r], [0.5])
  jobs = L.feedback_jobs([r], where, tok, cfg)
  assert [h.kind for h in r.hints] == ["unknown_tool"] and len(jobs) == 1
  job, span, seg = jobs[0], r.spans[0], r.segments[0]
  hint_ids = chat.encode_segments([{"role": "system", "content": r.hints[0].text}], tok)[0]
  assert job.offset == len(hint_ids)
  assert job.tokens.tolist() == (seg.tokens[:span.header_start].tolist() + hint_ids
                                 + seg.tokens[span.header_start:span.body_end].tolist())
  # Teacher rows land on the student's body positions.
  length = L.bucket(len(seg), 4096)
  batch = L.pack_rows(rows, 1, length, N_MOE, K, tok.pad_id)
  t_len = len(job.tokens)
  teacher = {"logp": np.arange(t_len * 4, dtype=np.float32).reshape(1, t_len, 4),
             "idx": np.ones((1, t_len, 4), np.int32), "tail_logp": np.full((1, t_len), -3.0, np.float32)}
  L.attach_teacher(batch, jobs, teacher, 4)
  assert batch["fb_mask"][0].sum() == span.body_end - span.body_start
  t = span.body_start
  assert np.array_equal(batch["fb_logp"][0, t], teacher["logp"][0, t + job.offset])


def test_generation_fields_match_the_sampler_contract():
  fields = {f.name for f in dataclasses.fields(Generation)}
  assert {"key", "tokens", "logprobs", "context_experts", "context_tokens", "version", "finish"} <= fields

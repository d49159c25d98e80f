"""Targeted textual feedback moves the un-hinted policy toward the hinted one.

A scripted episode calls the unavailable tool ``open_file``; the detector writes a hint for that
message. The model is first primed (a few LM steps) to answer ``open_file`` without the hint and the
valid ``view`` with it — the situation feedback is for: the hinted context knows better. Then the RL
learner runs with the policy-gradient term silent (advantage 0) and the feedback KL on, teacher =
the frozen primed model with the hint. The student's probability of the invalid call at the hinted
step must fall over a few updates, while the teacher context keeps preferring ``view``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import load_config
from composer_jax.data import chat
from composer_jax.data.tokenizer import load_tokenizer
from composer_jax.env import sandbox
from composer_jax.env.protocol import format_call
from composer_jax.env.tasks import load_tasks
from composer_jax.rl import learner as L
from composer_jax.rl.agent import Job, RolloutRunner
from tests.rl.conftest import MODEL, RL
from tests.rl.scripted import ScriptedEngine

pytestmark = pytest.mark.skipif(not sandbox.bwrap_available(),
                                reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")

BAD = format_call("open_file", {"path": "app.py"})
GOOD = format_call("view", {"path": "app.py"})


def _body_logp(trainer, graphdef, cfg, tokens, start, end):
  """Sum of log p(x_t | x_<t) over tokens[start:end] under the trainer's current weights."""
  from flax import nnx

  from composer_jax.rl.losses import token_logprobs
  model = nnx.merge(graphdef, trainer.state["params"], trainer.state["rest"])
  logits = model(np.asarray(tokens)[None], mtp=False).logits
  return float(np.asarray(token_logprobs(logits, np.asarray(tokens)[None]))[0, start:end].sum())


@pytest.mark.slow
def test_feedback_kl_lowers_the_invalid_tool_call(world):
  from composer_jax.train.loop import build_trainer, put_batch
  _, init, tasks_dir = world
  over = MODEL + RL + ["rl.feedback_kl_coef=1.0", "rl.feedback_topk=0", "rl.feedback_teacher=frozen",
                       "rl.router_replay=false", "rl.max_new_tokens=64", "optim.lr=5e-4", "optim.weight_decay=0",
                       "optim.clip_norm=0", "model.bias_update_rate=0", "optim.schedule=constant"]
  cfg = load_config(None, over)
  tok = load_tokenizer(os.path.join(init, "tokenizer.json"))
  task = load_tasks(tasks_dir)[0]

  def script(req, n):
    return BAD if n == 0 else format_call("submit", {})

  engine = ScriptedEngine(tok, script, 1, cfg.model.n_moe_layers, cfg.model.n_experts_per_tok)
  (r,) = RolloutRunner(engine, tok, cfg).run([Job(task, 0)])
  rows, where = L.segment_rows([r], [0.0])
  (job,) = L.feedback_jobs([r], where, tok, cfg)
  assert job.hint.kind == "unknown_tool" and "open_file" in job.hint.text
  seg, span = r.segments[0], r.spans[0]
  student = seg.tokens[:span.body_end]
  bad_ids = student[span.body_start:span.body_end].tolist()
  good_ids = tok.encode(GOOD) + [tok.token_id(chat.IM_END)]
  teacher_good = np.concatenate([job.tokens[:span.body_start + job.offset], good_ids])

  # Priming: un-hinted -> open_file, hinted -> view (LM loss on the assistant bodies only). At lr
  # 1e-2 the 60 steps were chaotic: the primed log p(open_file) was -4.0 at XLA's default CPU
  # compile and -9.5 at -O0, and the feedback path from there rose at -O0. At 3e-3 the path is the
  # same at -O0, level 2 and level 3 (to 1e-4 nats): -6.37, -6.63, -7.29, ..., -8.88.
  lm_cfg = load_config(None, over + ["data.batch_size=2", "train.steps=60", "optim.lr=3e-3"])
  lm = build_trainer(lm_cfg)
  from composer_jax.train.checkpoint import Checkpointer
  ck = Checkpointer(os.path.join(init, "checkpoints"), keep=10, async_save=False)
  got = ck.restore_latest({"params": lm.state["params"], "rest": lm.state["rest"]}, json_items=())
  ck.close()
  lm.state.update(params=got[1]["params"], rest=got[1]["rest"])
  prime = L.pack_rows([L.Row(student, seg.experts), L.Row(teacher_good, job.experts[:len(teacher_good)])],
                      2, L.bucket(len(teacher_good), 4096), 0, 1, tok.pad_id)
  mask = np.zeros_like(prime["tokens"])
  mask[0, span.body_start:span.body_end] = 1
  mask[1, span.body_start + job.offset:len(teacher_good)] = 1
  lm_batch = {k: prime[k] for k in ("tokens", "segment_ids", "positions")}
  lm_batch["loss_mask"] = mask
  for _ in range(60):
    lm.state, lm_m = lm.step_fn(lm.state, put_batch(lm, lm_batch))
  print("priming loss", float(lm_m["loss"]))

  # Feedback updates: teacher = frozen primed model with the hint, PG silent (advantage 0).
  tr = build_trainer(cfg, loss_fn=L.make_rl_loss(cfg))
  # Copies: the RL step donates its state, and the frozen teacher must outlive the updates.
  tr.state.update(params=jax.tree.map(jnp.copy, lm.state["params"]),
                  rest=jax.tree.map(jnp.copy, lm.state["rest"]))
  frozen = (lm.state["params"], lm.state["rest"])
  teacher_fn = L.make_teacher_fn(tr.graphdef, cfg)
  length = L.bucket(len(seg), 4096)
  batch = L.pack_rows(rows, 2, length, cfg.model.n_moe_layers, cfg.model.n_experts_per_tok, tok.pad_id)
  tb = L.pack_rows([L.Row(job.tokens, job.experts)], 1, L.bucket(len(job.tokens), 4096),
                   cfg.model.n_moe_layers, cfg.model.n_experts_per_tok, tok.pad_id)
  teacher = jax.device_get(teacher_fn(*frozen, tb["tokens"], tb["segment_ids"], tb["positions"],
                                      tb["experts"]))
  L.attach_teacher(batch, [job], teacher, 0)

  def p_bad():
    return _body_logp(tr, tr.graphdef, cfg, student, span.body_start, span.body_end)

  before = p_bad()
  teacher_bad = np.concatenate([job.tokens[:span.body_start + job.offset], bad_ids])
  t_bad = _body_logp(lm, lm.graphdef, cfg, teacher_bad, span.body_start + job.offset, len(teacher_bad))
  print("before", before, "teacher", t_bad)
  assert t_bad < before - 1.0, (t_bad, before)  # priming worked: the hinted context avoids open_file
  kls, logps = [], [before]
  for _ in range(6):
    tr.state, m = tr.step_fn(tr.state, put_batch(tr, batch))
    kls.append(float(m["feedback_kl"]))
    logps.append(p_bad())
  print("log p(open_file) per update", logps)
  assert kls[-1] < kls[0]
  # Falls at the first update (the KL's gradient points the right way) and ends more than a factor
  # e lower in probability. Not asserted at every update: Adam's first steps are sign-like, and the
  # primed weights move with the fixture's tokenizer (trained on the synthetic package's source;
  # after an edit of it, at the old lr: down 2.5 nats in two updates, then back up 0.8 while the KL
  # kept falling).
  assert logps[1] < logps[0], logps
  assert logps[-1] < before - 1.0, logps

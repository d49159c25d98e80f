"""Shared RL fixtures: a tiny MoE init run (random weights + a small BPE) and synthetic tasks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer_jax.config import load_config

# A small MoE (3 MoE layers, 8 experts, top-2, group-limited sigmoid routing with selection bias).
MODEL = ["model.vocab_size=640", "model.d_model=48", "model.n_layers=4", "model.n_dense_layers=1",
         "model.dense_ffn_dim=96", "model.n_heads=2", "model.q_lora_rank=0", "model.kv_lora_rank=16",
         "model.qk_nope_dim=8", "model.qk_rope_dim=8", "model.v_head_dim=8",
         "model.n_routed_experts=8", "model.moe_ffn_dim=16", "model.n_group=2", "model.topk_group=2",
         "model.mtp_depths=0", "model.max_seq_len=2048", "mesh.data=1"]
# The synchronous loop (rl.async=false): these tests check its semantics; test_async.py runs Ray.
RL = ["rl.async=false", "rl.tasks_per_step=2", "rl.group_size=2", "rl.max_new_tokens=12", "rl.decode_batch=4",
      "rl.max_context=2048", "env.max_turns=2", "env.tool_docs=brief", "env.timeout_s=10",
      "checkpoint.every=1", "checkpoint.async_save=false", "train.progress=false",
      "optim.warmup_steps=0", "optim.lr=1e-3"]
# DAPO dynamic sampling with no shaping penalties: a group of the random policy (all fail) carries
# no signal at all, so every group is uninformative.
DYNAMIC = ["rl.dynamic_sampling=true", "rl.dynamic_max_rounds=2", "rl.penalty_malformed_call=0",
           "rl.penalty_unknown_tool=0", "rl.penalty_repeated_command=0", "rl.penalty_no_call_turn=0"]


@pytest.fixture(scope="session")
def world(tmp_path_factory, worker_id):
  """A folder of this test process's own, and an init run (random weights + a 640-token BPE) and
  synthetic train tasks, both read-only: built once and shared by the xdist workers (its train step
  compile was ~25 s of each worker's time)."""
  from filelock import FileLock

  from composer_jax.env import synthetic
  from composer_jax.train.loop import run
  base = tmp_path_factory.getbasetemp()
  shared = (base.parent if worker_id != "master" else base) / "rl-world"
  with FileLock(f"{shared}.lock"):
    if not (shared / "done").exists():
      corpus = shared / "corpus"
      corpus.mkdir(parents=True, exist_ok=True)
      src = [os.path.join(os.path.dirname(synthetic.__file__), f) for f in ("templates.py", "__init__.py")]
      for i, p in enumerate(src):
        (corpus / f"{i}.txt").write_text(Path(p).read_text())
      cfg = load_config(None, MODEL + ["train.steps=1", "data.seq_len=64", "data.batch_size=2",
                                       f"data.sources=[{corpus}]", "data.tokenizer_train_mb=1",
                                       "data.heldout_fraction=0", "checkpoint.async_save=false",
                                       "train.progress=false"])
      run(cfg, str(shared / "init"))
      synthetic.generate(4, seed=5, out=str(shared / "tasks"), split="train")
      (shared / "done").touch()
  return tmp_path_factory.mktemp("rl"), str(shared / "init"), str(shared / "tasks")

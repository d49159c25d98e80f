"""Expert demonstrations of unsolved RL tasks (rl.expert_demo_rows, rl/demos.py): which tasks are
queued, what a demonstration is, and that it reaches the learner's SFT rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from composer_jax.config import load_config
from composer_jax.env import sandbox
from tests.rl.conftest import DYNAMIC, MODEL, RL

pytestmark = pytest.mark.skipif(not sandbox.bwrap_available(),
                                reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")


def _cfg(world, root, *extra):
  _, _, tasks = world
  mix = root / "mix.jsonl"
  mix.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Task {i}."},
                                                  {"role": "assistant", "content": "Done."}]}) + "\n"
                         for i in range(3)))
  return load_config(None, MODEL + RL + DYNAMIC + [
      f"rl.tasks={tasks}", "rl.steps=1", "rl.sft_mix_coef=0.5", f"rl.sft_mix_path={mix}",
      "rl.sft_mix_rows=3", "rl.expert_demo_rows=2", *extra])


def test_unsolved_tasks_get_the_experts_run_in_the_sft_rows(world):
  """The random policy resolves nothing: every group drawn (2 rounds x 2 tasks) queues its task
  once; the update takes the 2 oldest as demonstrations, each the expert's solved run of that task
  encoded as SFT encodes it, and they are the first SFT rows of the learner batch. The queue rides
  in the checkpoint."""
  from composer_jax.data.sft import encode_chat
  from composer_jax.env.episode import run_episode
  from composer_jax.env.expert import ExpertPolicy
  from composer_jax.rl import learner as L
  from composer_jax.rl.loop import RLRun
  root, init, _ = world
  run = RLRun(_cfg(world, root), str(root / "demos"), init=init, log=lambda m: None)
  try:
    rec = run.step(1)
    drawn = [json.loads(x)["task"] for x in (root / "demos" / "rollouts.jsonl").read_text().splitlines()]
    order = list(dict.fromkeys(drawn))  # tasks in the order their groups were drawn
    assert rec["groups_drawn"] == 4 and rec["pass_rate"] == 0 and len(order) == 4
    assert (rec["expert_demos"], rec["expert_demos_queued"], rec["expert_demos_failed"]) == (2, 2, 0)
    ids = {t.instance_id: i for i, t in enumerate(run.tasks)}
    used, waiting = [ids[t] for t in order[:2]], [ids[t] for t in order[2:]]
    assert run.checkpoint_data(1)["demos"] == waiting
    for t in used:  # an independent expert run of the same task, encoded the same way
      traj = run_episode(run.tasks[t], ExpertPolicy(run_tests=True), mode=run.mode,
                         max_turns=int(run.tasks[t].limits.get("max_turns", 8)) + 4,
                         tool_docs=run.cfg.env.tool_docs)
      assert traj.reward == 1.0
      np.testing.assert_array_equal(run.demos.chats[t]["tokens"], encode_chat(traj.messages, run.tok)["tokens"])
    # The next batch: the 2 waiting tasks' demonstrations, then 1 chat from the SFT file.
    from composer_jax.rl.agent import Job
    rs = run.runner.run([Job(run.tasks[0], 0, s) for s in range(2)])
    batch, info = run._batch(rs, L.score_rollouts(rs, run.cfg, ks=(1, 2)), 2)
    assert info["expert_demos"] == 2 and not run.demos.queue
    sft_rows = [batch["tokens"][i] for i in range(len(batch["tokens"])) if batch["sft_mask"][i].any()]
    assert len(sft_rows) == 3
    for t, row in zip(waiting, sft_rows[:2], strict=True):  # cut at the step's row length, as
      want = run.demos.chats[t]["tokens"][:len(row)]        # every SFT-mix chat is
      np.testing.assert_array_equal(row[:len(want)], want)
  finally:
    run.rollout_file.close()
    run.metrics.close()
    run.ck.close()


def test_which_groups_queue_a_demonstration(world, tmp_path):
  """"unsolved": a group with any resolved episode queues nothing; "all" (the control) queues every
  drawn task; a task already waiting is not queued twice; the queue's state round-trips."""
  from composer_jax.rl.demos import ExpertDemos
  for on, want in (("unsolved", [1, 2]), ("all", [0, 1, 2])):
    d = ExpertDemos([None] * 3, None, _cfg(world, tmp_path, f"rl.expert_demo_on={on}"), "auto")
    d.observe(0, [False, True])
    d.observe(1, [False, False])
    d.observe(1, [False, False])
    d.observe(2, [False])
    assert d.state() == want and d.counts["queued"] == len(want)
    d2 = ExpertDemos([None] * 3, None, d.cfg, "auto")
    d2.set_state(d.state())
    assert list(d2.queue) == want

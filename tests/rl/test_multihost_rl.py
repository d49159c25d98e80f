"""The RL learner as two JAX processes (jax.distributed over gloo, 4 fake CPU devices each, one
8-device mesh): process 0 leads (rollouts, batches, files), process 1 follows its collective calls
(learner_group.py).

  * synchronous RL on two processes trains like one process on the same 8-device mesh: the same
    rollouts, the same losses;
  * asynchronous RL (Ray workers fed by the leader) runs on two processes, its workers take the new
    weights, and a resumed run continues from the checkpoint both processes wrote.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from composer_jax.env import sandbox
from tests.parallel.cluster import ROOT, run_cluster
from tests.rl.conftest import MODEL, RL

MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"]
# No workers' weight deltas to test here; a small store so that two Ray runs fit a CI box.
RUN = ["rl.steps=2", "rl.object_store_mb=80", "rl.weight_delta=false"]

pytestmark = pytest.mark.skipif(not sandbox.bwrap_available(),
                                reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")


def _launch(out, overrides, *extra, n=2):
  """`composer-jax rl` as ``n`` processes forming one learner (``n`` = 1: a plain run)."""
  return run_cluster(["rl", os.path.join(ROOT, "configs/tiny.yaml"), "--out", str(out), *overrides,
                      *extra], n=n)


def _jsonl(path) -> list:
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_sync_rl_on_two_processes_trains_like_one(world):
  import jax

  from composer_jax.rl.loop import load_policy
  root, init, tasks = world
  over = MODEL + RL + MESH + RUN + [f"rl.tasks={tasks}"]
  one, two = root / "mh_one", root / "mh_two"
  # Both as fresh processes (this one's JAX settings, e.g. its compilation cache, are not theirs).
  for d, n in ((one, 1), (two, 2)):
    for rc, text in _launch(d, over, "--init", init, n=n):
      assert rc == 0, text[-3000:]
  a, b = _jsonl(one / "metrics.jsonl"), _jsonl(two / "metrics.jsonl")
  assert [r["step"] for r in b] == [1, 2]  # written once, by the leader
  ra, rb = _jsonl(one / "rollouts.jsonl"), _jsonl(two / "rollouts.jsonl")
  step1 = [[r["messages"] for r in rs if r["step"] == 1] for rs in (ra, rb)]
  # The same episodes from the same initial weights (the leader samples on its own devices, the
  # single process on all 8: the same tokens here).
  assert step1[0] == step1[1]
  # The same batch broadcast to both processes, the same update over the 8-device mesh; only the
  # cross-process all-reduce (gloo) may sum in another order.
  for k in ("loss", "pg_loss", "grad_norm", "entropy", "approx_kl"):
    np.testing.assert_allclose(b[0][k], a[0][k], rtol=1e-4, atol=1e-7, err_msg=k)
  assert np.isfinite(b[1]["loss"]) and b[1]["version"] == 2
  # Both processes wrote their shards of the checkpoint: it restores to the reference's weights.
  pa, pb = (load_policy(str(d / "checkpoints" / "1"))[3] for d in (one, two))
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
  assert sorted(int(n) for n in os.listdir(two / "checkpoints") if n.isdigit()) == [1, 2]


@pytest.mark.slow
def test_async_rl_on_two_processes_runs_broadcasts_and_resumes(world):
  pytest.importorskip("ray")
  root, init, tasks = world
  out = root / "mh_async"
  over = MODEL + RL + MESH + RUN + [f"rl.tasks={tasks}", "rl.async=true", "rl.num_workers=1",
                                    "rl.max_staleness=1", "rl.steps=3"]
  for rc, text in _launch(out, over, "--init", init):
    assert rc == 0, text[-3000:]
  recs = _jsonl(out / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 3]
  # At step 3 the learner is at version 2 and trains nothing older than version 1: the worker took
  # weights the two processes gathered and the leader broadcast.
  assert recs[2]["staleness_max"] <= 1 and recs[2]["weight_swaps"] >= 1
  with open(out / "checkpoints" / "3" / "data" / "metadata") as f:
    data = json.load(f)
  assert data["version"] == 3 and "ledger" in data
  # Resumed with the broadcast from both processes' own shards (rl.broadcast_from=shards: the
  # follower joins the leader's Ray, puts its pieces and posts them; nothing is gathered) and the
  # learner's sampler on the mesh of both: the worker rebuilds the policy from the two processes'
  # pieces, so its log-probs agree with the trainer's as closely as those of the gathered copy.
  resumed = [*over, "rl.steps=5", "rl.broadcast_from=shards", "rl.learner_sampler=mesh"]
  for rc, text in _launch(out, resumed, "--resume"):
    assert rc == 0, text[-3000:]
    assert "resumed from" in text
  recs = _jsonl(out / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
  # The new worker's weights came from the pieces (after a resume nothing else was ever put).
  assert all(r["staleness_max"] <= 1 for r in recs[3:]) and recs[3]["full_copies"] >= 1
  assert all(r["broadcast_bytes"] > 0 for r in recs[3:])
  gathered = max(r["train_infer_logprob_abs_diff"] for r in recs[:3])
  assert max(r["train_infer_logprob_abs_diff"] for r in recs[3:]) <= 2 * gathered + 0.05


@pytest.mark.slow
def test_sync_rl_and_eval_sample_on_the_mesh_of_two_processes(world):
  """rl.learner_sampler=mesh: the engine spans both processes' devices (each holds its shards of the
  weights and the cache, the follower replaying the leader's decode calls), for the sync rollouts,
  the end-of-run evaluation and `composer-jax eval --policy`. Against one process on the same
  8-device mesh: the same episodes and the same evaluation."""
  root, init, tasks = world
  over = MODEL + RL + MESH + RUN + [f"rl.tasks={tasks}", "rl.steps=1", "rl.learner_sampler=mesh",
                                    f"rl.eval_tasks={tasks}", "eval.samples=1"]
  one, two = root / "mh_mesh_one", root / "mh_mesh_two"
  for d, n in ((one, 1), (two, 2)):
    for rc, text in _launch(d, over, "--init", init, n=n):
      assert rc == 0, text[-3000:]
  ra, rb = _jsonl(one / "rollouts.jsonl"), _jsonl(two / "rollouts.jsonl")
  assert [r["messages"] for r in ra] == [r["messages"] for r in rb]  # both steps' episodes
  ea, eb = (json.loads((d / "eval" / "summary.json").read_text()) for d in (one, two))
  assert eb["tasks"] == 4 and eb["per_task"] == ea["per_task"]
  # The evaluation command over both processes: process 0 prints the summary, process 1 replays.
  out = root / "mh_mesh_eval"
  outs = run_cluster(["eval", "--tasks", tasks, "--policy", str(two), "--samples", "1", "--out",
                      str(out), "--set", "rl.learner_sampler=mesh", "--set"], n=2)
  for rc, text in outs:
    assert rc == 0, text[-3000:]
  assert '"pass@1"' in outs[0][1] and '"pass@1"' not in outs[1][1]
  assert json.loads((out / "summary.json").read_text())["tasks"] == 4

"""The main job (`composer-jax run`) as two processes of one jax.distributed job (fake cluster, 4 CPU
devices each, one 8-device mesh of data=2 x tensor=4): every stage runs, the training stages over
both processes, the file-making stages (tasks, expert trajectories, evaluations) on process 0 while
process 1 waits; the run directory is written once; `--resume` on two processes skips every stage."""

from __future__ import annotations

import json
import os

import pytest

from composer_jax.env import sandbox
from tests.parallel.cluster import ROOT, run_cluster
from tests.test_recipe import SMALL
from tests.train.test_resume import _env

TWO = [o for o in SMALL if o != "mesh.data=1"] + ["mesh.data=2", "mesh.tensor=4"]
STAGES = ["pretrain", "tasks", "expert", "sft", "anneal", "eval_sft", "rl", "eval_rl"]


def _jsonl(path) -> list:
  with open(path) as f:
    return [json.loads(x) for x in f if x.strip()]


@pytest.mark.slow
@pytest.mark.skipif(not sandbox.bwrap_available(), reason="bubblewrap cannot run here")
def test_main_job_on_two_processes_and_its_resume(tmp_path):
  out = tmp_path / "run"
  args = ["run", os.path.join(ROOT, "configs/tiny.yaml"), "--out", str(out), *TWO]
  outs = run_cluster(args, n=2, env=_env(), timeout=1500)
  for rc, text in outs:
    assert rc == 0, text[-4000:]
  with open(out / "summary.json") as f:
    s = json.load(f)
  assert set(s["wall_s"]) == set(STAGES)
  for part in (s["sft"], s["rl"]):
    assert part["tasks"] == 2 and part["samples"] == 2 and 0.0 <= part["pass@1"] <= 1.0
  # The table is process 0's; both processes logged every stage.
  assert "pass@1" in outs[0][1] and "pass@1" not in outs[1][1]
  for _, text in outs:
    assert all(f"== {name}" in text for name in STAGES)
  # Written once: one metrics line per step in each training stage, one trajectory per episode.
  for stage, steps in (("pretrain", 2), ("sft", 2), ("anneal", 1), ("rl", 1)):
    recs = _jsonl(out / stage / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, steps + 1))
    assert len([r for r in recs if "eval_bpb" in r]) == (0 if stage == "rl" else 2)  # start, end
  assert len(_jsonl(out / "eval" / "sft-heldout" / "trajectories.jsonl")) == 2 * 2
  # The trained stages are the two processes' job: their checkpoints carry both data states.
  assert json.loads((out / ".stages" / "rl.json").read_text())["policy"] == "anneal"
  # --resume on two processes: nothing runs again, the summary is rewritten the same.
  again = run_cluster([*args, "--resume"], n=2, env=_env(), timeout=600)
  for rc, text in again:
    assert rc == 0, text[-4000:]
    assert all(f"== {name}: done earlier, skipped" in text for name in STAGES)
  with open(out / "summary.json") as f:
    assert json.load(f)["rl"] == s["rl"]
  # The RL policy's evaluation again, its sampler over both processes (rl.learner_sampler=mesh):
  # process 1 replays process 0's decode calls; the same episodes as on process 0's one device.
  (out / ".stages" / "eval_rl.json").unlink()
  mesh = run_cluster([*args, "--resume", "rl.learner_sampler=mesh"], n=2, env=_env(), timeout=600)
  for rc, text in mesh:
    assert rc == 0, text[-4000:]
    assert "== eval_rl\n" in text and "== rl: done earlier, skipped" in text
  with open(out / "summary.json") as f:
    assert json.load(f)["rl"] == s["rl"]


@pytest.mark.skipif(not sandbox.bwrap_available(), reason="bubblewrap cannot run here")
def test_the_main_jobs_fit_checks_see_every_processs_devices(tmp_path):
  """The up-front fit checks read the devices, so they follow jax.distributed: on two processes of
  4 devices each they judge the 8-device mesh (not 'only 4 are visible'), in one line, and the run
  writes nothing."""
  out = tmp_path / "run"
  args = ["run", os.path.join(ROOT, "configs/tiny.yaml"), "--out", str(out), "mesh.data=2",
          "mesh.tensor=4", "run.pretrain_overrides=[data.batch_size=200000]"]
  for rc, text in run_cluster(args, n=2, env=_env(), timeout=300):
    assert rc == 2, text[-4000:]
    line = text.strip().splitlines()[-1]
    assert line.startswith("composer-jax: error: run.pretrain_overrides: a training step of "), line
    assert "mesh data=2 x tensor=4), more than the CPU device's share of the host" in line
  assert not out.exists()

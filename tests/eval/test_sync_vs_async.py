"""experiments/rl_sync_vs_async: the copy holds everything but the RL stage, and a run without one
is refused before anything is copied."""

from __future__ import annotations

import os
import sys

import pytest

from experiments import rl_sync_vs_async as sva


def _tree(root, files):
  for rel in files:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(rel)


def test_the_copy_leaves_out_the_rl_stage_and_its_evaluation(tmp_path):
  kept = ["config.yaml", "sft/checkpoints/300/x", "anneal/metrics.jsonl", "tasks/rl/t1/task.json",
          ".stages/sft.json", ".stages/eval_sft.json", "eval/sft-heldout/summary.json",
          "sft/rl/keep.txt"]  # an "rl" folder below a stage is not the RL stage
  gone = ["rl/checkpoints/22/x", "rl/config.yaml", "paired/sft/summary.json", ".stages/rl.json",
          ".stages/eval_rl.json", "eval/rl-heldout/summary.json", "eval/rl-unseen/summary.json"]
  run, out = str(tmp_path / "run"), str(tmp_path / "out")
  _tree(run, kept + gone)
  sva.copy_without_rl(run, out)
  for rel in kept:
    assert open(os.path.join(out, rel)).read() == rel
  for rel in gone:
    assert not os.path.exists(os.path.join(out, rel)), rel
  assert all(os.path.exists(os.path.join(run, rel)) for rel in gone)  # the original is untouched


def test_a_run_without_a_finished_rl_stage_is_refused_in_one_line(tmp_path, monkeypatch):
  run = str(tmp_path / "run")
  _tree(run, ["config.yaml", ".stages/sft.json"])
  monkeypatch.setattr(sys, "argv", ["rl_sync_vs_async", "--run", run])
  with pytest.raises(SystemExit) as e:
    sva.main()
  assert "no finished RL stage" in str(e.value) and "\n" not in str(e.value)
  assert not os.path.exists(f"{run}-flip")

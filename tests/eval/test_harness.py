"""The eval harness end to end on the demo task set: oracle 1.0, null 0.0, files written."""

from __future__ import annotations

import json
import os

from composer_jax.cli import main


def test_eval_cli_oracle_and_null(demo_tasks, tmp_path):
  tasks_dir, _ = demo_tasks
  for policy, expect in (("oracle", 1.0), ("null", 0.0)):
    out = tmp_path / policy
    rc = main(["eval", "--tasks", tasks_dir, "--policy", policy, "--samples", "2", "--limit", "1",
               "--out", str(out), "--set", "eval.k=[1,2]"])
    assert rc == 0
    s = json.load(open(out / "summary.json"))
    assert s["pass@1"] == expect and s["pass@2"] == expect and s["pass^2"] == expect
    assert s["tasks"] == 1 and s["samples_per_task"] == 2
    assert s["mean_tool_calls"] >= 1 and s["mean_completion_tokens"] > 0 and s["mean_wall_s"] > 0
    assert os.path.getsize(out / "score_vs_tokens.png") > 1000
    lines = open(out / "trajectories.jsonl").read().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["messages"][0]["role"] == "system"


def test_eval_cli_rejects_bad_policy_and_input(demo_tasks, tmp_path, capsys):
  tasks_dir, _ = demo_tasks
  assert main(["eval", "--tasks", tasks_dir, "--policy", str(tmp_path / "ckpt"), "--out",
               str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "give oracle, null or a run directory" in err and len(err.strip().splitlines()) == 1
  (tmp_path / "not_a_run").mkdir()
  assert main(["eval", "--tasks", tasks_dir, "--policy", str(tmp_path / "not_a_run"), "--out",
               str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "is not a run directory" in err and len(err.strip().splitlines()) == 1
  assert main(["eval", "--tasks", str(tmp_path / "none"), "--policy", "null", "--out",
               str(tmp_path / "o")]) == 2
  assert main(["eval", "--tasks", tasks_dir, "--policy", "null", "--out", str(tmp_path / "o"),
               "--set", "eval.k=[0]"]) == 2

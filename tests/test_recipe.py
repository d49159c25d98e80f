"""`composer-jax run` end to end at reduced size: every stage, the summary and the table, --resume."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from composer_jax.config import ConfigError, load_config
from composer_jax.env import sandbox
from composer_jax.recipe import (
  Recipe,
  anneal_overrides,
  bootstrap_ci,
  paired_difference,
  pooled_difference,
  stage_config,
  table,
)

SMALL = ["train.steps=2", "train.eval_every=0", "data.tokenizer_train_mb=1", "data.max_files=200",
         "run.train_tasks=4", "run.rl_tasks=3", "run.heldout_tasks=2", "run.unseen_tasks=2", "run.eval_samples=2",
         ("run.sft_overrides=[data.seq_len=1280,data.batch_size=2,train.steps=2,"
          "data.sft_copy_share=0.25,data.sft_spec_share=0.35]"),
         "run.anneal_steps=1", "run.anneal_overrides=[optim.lr=2.0e-4,optim.schedule=constant]",
         # the RL switches of configs/tiny.yaml (dynamic sampling, family curriculum, two PPO
         # passes), at a size that runs in seconds
         ("run.rl_overrides=[rl.steps=1,rl.tasks_per_step=2,rl.group_size=2,rl.max_new_tokens=16,"
          "rl.dynamic_sampling=true,rl.dynamic_max_rounds=2,rl.curriculum=family,rl.epochs=2,"
          "rl.sft_mix_coef=0.1,rl.sft_mix_rows=2]"),
         "run.eval_overrides=[rl.max_new_tokens=16,env.max_turns=2]",
         "train.progress=false", "mesh.data=1"]


def test_bootstrap_ci_brackets_the_mean():
  lo, hi = bootstrap_ci([0.0, 1.0] * 50)
  assert lo < 0.5 < hi and hi - lo < 0.3
  assert bootstrap_ci([1.0] * 10) == (1.0, 1.0)


def test_paired_difference_is_per_task_and_narrower_than_the_unpaired_spread():
  """40 tasks, half always solved and half never; the after-policy gains one sample on 8 of them.
  The paired mean is exactly 8 * 0.5 / 40; its interval is that of the per-task differences alone,
  so it excludes 0, while either policy's own interval spans ~0.3 (the hard/easy spread)."""
  before = {f"t{i}": {"c": 2 * (i % 2), "n": 2} for i in range(40)}
  after = {k: dict(v) for k, v in before.items()}
  for i in range(0, 16, 2):  # 8 never-solved tasks now solved once in 2
    after[f"t{i}"]["c"] = 1
  after["extra"] = {"c": 2, "n": 2}  # evaluated by one policy only: left out
  p = paired_difference(before, after)
  assert p["tasks"] == 40 and p["mean"] == pytest.approx(0.1)
  assert 0 < p["ci95"][0] < 0.1 < p["ci95"][1] < 0.2
  lo, hi = bootstrap_ci([v["c"] / v["n"] for v in before.values()])
  assert hi - lo > 2 * (p["ci95"][1] - p["ci95"][0])


def test_pooled_difference_averages_each_task_over_the_pairs():
  """Two seed pairs on 30 shared tasks: pair 1 gains one sample of 2 on tasks 0-9, pair 2 loses
  one on tasks 0-4. Per task the pooled difference is (0.5 + (-0.5)) / 2 = 0 on 0-4, 0.25 on 5-9
  and 0 elsewhere: mean 5 * 0.25 / 30. A task only one pair scored is left out."""
  base = {f"t{i}": {"c": 1, "n": 2} for i in range(30)}
  up = {k: {"c": 2 if int(k[1:]) < 10 else 1, "n": 2} for k in base}
  down = {k: {"c": 0 if int(k[1:]) < 5 else 1, "n": 2} for k in base}
  up["only_here"] = {"c": 2, "n": 2}
  p = pooled_difference([(base, up), (base, down)])
  assert p["tasks"] == 30 and p["mean"] == pytest.approx(5 * 0.25 / 30)
  assert 0 <= p["ci95"][0] < p["mean"] < p["ci95"][1] < 0.25
  assert p["mean"] == pytest.approx((paired_difference(base, up)["mean"]
                                     + paired_difference(base, down)["mean"]) / 2, abs=1e-6)


def test_paired_difference_at_k_uses_the_unbiased_estimator_per_task():
  """One task, 4 samples: 1 solved before, 2 after. pass@1 is c / n (0.25 -> 0.5); pass@2 is
  1 - C(n-c, 2) / C(n, 2): 1 - 3/6 = 0.5 before, 1 - 1/6 = 5/6 after; pass@4 is 1 for both."""
  before, after = {"t": {"c": 1, "n": 4}}, {"t": {"c": 2, "n": 4}}
  assert paired_difference(before, after)["mean"] == pytest.approx(0.25)
  assert paired_difference(before, after, 2)["mean"] == pytest.approx(5 / 6 - 0.5)
  assert paired_difference(before, after, 4)["mean"] == pytest.approx(0.0)


def test_table_says_when_the_rl_stage_also_trains_on_sft_chats():
  """RL - SFT of a stage with SFT rows includes continued SFT (docs/rl_gain.md, "Stop 36"): the
  table says so under the difference, and says nothing when the stage has none."""
  part = {"tasks": 2, "samples": 2, "pass@1": 0.5, "ci95": [0.0, 1.0], "pass@2": 0.5,
          "mean_completion_tokens": 9.0}
  s = {"sft": part, "rl": part, "unseen_templates": {"sft": part, "rl": part}, "rl_minus_sft_pass@1": 0.0,
       "wall_s": {"rl": 1.0}, "total_wall_s": 1.0, "rl_sft_mix_coef": 0.5}
  lines = table(s).splitlines()
  at = next(i for i, x in enumerate(lines) if x.startswith("RL - SFT held-out pass@1"))
  assert "rl.sft_mix_coef=0.5;" in lines[at + 1]
  for off in ({"rl_sft_mix_coef": 0.0}, {}):
    t = table({k: v for k, v in s.items() if k != "rl_sft_mix_coef"} | off)
    assert "sft_mix_coef" not in t and "RL - SFT held-out pass@1" in t


def test_anneal_stage_trains_on_the_expert_chats_alone_after_the_sft_stage():
  """The tiny config's anneal: the SFT stage's shape (rows, length), no drills, its own steps and
  rate; run.anneal_overrides win over the rest."""
  cfg = load_config("configs/tiny.yaml")
  sft = ["data.sft_path=T.jsonl", *cfg.run.sft_overrides]
  a = stage_config(cfg, anneal_overrides(cfg, sft))
  s = stage_config(cfg, sft)
  assert (a.data.seq_len, a.data.batch_size, a.data.sft_path) == (s.data.seq_len, s.data.batch_size, "T.jsonl")
  assert s.data.sft_copy_share > 0 and s.data.sft_spec_share > 0
  assert a.data.sft_copy_share == a.data.sft_spec_share == a.data.sft_word_share == 0.0
  worded = stage_config(cfg, anneal_overrides(cfg, [*sft, "data.sft_word_share=0.3"]))
  assert worded.data.sft_word_share == 0.0
  assert a.train.steps == cfg.run.anneal_steps == 88 and s.train.steps == 300
  assert (a.optim.lr, a.optim.schedule, a.optim.warmup_steps) == (2.0e-4, "constant", 0)
  cfg = load_config("configs/tiny.yaml", ["run.anneal_overrides=[train.steps=3]"])
  assert stage_config(cfg, anneal_overrides(cfg, sft)).train.steps == 3


def test_resume_refuses_a_stage_done_from_another_sft_policy(tmp_path):
  """A run directory whose SFT evaluation scored the SFT stage's policy is not silently reused by a
  config whose SFT policy is the anneal stage's: one line naming the field."""
  r = Recipe(load_config("configs/tiny.yaml"), str(tmp_path), log=lambda m: None)
  r._mark("eval_sft", {"heldout": {}, "wall_s": 1.0})  # written before the anneal stage existed
  with pytest.raises(ConfigError, match="run.anneal_steps"):
    r.stage("eval_sft", lambda: pytest.fail("must not run"), policy="anneal")
  assert r.stage("eval_sft", lambda: pytest.fail("must not run"), policy="sft")["wall_s"] == 1.0
  assert r.stage("rl", lambda: {"x": 1}, policy="anneal")["policy"] == "anneal"
  assert r._done("rl")["policy"] == "anneal"


@pytest.mark.slow
@pytest.mark.skipif(not sandbox.bwrap_available(), reason="bubblewrap cannot run here")
def test_main_job_small(tmp_path, capsys):
  from composer_jax.cli import main
  out = tmp_path / "run"
  assert main(["run", "configs/tiny.yaml", "--out", str(out), *SMALL]) == 0
  with open(out / "summary.json") as f:
    s = json.load(f)
  for part in (s["sft"], s["rl"], s["unseen_templates"]["sft"], s["unseen_templates"]["rl"]):
    assert 0.0 <= part["pass@1"] <= 1.0 and part["tasks"] == 2 and part["samples"] == 2
    assert part["ci95"][0] <= part["pass@1"] <= part["ci95"][1]
    assert part["pass@2"] is not None and part["pass@1"] <= part["pass@2"] <= 1.0
    fams = part["by_family"]  # pass@1 per template and level, weighted by episodes
    assert sum(f["tasks"] for f in fams.values()) == 2
    assert np.isclose(sum(f["pass@1"] * f["tasks"] for f in fams.values()) / 2, part["pass@1"])
  assert np.isclose(s["rl_minus_sft_pass@1"], s["rl"]["pass@1"] - s["sft"]["pass@1"])
  paired = s["rl_minus_sft_paired"]
  assert paired["tasks"] == 2 and np.isclose(paired["mean"], s["rl_minus_sft_pass@1"])
  assert paired["ci95"][0] <= paired["mean"] <= paired["ci95"][1]
  assert set(s["wall_s"]) == {"pretrain", "tasks", "expert", "sft", "anneal", "eval_sft", "rl", "eval_rl"}
  # The anneal stage continued the SFT stage's policy; evaluation and RL started from it.
  assert s["sft_policy"] == "anneal" and s["anneal_steps"] == 1
  assert json.loads((out / ".stages" / "eval_sft.json").read_text())["policy"] == "anneal"
  assert json.loads((out / ".stages" / "rl.json").read_text())["policy"] == "anneal"
  assert os.listdir(out / "anneal" / "checkpoints") == ["1"]
  # ... on the chats' assistant tokens (a pretraining batch would make every token a target).
  anneal = [json.loads(x) for x in (out / "anneal" / "metrics.jsonl").read_text().splitlines()]
  assert 0 < next(r for r in anneal if "target_tokens" in r)["target_tokens"] < 0.5 * 2 * 1280
  # RL ran on tasks of its own, none of them an SFT task.
  rl_ids = {d for d in os.listdir(out / "tasks" / "rl") if d.startswith("syn-")}
  assert len(rl_ids) == 3 and not rl_ids & set(os.listdir(out / "tasks" / "train"))
  with open(out / "rl" / "config.yaml") as f:
    rl_cfg = f.read()
  assert str(out / "tasks" / "rl") in rl_cfg
  # PPO-ptx: the RL stage mixed in SFT's own trajectories.
  assert f"sft_mix_path: {out / 'sft' / 'trajectories.jsonl'}" in rl_cfg
  rl_metrics = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
  assert all(np.isfinite(r["sft_mix_ce"]) and r["sft_mix_ce"] > 0 for r in rl_metrics)
  for d in ("pretrain/plots", "sft/plots", "rl/plots"):
    assert os.listdir(out / d)
  assert os.path.getsize(out / "score_vs_tokens.png") > 1000
  printed = capsys.readouterr().out
  assert "RL - SFT held-out pass@1" in printed and "paired 95% CI" in printed
  assert "held-out family" in printed
  assert "then 1 steps on the expert chats alone" in printed
  assert s["rl_sft_mix_coef"] == 0.1 and "rl.sft_mix_coef=0.1;" in printed
  # --resume skips every finished stage.
  assert main(["run", "configs/tiny.yaml", "--out", str(out), "--resume", *SMALL]) == 0
  assert capsys.readouterr().out.count("done earlier, skipped") == 8
  # A non-empty --out without --resume is refused in one line.
  assert main(["run", "configs/tiny.yaml", "--out", str(out), *SMALL]) == 2

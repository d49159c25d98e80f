"""The scripted expert: exact edit blocks, every synthetic template solved through the real tools in
the sandbox, and its JSONL trajectories read and tokenized by the SFT pipeline in the one format."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from composer_jax.data import chat
from composer_jax.data.sft import encode_chat, read_trajectories
from composer_jax.env import synthetic
from composer_jax.env.episode import (
  NullPolicy,
  OraclePolicy,
  run_episode,
  system_prompt,
)
from composer_jax.env.expert import (
  ExpertPolicy,
  apply_calls,
  edit_calls,
  expert_trajectories,
  flaw,
)
from composer_jax.env.protocol import parse
from composer_jax.env.synthetic import TEMPLATES
from composer_jax.env.tasks import read_text
from composer_jax.env.tools import SPECS

LEVELS = [(name, d) for name, t in TEMPLATES.items() for d in t.levels]


def test_edit_calls_insert_added_lines_and_replace_changed_ones_exactly():
  before = "a = 1\nb = 2\n\ndef f(x):\n    return x\n\ndef g(x):\n    return x\n"
  after = "a = 1\nb = 2\nc = 3\n\ndef f(x):\n    return x + 1\n\ndef g(x):\n    return x\n"
  calls = edit_calls(before, after)
  # The added line is an insert after line 2 (nothing copied); the repeated `return x` is widened
  # to be unique.
  assert calls == [("insert", {"line": 2, "text": "c = 3"}),
                   ("str_replace", {"old": "def f(x):\n    return x", "new": "def f(x):\n    return x + 1"})]
  assert apply_calls(before, calls) == after
  # Two inserts: the second's line number counts the first one's lines (calls run in order).
  before, after = "a\nb\nc\n", "top\na\nb\nx\ny\nc\n"
  calls = edit_calls(before, after)
  assert calls == [("insert", {"line": 0, "text": "top"}), ("insert", {"line": 3, "text": "x\ny"})]
  assert apply_calls(before, calls) == after
  # A line changed and a line added in one block is one replace, anchored on no neighbour.
  assert edit_calls("x = 1\n", "y = 0\nx = 2\n") == [("str_replace", {"old": "x = 1", "new": "y = 0\nx = 2"})]


def test_two_file_expert_inserts_the_constant_and_the_import(level_tasks):
  task = level_tasks[("two_file", 1)]
  traj = run_episode(task, ExpertPolicy(), max_turns=12)
  assert traj.reward == 1.0
  edits = [c for c in traj.calls if c["name"] in ("insert", "str_replace")]
  # consts file: the constant after its 3 lines; module: the import after line 1; body: a replace.
  assert [(c["name"], c["args"].get("line")) for c in edits] == [("insert", 3), ("insert", 1),
                                                                    ("str_replace", None)]


def test_flaw_changes_one_site_and_never_back_to_the_old_text():
  rng = random.Random(0)
  seen = {flaw("    return x + 3", "    return x * 3", rng) for _ in range(200)}
  # one operator (never "+", which is the bug itself) or the constant moved by one
  assert seen == {"    return x - 3", "    return x // 3", "    return x % 3", "    return x * 4",
                  "    return x * 2"}
  assert flaw("a", "b = name", rng) is None  # nothing to change
  assert flaw("x", "y = a-b", rng) is None  # "-" without spaces is not taken for an operator


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_flawed_runs_fail_and_differ_from_the_sound_run_in_one_edit(level_tasks, tmp_path, name):
  d = TEMPLATES[name].levels[0]
  out = tmp_path / "t.jsonl"
  rep = expert_trajectories([level_tasks[(name, d)]], str(out), tool_docs="brief", flawed=2, seed=1,
                            log=lambda m: None)
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert rep["kept"] == 1 and not recs[0].get("flawed")
  assert rep["flawed"] == len(recs) - 1 >= 1, "every template has an operator or constant to flaw"
  sound = [m["content"] for m in recs[0]["messages"] if m["role"] == "assistant"]
  for r in recs[1:]:
    assert r["flawed"] and r["reward"] < 1.0
    bad = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
    assert len(bad) == len(sound) and sum(a != b for a, b in zip(bad, sound)) == 1
  assert rep["summary"]["pass_rate"] == 1.0  # the summary is of the sound runs


@pytest.mark.parametrize("by", ["fix", "review"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_recovery_runs_fix_the_flaw_a_failing_test_showed_and_train_only_the_fix(level_tasks, tmp_path,
                                                                              name, by):
  """A recovery run is the flawed plan, a failing test run, the fix, a passing one and submit; its
  flawed turn is left out of SFT's loss, and the fix is ``edit_calls`` from the flawed file. With
  ``recover_by="review"`` a view of the flawed file comes between the failing run and the fix, and
  it shows the flawed lines the fix replaces."""
  from composer_jax.data import sources
  from composer_jax.data.tokenizer import train_bpe
  task = level_tasks[(name, TEMPLATES[name].levels[0])]
  out = tmp_path / "t.jsonl"
  for seed in range(4):  # a draw can flaw a line the visible tests do not pin down: none is kept
    rep = expert_trajectories([task], str(out), tool_docs="brief", recover=1.0, seed=seed,
                              recover_by=by, log=lambda m: None)
    if rep["recovered"]:
      break
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  # The recovery run takes the sound run's place: one chat per task whatever the share.
  assert rep["kept"] == 1 and rep["recovered"] == 1 and len(recs) == 1 and recs[0]["recovered"]
  msgs = recs[0]["messages"]
  asst = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
  expert_trajectories([task], str(tmp_path / "sound.jsonl"), tool_docs="brief", log=lambda m: None)
  sound_run = json.loads((tmp_path / "sound.jsonl").read_text())
  assert "recovered" not in sound_run
  sound = [m["content"] for m in sound_run["messages"] if m["role"] == "assistant"]
  n_files = len(task.source["edit_order"])
  review = by == "review"
  assert len(asst) == len(sound) + 2 + review  # (a view,) the fix and a second test run
  untrained = [i for i in asst if msgs[i].get("train") is False]
  assert len(untrained) == 1 and msgs[untrained[0]]["content"] not in sound  # the flawed edit
  tests = [i for i in asst if "run_tests.py" in msgs[i]["content"]]
  assert len(tests) == 2 and tests[1] == asst[-2]
  assert "[exit code 0]" not in msgs[tests[0] + 1]["content"]  # the flaw showed
  assert "[exit code 0]" in msgs[tests[1] + 1]["content"]  # the fix passes
  # The fix is the one change from the flawed file to the reference, on the flawed file's path.
  flawed_at = asst.index(untrained[0]) // 2
  rel = task.source["edit_order"][flawed_at]
  fix = parse(msgs[tests[0] + 2 + 2 * review]["content"], SPECS).calls
  assert [c.args["path"] for c in fix] == [rel] * len(fix) and flawed_at < n_files
  if review:
    assert parse(msgs[tests[0] + 2]["content"], SPECS).calls[0].args == {"path": rel}
    shown = msgs[tests[0] + 3]["content"]
    assert all(line in shown for c in fix if c.name == "str_replace" for line in c.args["old"].splitlines())
  before = read_text(os.path.join(task.workspace_dir, rel))
  flawed = apply_calls(before, [(c.name, {k: v for k, v in c.args.items() if k != "path"})
                                for c in parse(msgs[untrained[0]]["content"], SPECS).calls])
  gold = read_text(os.path.join(task.gold_dir, rel))
  assert apply_calls(flawed, [(c.name, {k: v for k, v in c.args.items() if k != "path"})
                              for c in fix]) == gold != flawed
  # SFT's mask: no token of the flawed turn is trained; every other assistant turn is.
  tok = train_bpe([d.read() for d in sources.list_docs("stdlib", max_files=5)], 300)
  mask = encode_chat(msgs, tok)["loss_mask"]
  full = encode_chat([{k: v for k, v in m.items() if k != "train"} for m in msgs], tok)["loss_mask"]
  flawed_tokens = len(tok.encode(msgs[untrained[0]]["content"] + chat.IM_END))
  assert full.sum() - mask.sum() == flawed_tokens > 0


@pytest.mark.parametrize("name,level", LEVELS)
def test_redo_recovery_undoes_the_flawed_file_and_repeats_its_sound_edits(level_tasks, tmp_path,
                                                                          name, level):
  """``recover_by="redo"``: after the failing run, one turn undoes every edit the flawed turn made
  to its file and makes that file's sound edits again, the same calls as the sound run's; the
  tests then pass (``_recovery_run`` keeps only runs graded 1.0) and the flawed turn is untrained."""
  task = level_tasks[(name, level)]
  expert_trajectories([task], str(tmp_path / "sound.jsonl"), tool_docs="brief", log=lambda m: None)
  sound = [m["content"] for m in json.loads((tmp_path / "sound.jsonl").read_text())["messages"]
           if m["role"] == "assistant"]
  for seed in range(6):  # a draw can flaw a line the visible tests do not pin down: none is kept
    rep = expert_trajectories([task], str(tmp_path / "r.jsonl"), tool_docs="brief", recover=1.0,
                              recover_by="redo", seed=seed, log=lambda m: None)
    if rep["recovered"]:
      break
  assert rep["recovered"] == 1, f"no flaw of {task.instance_id} showed in 6 draws"
  msgs = json.loads((tmp_path / "r.jsonl").read_text())["messages"]
  asst = [m for m in msgs if m["role"] == "assistant"]
  flawed = next(i for i, m in enumerate(asst) if m.get("train") is False)
  assert asst[:flawed] == [{"role": "assistant", "content": c} for c in sound[:flawed]]
  redo = parse(asst[-3]["content"], SPECS).calls
  n_undo = len(parse(asst[flawed]["content"], SPECS).calls)
  assert [c.name for c in redo[:n_undo]] == ["undo"] * n_undo and n_undo >= 1
  rel = redo[0].args["path"]
  assert all(c.args["path"] == rel for c in redo)
  assert redo[n_undo:] == parse(sound[flawed], SPECS).calls  # the sound run's edit turn, again
  assert "[exit code 0]" in msgs[-3]["content"] and len(asst) == len(sound) + 2


def test_recovery_needs_a_flaw_and_test_runs():
  with pytest.raises(ValueError, match="recover"):
    ExpertPolicy(run_tests=False, flaw_rng=random.Random(0), recover=True)
  with pytest.raises(ValueError, match="recover"):
    ExpertPolicy(recover=True)
  with pytest.raises(ValueError, match="recover_by"):
    ExpertPolicy(flaw_rng=random.Random(0), recover=True, recover_by="retry")


@pytest.fixture(scope="module")
def level_tasks(tmp_path_factory):
  base = tmp_path_factory.mktemp("expert")
  return {(n, d): synthetic.write_task(TEMPLATES[n].make(random.Random(f"e/{n}/{d}"), d),
                                       str(base / f"{n}-{d}")) for n, d in LEVELS}


@pytest.mark.parametrize("name,d", LEVELS)
def test_expert_solves_every_template_in_the_sandbox(level_tasks, name, d):
  task = level_tasks[(name, d)]
  traj = run_episode(task, ExpertPolicy(), max_turns=12)
  assert traj.reward == 1.0 and traj.submitted and not traj.flags, traj.grade
  n_files = len(task.source["edit_order"])
  assert traj.turns == 2 * n_files + 2 and traj.format_errors == 0
  assert all(c["ok"] for c in traj.calls)
  for m in traj.messages:  # every assistant turn is tool calls only, in the one format
    if m["role"] == "assistant":
      res = parse(m["content"], SPECS)
      assert res.calls and not res.errors
      assert chat.parse_tool_calls(m["content"])[0] == ""


def test_oracle_one_null_zero_through_episodes(level_tasks):
  task = level_tasks[("two_file", 2)]
  assert run_episode(task, OraclePolicy()).reward == 1.0
  assert run_episode(task, NullPolicy()).reward == 0.0


def test_trajectories_feed_sft_in_the_one_format(level_tasks, tmp_path):
  from composer_jax.data import sources
  from composer_jax.data.tokenizer import train_bpe
  tok = train_bpe([d.read() for d in sources.list_docs("stdlib", max_files=20)], 400)
  tasks = [level_tasks[("implement", 1)], level_tasks[("two_file", 1)]]
  out = tmp_path / "t.jsonl"
  rep = expert_trajectories(tasks, str(out), tokenizer=tok, tool_docs="brief", log=lambda m: None)
  assert rep["kept"] == 2 and rep["summary"]["pass_rate"] == 1.0
  st = rep["trajectories"][0]
  assert st["tokens"] > st["prompt_tokens"] > 0 and 0 < st["assistant_tokens"] < st["tokens"]
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert recs[0]["template"] == "implement"
  trajs = read_trajectories(str(out))
  assert trajs[0][0]["content"] == system_prompt("brief")
  assert len(encode_chat(trajs[0], tok)["tokens"]) == st["tokens"]
  for msgs in trajs:
    ex = encode_chat(msgs, tok)
    ids, mask = ex["tokens"], ex["loss_mask"]
    # The trained tokens are exactly the assistant turns, each ending in <|im_end|>, and they parse
    # back into the calls the environment executed.
    turns = tok.decode(ids[mask == 1]).split(chat.IM_END)[:-1]
    assistant = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert turns == assistant
    calls = [c for t in turns for c in chat.parse_tool_calls(t)[1]]
    assert [c["name"] for c in calls][-2:] == ["terminal", "submit"]
    assert np.all(mask[:len(tok.encode(chat.render_segments(msgs[:2])[0][0]))] == 0)


def test_brief_tool_docs_list_every_tool_in_one_line_each():
  brief, full = system_prompt("brief"), system_prompt("full")
  assert len(brief) < 0.7 * len(full)
  lines = [line for line in brief.splitlines() if line.startswith("- ")]
  assert [line[2:].split("(")[0] for line in lines] == list(SPECS)
  assert "- str_replace(path, old, new?):" in brief

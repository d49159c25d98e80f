"""Edit drills: every argument of their calls is a copy of the chat's own text, and the real tools
accept the calls; they come only from the texts they are given."""

from __future__ import annotations

import re

import pytest

from composer_jax.data import chat, sources
from composer_jax.data.drills import edit_drills
from composer_jax.data.sft import with_drills
from composer_jax.env.episode import system_prompt
from composer_jax.env.protocol import parse_observations


@pytest.fixture(scope="module")
def texts():
  return [d.read() for d in sources.list_docs("stdlib", max_files=30)]


@pytest.fixture(scope="module")
def drills(texts):
  return edit_drills(texts, 60, seed=3, system=system_prompt("signatures"))


def test_every_argument_is_copied_from_the_chat(drills, texts):
  corpus_lines = {ln.strip() for t in texts for ln in t.splitlines()}
  names, ks = set(), set()
  for msgs in drills:
    assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "tool"] * 3
    k, path, new = re.fullmatch(r"Line (\d+) of `(.+?)` should read `(.*)`\. Edit it\.",
                                msgs[1]["content"]).groups()
    calls = [chat.parse_tool_calls(m["content"])[1] for m in msgs[2::2]]
    assert [c[0]["name"] for c in calls] == ["view", "str_replace", "submit"]
    view, edit = calls[0][0]["arguments"], calls[1][0]["arguments"]
    assert view == {"path": path} and edit["path"] == path and edit["new"] == new
    # The old text is line k of the file the view showed, exactly once in it.
    (tool, ok, shown), = parse_observations(msgs[3]["content"])
    assert tool == "view" and ok
    file_lines = [ln.split("\t", 1)[1] for ln in shown.splitlines()]
    assert file_lines[int(k) - 1] == edit["old"] and "\n".join(file_lines).count(edit["old"]) == 1
    # The real tool made the edit; the lines are the corpus's.
    (_, ok, edited), = parse_observations(msgs[5]["content"])
    assert ok and f"{int(k):6d}\t{new}" in edited
    assert edit["old"].strip() in corpus_lines and new.strip() in corpus_lines
    names.add(path)
    ks.add(k)
  # Names vary as much as the drills do: a policy cannot remember them.
  assert len(names) > 0.8 * len(drills) and len(ks) >= 4


def test_drills_are_deterministic_and_use_only_the_given_texts(texts, drills):
  assert edit_drills(texts, 60, seed=3, system=system_prompt("signatures")) == drills
  assert edit_drills(texts, 60, seed=4)[0] != drills[0]
  only = ["def alpha_beta(x):\n    y = x + 1\n    z = y * 2\n    return z - 3\n",
          "class gamma_delta:\n    size_limit = 4\n    rate_cap = 9\n"]
  lines = {ln.strip() for t in only for ln in t.splitlines()}
  for msgs in edit_drills(only, 8, seed=0):
    edit = chat.parse_tool_calls(msgs[3]["content"])[1][0]["arguments"]
    assert edit["path"][:-3] in {"alpha_beta", "return", "class", "gamma_delta", "size_limit", "rate_cap"}
    assert edit["old"].strip() in lines and edit["new"].strip() in lines
  with pytest.raises(ValueError, match="no runs of 3"):
    edit_drills(["x = 1\n"], 1)


def test_share_sets_the_fraction_of_drills_and_takes_the_system_message(texts, drills):
  trajs = [drills[0]] * 30  # stand-ins for expert trajectories
  mixed = with_drills(trajs, 0.25, texts)
  assert len(mixed) == 40 and mixed[:30] == trajs
  assert all(m[0] == drills[0][0] for m in mixed[30:])
  assert with_drills(trajs, 0.0, texts) is trajs

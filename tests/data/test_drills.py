"""Edit drills: every argument of their calls is a copy of the chat's own text, and the real tools
accept the calls; they come only from the texts they are given. Spec drills: the expert's calls on
fresh training-split instances, which replayed give the reference solution. Word drills: one edit
whose function does what an independent reading of its docstring's words says."""

from __future__ import annotations

import inspect
import operator
import random
import re

import pytest

from composer_jax.data import chat, sources
from composer_jax.data.drills import edit_drills, spec_drills, word_drills
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


def test_spec_drills_solve_fresh_training_instances_with_the_experts_calls(tmp_path):
  from composer_jax.env.sandbox import Sandbox
  from composer_jax.env.synthetic import instance_split, instances
  from composer_jax.env.tools import ToolBox, ToolCall
  system = system_prompt("signatures")
  drills = spec_drills(12, seed=1, system=system)
  insts = instances(12, seed=7_000_004, split="train", levels=[2, 3])  # the drills' own draw
  assert spec_drills(12, seed=1, system=system) == drills and spec_drills(12, seed=2)[0] != drills[0]
  for i, (msgs, inst) in enumerate(zip(drills, insts)):
    assert inst.difficulty in (2, 3) and instance_split(inst) == "train"
    assert msgs[0] == {"role": "system", "content": system} and msgs[1]["content"] == inst.prompt
    calls = [c for m in msgs[2::2] for c in chat.parse_tool_calls(m["content"])[1]]
    assert [c["name"] for c in calls][-1] == "submit"
    assert all('status="ok"' in m["content"] for m in msgs[3::2])
    # Replaying the calls on the instance's files gives its reference solution.
    ws = tmp_path / str(i)
    ws.mkdir()
    tools = ToolBox(Sandbox(str(ws)))
    for rel, text in inst.files.items():
      (ws / rel).write_text(text)
    for c in calls[:-1]:
      assert tools.execute(ToolCall(c["name"], c["arguments"])).ok
    assert {rel: (ws / rel).read_text() for rel in inst.gold} == inst.gold


def test_spec_levels_reach_the_drills(texts, drills):
  """data.sft_spec_levels picks the spec drills' difficulty levels (two_file d1 among them when 1
  is given); a level outside 1-3 is one line naming the field."""
  from composer_jax.config import ConfigError, load_config, validate
  from composer_jax.env.synthetic import instances
  trajs = [drills[0]] * 8
  mixed = with_drills(trajs, 0.0, texts, seed=3, spec_share=0.5, spec_levels=(1,))
  prompts = [m[1]["content"] for m in mixed[8:]]
  insts = instances(8, seed=7_000_006, split="train", levels=[1])  # the drills' own draw
  assert len(prompts) == 8 and prompts == [i.prompt for i in insts]
  assert {i.difficulty for i in insts} == {1} and "two_file" in {i.template for i in insts}
  default = with_drills(trajs, 0.0, texts, seed=3, spec_share=0.5)
  assert [m[1]["content"] for m in default[8:]] == [
    i.prompt for i in instances(8, seed=7_000_006, split="train", levels=[2, 3])]
  for bad in ("[4]", "[]", "[true]"):
    with pytest.raises(ConfigError, match=r"data.sft_spec_levels=.* levels 1, 2, 3"):
      validate(load_config(None, [f"data.sft_spec_levels={bad}"]))


def test_with_drills_mixes_both_kinds_at_their_shares(texts, drills):
  trajs = [drills[0]] * 30
  mixed = with_drills(trajs, 0.25, texts, spec_share=0.25)
  assert len(mixed) == 60 and mixed[:30] == trajs
  assert sum(m[1]["content"].startswith("Line ") for m in mixed[30:]) == 15
  assert all(m[0] == drills[0][0] for m in mixed[30:])


# An independent reading of the specs' words: left to right for operator chains (the comma closes
# what comes before it), and the comparisons by their English meaning.
_WORD_OPS = {"plus": operator.add, "minus": operator.sub, "times": operator.mul,
             "floor-divided by": operator.floordiv, "modulo": operator.mod}
_WORD_CMPS = {"greater than": operator.gt, "less than": operator.lt, "at least": operator.ge,
              "at most": operator.le, "equal to": operator.eq}
_OP = "|".join(map(re.escape, _WORD_OPS))
_CMP = "|".join(_WORD_CMPS)


def _read_words(doc: str, args: list[str]):
  """The function ``doc`` describes, as a Python callable over ``args``, or None if not a spec."""
  def val(tok, env):
    return env[tok] if tok in env else int(tok)
  if m := re.fullmatch(rf"Return the sum of the items of (\w+) that are ({_CMP}) (\d+)\.", doc):
    xs, cmp, c = m.groups()
    return lambda env: sum(x for x in env[xs] if _WORD_CMPS[cmp](x, int(c)))
  if m := re.fullmatch(rf"Return how many items of (\w+) are ({_CMP}) (\d+)\.", doc):
    xs, cmp, c = m.groups()
    return lambda env: len([x for x in env[xs] if _WORD_CMPS[cmp](x, int(c))])
  if m := re.fullmatch(rf"Return (\w+) if (\w+) is ({_CMP}) (\w+), else (\w+) ({_OP}) (\d+)\.", doc):
    a, a2, cmp, b, b2, op, c = m.groups()
    return lambda env: (env[a] if _WORD_CMPS[cmp](env[a2], env[b])
                        else _WORD_OPS[op](env[b2], int(c)))
  if m := re.fullmatch(rf"Return (\w+) ((?:(?:, )?(?:{_OP}) \w+)+)\.", doc):
    first, rest = m.groups()
    steps = re.findall(rf"({_OP}) (\w+)", rest)
    def chain(env):
      v = val(first, env)
      for op, x in steps:
        v = _WORD_OPS[op](v, val(x, env))
      return v
    return chain
  return None


def test_word_drills_write_what_their_docstrings_say_in_words(texts, tmp_path):
  from composer_jax.env.sandbox import Sandbox
  from composer_jax.env.synthetic import templates as T
  from composer_jax.env.tools import ToolBox, ToolCall
  system = system_prompt("signatures")
  drills = word_drills(texts, 120, seed=5, system=system)
  assert word_drills(texts, 120, seed=5, system=system) == drills and word_drills(texts, 4, seed=6)[0] != drills[0]
  phrases, conditions, helpers, fixes = set(), 0, 0, 0
  tests = r"Tests: `python run_tests\.py`\."
  rng = random.Random(0)
  for i, msgs in enumerate(drills):
    assert msgs[0] == {"role": "system", "content": system}
    m = (re.fullmatch(r"Implement `(\w+)` in `(\w+\.py)` as its docstring says\. " + tests, prompt := msgs[1]["content"])
         or re.fullmatch(r"`(\w+)` in `(\w+\.py)` does not do what its docstring says\. Fix the bug\. " + tests, prompt))
    fn, path = m.groups()
    fix = prompt.startswith("`")
    # Names from the corpus, never the templates' vocabulary: no drill's file is a task's file.
    assert path[:-3] not in T.MODULES + T.CONST_MODULES and not path.startswith("test")
    assert fn not in {f"{v}_{n}" for v in T.VERBS for n in T.NOUNS}
    calls = [c for m in msgs[2::2] for c in chat.parse_tool_calls(m["content"])[1]]
    assert [c["name"] for c in calls] == ["view", "str_replace", "submit"]
    (_, ok, shown), = parse_observations(msgs[3]["content"])
    before = "\n".join(ln.split("\t", 1)[1] for ln in shown.splitlines()) + "\n"
    assert ok and before.count("def ") in (1, 2) and ("raise NotImplementedError" in before) != fix
    helpers += before.count("def ") == 2
    fixes += fix
    ws = tmp_path / str(i)
    ws.mkdir()
    (ws / path).write_text(before)
    tools = ToolBox(Sandbox(str(ws)))
    assert tools.execute(ToolCall("str_replace", calls[1]["arguments"])).ok
    namespace: dict = {}
    exec((ws / path).read_text(), namespace)  # noqa: S102 -- our own generated code
    f = namespace[fn]
    args = list(inspect.signature(f).parameters)
    doc = inspect.getdoc(f)
    spec = _read_words(doc, args)
    assert spec is not None, doc
    conditions += any(p in doc for p in _WORD_CMPS)
    phrases |= {p for p in [*_WORD_OPS, *_WORD_CMPS] if f" {p} " in doc}
    for _ in range(6):
      env = {a: ([rng.randint(0, 9) for _ in range(4)] if a in T.LISTS else rng.randint(0, 9)) for a in args}
      assert f(*env.values()) == spec(env), (doc, env)
    if fix:  # the edit replaces the one line whose operator is the slip; the old text is a copy of it
      old, new = calls[1]["arguments"]["old"], calls[1]["arguments"]["new"]
      assert before.count(old) == 1 and old != new and old.split()[0] == new.split()[0]
  assert phrases == set(_WORD_OPS) | set(_WORD_CMPS)
  assert 0.45 < conditions / len(drills) < 0.75 and 0.3 < helpers / len(drills) < 0.7
  assert 0.3 < fixes / len(drills) < 0.7


def test_with_drills_adds_word_drills_at_their_share(texts, drills):
  trajs = [drills[0]] * 30
  mixed = with_drills(trajs, 0.25, texts, spec_share=0.0, word_share=0.25)
  assert len(mixed) == 60 and mixed[:30] == trajs
  assert sum(m[1]["content"].startswith("Line ") for m in mixed[30:]) == 15
  assert sum("its docstring says" in m[1]["content"] for m in mixed[30:]) == 15

"""Targeted-feedback detectors on a scripted episode built with the real protocol and guards."""

from __future__ import annotations

from composer_jax.env import guards
from composer_jax.env.protocol import ParseError, format_call, format_observation, parse
from composer_jax.env.tools import SPECS
from composer_jax.rl import feedback as F

FAILED_TESTS = "F.\n1 failed, 1 passed\n[exit code 1]"


def _episode(turns):
  """Messages as env/episode.py writes them; ``turns`` = [(assistant text, [(ok, text) per call])]."""
  msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}]
  for text, results in turns:
    msgs.append({"role": "assistant", "content": text})
    items, obs, it = parse(text, SPECS).items, [], iter(results)
    if not items:
      obs.append(format_observation("?", "no tool call found", False))
    for item in items:
      if isinstance(item, ParseError):
        obs.append(format_observation(item.tool, item.message, False))
      else:
        ok, out = next(it)
        obs.append(format_observation(item.name, out, ok))
    msgs.append({"role": "tool", "content": "\n".join(obs)})
  return msgs


TURNS = [
    # 0: a tool that does not exist
    ("Let me open it.\n" + format_call("open_file", {"path": "src/m.py"}), []),
    # 1: run the tests: they fail
    (format_call("terminal", {"command": "pytest -q"}), [(True, FAILED_TESTS)]),
    # 2: the same failing command again, nothing edited in between
    ("Again.\n" + format_call("terminal", {"command": "pytest -q"}), [(True, FAILED_TESTS)]),
    # 3: an edit that introduces an undefined name
    (format_call("str_replace", {"path": "src/m.py", "old": "a + b", "new": "foo(a) + b"}),
     [(True, "edited src/m.py")]),
    # 4: lint reports it
    (format_call("lint", {"path": "src/m.py"}),
     [(True, "src/m.py:3:12: F821 Undefined name `foo`\nFound 1 error.")]),
    # 5: a malformed call (unclosed argument)
    ('<tool_call name="view">\n<path>src/m.py\n</tool_call>', []),
    # 6: tests again (after an edit: not a repeat) and a look at the git history (a hack)
    (format_call("terminal", {"command": "pytest -q"}) + "\n" + format_call("terminal", {"command": "git log --all -p"}),
     [(True, FAILED_TESTS), (True, "commit 0\n[exit code 0]")]),
    # 7: nothing but talk
    ("I am done.", []),
]


def _records():
  msgs = _episode(TURNS)
  recs = F.records_from_messages(msgs)
  calls = [c for r in recs for c in r.calls]
  return msgs, recs, guards.scan_trajectory(calls)


def test_records_from_messages():
  _, recs, flags = _records()
  assert [r.index for r in recs] == list(range(8))
  assert recs[0].calls == [] and recs[0].parse_errors[0].startswith("unknown tool 'open_file'")
  assert recs[1].calls == [{"name": "terminal", "args": {"command": "pytest -q"}, "ok": True,
                            "text": FAILED_TESTS}]
  assert [c["name"] for c in recs[6].calls] == ["terminal", "terminal"]
  assert len(recs[7].observations) == 1 and not recs[7].calls and not recs[7].parse_errors
  # the guard's step indexes the flat call list: pytest(1), pytest(2), edit(3), lint(4), pytest, git
  assert [(f.rule, f.severity, f.step) for f in flags] == [("git_history", "hack", 5)]


def test_detect_all_hints():
  _, recs, flags = _records()
  hints = F.detect_hints(recs, flags, max_hints=10)
  assert [(h.turn_index, h.kind) for h in hints] == [
      (0, "unknown_tool"), (2, "repeated_failure"), (3, "lint_error"), (5, "malformed_call"), (6, "hack")]
  text = {h.kind: h.text for h in hints}
  assert text["unknown_tool"] == ("Hint: the tool `open_file` does not exist; the available tools are: "
                                  "view, create, str_replace, insert, undo, search, find, lint, terminal, submit.")
  assert "`pytest -q` already failed (exit code 1)" in text["repeated_failure"]
  assert "`src/m.py`" in text["lint_error"] and "line 3: F821 Undefined name `foo`" in text["lint_error"]
  assert "argument <path> is not closed" in text["malformed_call"]
  assert "git history" in text["hack"]
  # flags given as dicts (as Trajectory.flags stores them) work the same
  import dataclasses
  assert F.detect_hints(recs, [dataclasses.asdict(f) for f in flags], max_hints=10) == hints


def test_max_hints_picks_by_kind_then_turn():
  _, recs, flags = _records()
  hints = F.detect_hints(recs, flags, max_hints=2)  # the hack, then the unknown tool; in turn order
  assert [(h.turn_index, h.kind) for h in hints] == [(0, "unknown_tool"), (6, "hack")]
  assert F.detect_hints(recs, flags, max_hints=0) == []
  custom = F.detect_hints(recs, tool_names=["view", "submit"], max_hints=1)
  assert custom[0].text.endswith("the available tools are: view, submit.")


def test_one_hint_per_turn_and_no_false_positives():
  # a failing call and an unknown tool in one message: one hint, the unknown tool
  turns = [(format_call("terminal", {"command": "make"}), [(False, "timed out")]),
           (format_call("terminal", {"command": "make"}) + format_call("grep", {"pattern": "x"}),
            [(False, "timed out")])]
  recs = F.records_from_messages(_episode(turns))
  assert [(h.turn_index, h.kind) for h in F.detect_hints(recs, max_hints=5)] == [(1, "unknown_tool")]
  # tests re-run after an edit, and a lint error that was there before the edit: no hints
  turns = [(format_call("lint", {"path": "m.py"}), [(True, "m.py:1:1: F401 `os` imported but unused")]),
           (format_call("terminal", {"command": "pytest"}), [(True, FAILED_TESTS)]),
           (format_call("create", {"path": "m.py", "content": "import os\nx = 1\n"}), [(True, "overwrote m.py")]),
           (format_call("terminal", {"command": "pytest"}) + format_call("lint", {"path": "m.py"}),
            [(True, FAILED_TESTS), (True, "./m.py:1:1: F401 `os` imported but unused")])]
  recs = F.records_from_messages(_episode(turns))
  assert F.detect_hints(recs, max_hints=5) == []
  assert F.behaviour_stats(recs)["repeated_commands"] == 0


def test_lint_through_terminal():
  # ruff run from the terminal counts; pytest's "path:line: Error" lines (no column) do not
  turns = [(format_call("create", {"path": "pkg/a.py", "content": "x = y\n"}), [(True, "created pkg/a.py")]),
           (format_call("terminal", {"command": "pytest -q; ruff check pkg"}),
            [(True, "pkg/a.py:1: NameError\npkg/a.py:1:5: F821 Undefined name `y`\n[exit code 1]")])]
  hints = F.detect_hints(F.records_from_messages(_episode(turns)), max_hints=3)
  assert [(h.turn_index, h.kind) for h in hints] == [(0, "lint_error")]
  assert "(line 1: F821 Undefined name `y`)" in hints[0].text and "NameError" not in hints[0].text


def test_behaviour_stats():
  _, recs, _ = _records()
  # repeated: turn 2 only (turn 6's pytest follows the edit in turn 3)
  assert F.behaviour_stats(recs) == {"malformed_calls": 1, "unknown_tools": 1, "repeated_commands": 1,
                                     "no_call_turns": 1, "tool_calls": 6, "turns": 8}


def test_hint_message_and_insert():
  msgs, recs, flags = _records()
  hint = F.detect_hints(recs, flags)[0]  # turn 0
  assert F.hint_message(hint) == {"role": "system", "content": hint.text}
  teacher = F.insert_hint(msgs, hint)
  assert len(teacher) == len(msgs) + 1
  assert teacher[2] == F.hint_message(hint) and teacher[3] == msgs[2]  # just before assistant #0
  h6 = F.Hint(6, "hack", "Hint: x.")
  t6 = F.insert_hint(msgs, h6)
  i = t6.index(F.hint_message(h6))
  assert t6[i + 1] is msgs[2 + 2 * 6] and t6[:i] == msgs[:i]

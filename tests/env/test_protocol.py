"""The tool-call text protocol: round trips, raw argument text, and every malformed shape."""

from __future__ import annotations

from composer_jax.env.protocol import (
  ParseError,
  ToolCall,
  format_call,
  format_observation,
  parse,
  parse_observations,
)
from composer_jax.env.tools import SPECS


def test_round_trip_with_awkward_text():
  content = 'def f():\n    return "</tool_call>" + \'<path>\'\n\n'
  text = "I'll write it.\n" + format_call("create", {"path": "a.py", "content": content}) + \
      "\nthen\n" + format_call("view", {"path": "a.py", "start": 2, "end": 3})
  res = parse(text, SPECS)
  assert not res.errors and [c.name for c in res.calls] == ["create", "view"]
  assert res.calls[0].args == {"path": "a.py", "content": content}
  assert res.calls[1].args == {"path": "a.py", "start": 2, "end": 3}


def test_one_newline_stripped_each_side():
  res = parse('<tool_call name="str_replace">\n<path>x</path>\n<old>\n\n  a\n\n</old>\n'
              '<new>b</new>\n</tool_call>', SPECS)
  assert res.calls[0].args["old"] == "\n  a\n"


def test_malformed_calls_become_errors():
  cases = {
      '<tool_call name="view"><path>a</path>': "not closed",
      '<tool_call name="view"><path>a</tool_call>': "not closed",
      '<tool_call name="rm_rf"><path>a</path></tool_call>': "unknown tool",
      '<tool_call name="view"></tool_call>': "needs argument",
      '<tool_call name="view"><path>a</path><start>ten</start></tool_call>': "integer",
      '<tool_call name="view"><file>a</file></tool_call>': "no argument <file>",
      '<tool_call view><path>a</path></tool_call>': "malformed call opening",
      '<tool_call name="view">path=a</tool_call>': "expected an argument tag",
      '<tool_call name="view"><path>a</path><path>b</path></tool_call>': "twice",
  }
  for text, msg in cases.items():
    res = parse(text + "\n" + format_call("submit", {}), SPECS)
    assert len(res.errors) == 1 and msg in res.errors[0].message, (text, res.items)
    # the parser recovers: the valid call after the broken one is still found
    assert [c.name for c in res.calls] == ["submit"], text
  assert parse("no calls here, just prose", SPECS).items == []


def test_order_is_kept():
  text = format_call("submit", {}) + '<tool_call name="nope"></tool_call>' + format_call("find", {"pattern": "*"})
  kinds = [type(i) for i in parse(text, SPECS).items]
  assert kinds == [ToolCall, ParseError, ToolCall]


def test_observations_round_trip():
  msg = format_observation("view", "1\tx\n2\ty") + "\n" + format_observation("?", "bad", ok=False)
  assert parse_observations(msg) == [("view", True, "1\tx\n2\ty"), ("?", False, "bad")]

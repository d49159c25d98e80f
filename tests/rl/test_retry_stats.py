"""experiments/retry_stats.py: what a policy does right after its first failing test run."""

from __future__ import annotations

import json

from composer_jax.env.protocol import format_call
from experiments.retry_stats import episode_stats, summarize

TEST = format_call("terminal", {"command": "python run_tests.py"})
FAIL = '<observation tool="terminal" status="ok">\n0 passed, 1 failed\n[exit code 1]\n</observation>'
PASS = '<observation tool="terminal" status="ok">\n1 passed, 0 failed\n[exit code 0]\n</observation>'
EDIT = format_call("str_replace", {"path": "a.py", "old": "x", "new": "y"})
BAD = '<observation tool="str_replace" status="error">\nno match for <old> in a.py\n</observation>'
OK = '<observation tool="str_replace" status="ok">\nedited a.py\n</observation>'
SUBMIT = format_call("submit", {})


def _episode(turns, resolved):
  msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
  for call, obs in turns:
    msgs += [{"role": "assistant", "content": call}, {"role": "tool", "content": obs}]
  return {"messages": msgs, "resolved": resolved}


def test_retry_stats_reads_the_turn_after_the_first_failing_run(tmp_path):
  recovered = _episode([(EDIT, OK), (TEST, FAIL), (EDIT, BAD), (EDIT, OK), (TEST, PASS),
                        (SUBMIT, "done")], True)
  gave_up = _episode([(EDIT, OK), (TEST, FAIL), (SUBMIT, "done")], False)
  untested = _episode([(EDIT, OK), (SUBMIT, "done")], True)
  first_try = _episode([(EDIT, OK), (TEST, PASS), (SUBMIT, "done")], True)
  assert episode_stats(recovered) == {"resolved": True, "ran_tests": True, "failed_run": True,
                                      "after_fail": "edit", "tool_error": True}
  assert episode_stats(gave_up)["after_fail"] == "submit"
  assert episode_stats(untested) == {"resolved": True, "ran_tests": False, "failed_run": False,
                                     "after_fail": None, "tool_error": False}
  path = tmp_path / "t.jsonl"
  path.write_text("".join(json.dumps(e) + "\n" for e in (recovered, gave_up, untested, first_try)))
  assert summarize(str(path)) == {"episodes": 4, "resolved": 3, "ran_tests": 3, "failed_run": 2,
                                  "then_submit": 1, "then_edit": 1, "then_other": 0,
                                  "recovered": 1, "tool_error": 1}

"""experiments/rl_rollout_phrases.py: which operator an episode's edit wrote for its spec's phrase."""

from __future__ import annotations

import json

from composer_jax.env.protocol import format_call
from experiments.rl_rollout_phrases import episode_facts, tally

VIEW = ('<observation tool="view" status="ok">\n    def trim(self, n):\n        """If n is at most '
        'self.total, set self.total to n times 6. Return self.total."""\n        raise NotImplementedError\n'
        '</observation>')


def _episode(new: str, resolved: bool, task="syn-method-d3-0a1b2c") -> dict:
  edit = format_call("str_replace", {"path": "a.py", "old": "if n > self.total:", "new": new})
  return {"task": task, "resolved": resolved,
          "messages": [{"role": "user", "content": "Complete the method `Meter.trim`."},
                       {"role": "assistant", "content": format_call("view", {"path": "a.py"})},
                       {"role": "tool", "content": VIEW}, {"role": "assistant", "content": edit}]}


def test_the_operator_is_read_from_the_new_text_not_the_old(tmp_path):
  right = _episode("if n <= self.total:\n    self.total = n * 6", True)
  wrong = _episode("if n > self.total:\n    self.total = n * 6", False)
  assert episode_facts(right) == ("method-d3", "at most", "<=", True)
  assert episode_facts(wrong) == ("method-d3", "at most", ">", False)
  plain = dict(right, messages=right["messages"][:1] + [{"role": "tool", "content": "no phrase"}])
  assert episode_facts(plain)[1:3] == (None, None)
  path = tmp_path / "e.jsonl"
  path.write_text("".join(json.dumps(e) + "\n" for e in (right, wrong, wrong, plain)))
  assert tally(str(path), set()) == {"method-d3 / at most": {
      "episodes": 3, "resolved": 0.333, "wrote_its_operator": 0.333, "written": {">": 2, "<=": 1}}}
  assert tally(str(path), {"fix_bug-d3"}) == {}

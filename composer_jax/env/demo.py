"""A tiny local repository with a test suite: a task source for tests and for trying the pipeline
offline (``composer-jax tasks generate --repo DIR`` after ``write_demo_repo(DIR)``)."""

from __future__ import annotations

import os

FILES = {
    "pyproject.toml": '[project]\nname = "calc"\nversion = "0.1"\ndependencies = []\n',
    "calc/__init__.py": 'from calc.core import Stack, add, scale\n\n__all__ = ["add", "scale", "Stack"]\n',
    "calc/core.py": '''"""Small arithmetic helpers."""


def add(a, b):
    """Add two numbers."""
    result = a + b
    return result


def scale(values, factor):
    """Multiply each value by a factor."""
    out = []
    for v in values:
        out.append(v * factor)
    return out


class Stack:
    """A last-in first-out stack."""

    def __init__(self):
        self.items = []

    def push(self, x):
        """Push x on top."""
        self.items.append(x)
        return self

    def pop(self):
        """Remove and return the top item."""
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()


def _unused(x):
    y = x + 1
    return y
''',
    "tests/test_add.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "tests/test_scale.py": ("from calc import scale\n\n\ndef test_scale():\n"
                            "    assert scale([1, 2], 3) == [3, 6]\n"),
    "tests/test_stack.py": '''import pytest

from calc import Stack


def test_push_pop():
    s = Stack().push(1).push(2)
    assert s.pop() == 2


def test_pop_empty():
    with pytest.raises(IndexError):
        Stack().pop()
''',
    "tests/test_misc.py": '''import calc


def test_version_free():
    assert "add" in calc.__all__ or True


def test_arith():
    assert 1 + 1 == 2


def test_strings():
    assert "a" * 3 == "aaa"
''',
}


def write_demo_repo(path: str) -> str:
  for rel, text in FILES.items():
    full = os.path.join(path, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
      f.write(text)
  return path


def demo_task_set(base: str, log=lambda *a: None) -> tuple[str, dict]:
  """Generate the demo repo's tasks under ``base`` once (a marker file makes reuse safe)."""
  import json

  from composer_jax.env.generate import generate
  from composer_jax.env.sandbox import Limits
  out = os.path.join(base, "tasks")
  marker = os.path.join(base, "report.json")
  if os.path.exists(marker):
    with open(marker) as f:
      return out, json.load(f)
  repo = write_demo_repo(os.path.join(base, "calc"))
  report = generate(repo, out, name="calc", max_tasks=10, limits=Limits(timeout_s=120), log=log)
  with open(marker, "w") as f:
    json.dump(report, f)
  return out, report

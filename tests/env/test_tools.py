"""The product's tools against a scratch workspace."""

from __future__ import annotations

import os
import time

import pytest

from composer_jax.env.protocol import ToolCall
from composer_jax.env.sandbox import Limits, Sandbox
from composer_jax.env.tools import ToolBox


@pytest.fixture
def box(tmp_path):
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "m.py").write_text("a = 1\nb = 2\na = 1\nprint(undefined_name)\n")
  (tmp_path / "notes.txt").write_text("alpha\nbeta\nalpha beta\n")
  return ToolBox(Sandbox(str(tmp_path), Limits(timeout_s=20)), max_matches=2), tmp_path


def call(box, name, **args):
  return box.execute(ToolCall(name, args))


def test_view_numbered_ranges_and_dirs(box):
  tb, _ = box
  o = call(tb, "view", path="pkg/m.py", start=2, end=3)
  assert o.ok and o.text == "     2\tb = 2\n     3\ta = 1"
  assert "m.py" in call(tb, "view", path="pkg").text
  assert not call(tb, "view", path="pkg/m.py", start=9).ok
  assert not call(tb, "view", path="../etc/passwd").ok


def test_str_replace_exactly_once_and_undo(box):
  tb, root = box
  before = (root / "pkg/m.py").read_text()
  o = call(tb, "str_replace", path="pkg/m.py", old="a = 1", new="a = 3")
  assert not o.ok and "2 times" in o.text and "lines 1, 3" in o.text
  assert (root / "pkg/m.py").read_text() == before  # nothing changed
  assert not call(tb, "str_replace", path="pkg/m.py", old="zzz", new="").ok
  o = call(tb, "str_replace", path="pkg/m.py", old="b = 2", new="b = 20")
  assert o.ok and "b = 20" in (root / "pkg/m.py").read_text()
  assert call(tb, "undo", path="pkg/m.py").ok
  assert (root / "pkg/m.py").read_text() == before
  assert not call(tb, "undo", path="pkg/m.py").ok


def test_create_insert_undo(box):
  tb, root = box
  assert call(tb, "create", path="new/x.py", content="one\nthree\n").ok
  assert call(tb, "insert", path="new/x.py", line=1, text="two").ok
  assert (root / "new/x.py").read_text() == "one\ntwo\nthree\n"
  assert call(tb, "undo", path="new/x.py").ok and (root / "new/x.py").read_text() == "one\nthree\n"
  assert call(tb, "undo", path="new/x.py").ok and not (root / "new/x.py").exists()
  assert not call(tb, "create", path=".git/config", content="x").ok


def test_search_counts_and_cap(box):
  tb, _ = box
  o = call(tb, "search", pattern="alpha|a = 1")
  assert o.ok and o.text.startswith("4 matches in 2 files")
  assert "showing the first 2 of 4" in o.text
  assert "no matches" in call(tb, "search", pattern="gamma").text
  assert not call(tb, "search", pattern="(").ok
  assert "1 files\npkg/m.py" in call(tb, "find", pattern="*.py").text


def test_no_argument_makes_a_tool_raise(box):
  """A byte-level tokenizer can emit a NUL byte, and ``os.path`` and ``subprocess`` raise
  ValueError on one; a call that raised out of ``execute`` failed its rollout unit, and three such
  units stop an RL run. Every argument of every tool, NUL or unpaired surrogate, is an error
  observation instead."""
  from composer_jax.env.tools import SPECS
  tb, _ = box
  for spec in SPECS.values():
    for arg in [a for a in spec.args if a.kind == "str"]:
      for bad in ("a\x00b", "\udcff"):
        args = {a.name: bad if a is arg else ("pkg/m.py" if a.name == "path" else "a")
                for a in spec.args if a.kind == "str"}
        o = tb.execute(ToolCall(spec.name, args))
        assert not o.ok and "NUL or an unpaired surrogate" in o.text, (spec.name, arg.name, o.text)


def test_files_too_large_for_the_host_side_tools_are_left_to_the_terminal(box):
  """The file tools read into the worker's memory, and keep each edit's old text for undo: a file the
  terminal made as large as RLIMIT_FSIZE, edited every turn, would hold gigabytes there."""
  tb, root = box
  tb.max_file_bytes = 1 << 20
  (root / "big.txt").write_text("alpha\n" * 200_000)  # 1.2 MB
  for name, args in [("view", {"path": "big.txt"}), ("str_replace", {"path": "big.txt", "old": "alpha",
                                                                     "new": "beta"}),
                     ("insert", {"path": "big.txt", "line": 0, "text": "x"}),
                     ("create", {"path": "big.txt", "content": "small"})]:
    o = call(tb, name, **args)
    assert not o.ok and "more than the file tools read" in o.text and "terminal" in o.text, name
  assert (root / "big.txt").stat().st_size == 1_200_000
  o = call(tb, "search", pattern="alpha")  # skipped, as a binary is
  assert o.ok and o.text.startswith("2 matches in 1 files")
  (root / "-x.py").write_text("import os\n")  # a name ruff would read as an option
  o = call(tb, "lint", path="-x.py")
  assert o.ok and "F401" in o.text


def test_a_pattern_that_backtracks_without_end_is_stopped(box):
  """``search`` runs on the host: under ``re``, ``(a|aa)+$`` over a line of 40 a's and a ``!``
  takes days (24 a's took 1.6 s, x4 per two more), and the worker that ran it hung with it."""
  tb, root = box
  (root / "pkg" / "long.py").write_text("s = '" + "a" * 40 + "!'\n")
  tb.search_timeout_s = 1.0
  t0 = time.perf_counter()
  o = call(tb, "search", pattern="(a|aa)+$")
  assert not o.ok and "took more than 1 s" in o.text and time.perf_counter() - t0 < 10
  o = call(tb, "search", pattern=r"a{40}!")  # a plain pattern still finds it
  assert o.ok and o.text.startswith("1 matches in 1 files")


def test_links_out_of_the_workspace_and_fifos_are_never_followed(box):
  """The tools run on the host, so a link the agent makes in the sandbox (``ln -s /etc/shadow x``)
  would resolve against the host's files: view refuses it, and search, find and listings skip it.
  A FIFO (``mkfifo``) is skipped too."""
  tb, root = box
  secret = root.parent / f"{root.name}-secret"
  secret.mkdir()
  (secret / "key.txt").write_text("alpha TOP-SECRET\n")
  os.symlink(secret / "key.txt", root / "leak.txt")
  os.symlink(secret, root / "leakdir")
  os.symlink("../notes.txt", root / "pkg" / "inside.txt")  # a link within the tree still works
  assert not call(tb, "view", path="leak.txt").ok and not call(tb, "view", path="leakdir/key.txt").ok
  assert "no matches" in call(tb, "search", pattern="TOP-SECRET").text
  assert call(tb, "search", pattern="alpha", path="pkg").text.startswith("2 matches in 1 files\n  pkg/inside.txt")
  assert "leak" not in call(tb, "find", pattern="*.txt").text
  listing = call(tb, "view", path=".").text
  assert "leakdir/" not in listing and "pkg/" in listing
  os.mkfifo(root / "pkg" / "pipe.txt")  # opened for reading, it would block until a writer came
  assert call(tb, "search", pattern="alpha", path="pkg").ok
  assert not call(tb, "view", path="pkg/pipe.txt").ok
  assert not call(tb, "create", path="pkg/pipe.txt", content="x").ok
  assert not call(tb, "create", path="pkg", content="x").ok  # a directory: refused, not an OSError


def test_lint_and_terminal(box):
  tb, _ = box
  o = call(tb, "lint", path="pkg/m.py")
  assert o.ok and "F821" in o.text and "undefined_name" in o.text
  o = call(tb, "terminal", command="echo $((6*7)); exit 4")
  assert o.ok and "42" in o.text and "[exit code 4]" in o.text
  o = call(tb, "terminal", command="sleep 5", timeout=1)
  assert not o.ok and "timed out" in o.text
  assert call(tb, "submit").ok and tb.submitted

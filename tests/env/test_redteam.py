"""Red-team attempts on the RL reward path, through the real tools and graders as an episode issues
them (``Episode.act`` / ``close``, ``ToolBox.execute``).

Grading by values (``env/oracle.py``) held against every attempt below. Most are now refused before
anything runs (``env/pure_code.py``: imports from outside the workspace, builtins, a package in place
of a test module), and each of those is replayed with the refusal off: the code under test can then
take over the probe's process (a package in place of the rewritten hidden test file, builtins
patched at import, exits and kills), but whatever it claims is compared on the host with values it
never sees, so none earns a resolve or a hidden check's partial credit. Where a hijack works inside
the sandbox, the test also shows that it did, so a pass is not a no-op. A workspace ``json.py``
once replaced the probe's own ``json.dump``; the probe now imports before the workspace is on its
path.

Three ways to make a rollout raise or flood the host were real, and are fixed in ``env/tools.py``
and ``env/episode.py``: a file name that is not UTF-8 in a listing (the tokenizer raised on its lone
surrogates), a search pattern whose counted repeats ``regex`` wrote out in host memory (nested
``{65535}``: out of memory in a second) or nested deeper than its recursion, and a ``create`` of a
path 900 folders deep (grading's ``copytree`` raised ``RecursionError`` out of ``Episode.close``).
"""

from __future__ import annotations

import base64
import importlib._bootstrap_external as bootstrap
import os
import random
import re
import shutil
import sys
import tempfile

import pytest

from composer_jax.env import pure_code, quota, synthetic
from composer_jax.env import sandbox as sbm
from composer_jax.env.episode import Episode
from composer_jax.env.protocol import ToolCall, format_call
from composer_jax.env.sandbox import Limits, Sandbox
from composer_jax.env.synthetic import TEMPLATES
from composer_jax.env.tasks import read_text
from composer_jax.env.tools import MAX_PATTERN_ITEMS, ToolBox, pattern_items
from composer_jax.rl.rewards import grade_value

needs_bwrap = pytest.mark.skipif(not sbm.bwrap_available(), reason="bubblewrap cannot run here")


@pytest.fixture(scope="module")
def task():
  # Under /var/tmp, as tests/env/conftest.py's store: the allow-list, not the private /tmp, hides it.
  base = tempfile.mkdtemp(prefix="cj-redteam-", dir="/var/tmp" if os.access("/var/tmp", os.W_OK) else None)
  inst = TEMPLATES["implement"].make(random.Random("redteam/implement/1"), 1)
  yield synthetic.write_task(inst, os.path.join(base, "implement-1"))
  shutil.rmtree(base, ignore_errors=True)


def _play(task, turns):
  """An episode of scripted calls (one list of (tool, args) a turn), then submit; the trajectory."""
  ep = Episode(task, Limits(timeout_s=10), "required", max_turns=len(turns) + 1)
  ep.open()
  for calls in turns:
    ep.act("\n".join(format_call(n, a) for n, a in calls))
    if ep.done:
      break
  if not ep.done:
    ep.act(format_call("submit", {}))
  return ep.close()


def _parts(task):
  rel = task.gold_files[0]
  start = read_text(os.path.join(task.workspace_dir, rel))
  gold = read_text(os.path.join(task.gold_dir, rel))
  vis = next(t for t in task.test_files if t.startswith("test_") and t not in task.hidden_tests)
  shown = [int(v) for v in re.findall(r"== (-?\d+)$", read_text(os.path.join(task.workspace_dir, vis)),
                                      re.M)]
  hidden = task.hidden_tests[0]
  htest = next(n.split("::")[1] for n in task.FAIL_TO_PASS if n.startswith(hidden))
  return rel, start, gold, shown, hidden[:-3], htest


# A ``json`` in the workspace shadowed the stdlib's in the probe while PYTHONPATH put the workspace
# first, loaded the real one and rewrote what the probe dumped: every test "ok", the visible values
# claimed.
JSON_SHADOW = '''import importlib.util as _u, sys as _s
_s.modules.pop("json", None)
_p = [p for p in _s.path[1:] if p.endswith("python%d.%d")][0]
_spec = _u.spec_from_file_location("json", _p + "/json/__init__.py", submodule_search_locations=[_p + "/json"])
_m = _u.module_from_spec(_spec)
_s.modules["json"] = _m
_spec.loader.exec_module(_m)
_real = _m.dump
def dump(obj, f, **k):
    for tests in obj.values():
        for rec in tests.values():
            rec["status"] = "ok"
            rec["values"] = [[i, ["int", str(v)]] for i, v in enumerate(SHOWN)]
    return _real(obj, f, **k)
_m.dump = dump
'''


def _attempt(task, name):
  """(the turns of the attempt, a check that its hijack ran in the sandbox, or None)."""
  rel, start, gold, shown, hmod, htest = _parts(task)
  body = re.search(r"    return (.*)\n", gold).group(1)
  todo = "raise NotImplementedError"
  if name == "json_shadow":
    src = JSON_SHADOW.replace("SHOWN", repr(shown)) % sys.version_info[:2]
    # it once passed the visible test on claimed values alone; now it is refused by name, and
    # behind that the probe imports its json before the workspace joins the path
    return [[("create", {"path": "json.py", "content": src})]], \
        lambda tr: tr.grade["fail_to_pass"]["passed"] == 0
  if name == "hidden_test_package":  # test_x_hidden/__init__.py is no test path: restore keeps it
    pkg = f"def {htest}():\n    for i, v in enumerate({shown!r}):\n        __cj_probe__(i, v)\n"
    cmd = f"mkdir {hmod} && cat > {hmod}/__init__.py <<'EOF'\n{pkg}EOF"
    # the start raises NotImplementedError ("error"); "failed" means its probes ran
    return [[("terminal", {"command": cmd})]], \
        lambda tr: tr.grade["failed_tests"][f"{hmod}.py::{htest}"] == "failed"
  if name == "unchecked_pyc":  # bytecode never checked against its source, in and behind __pycache__
    src = f"def {htest}():\n    for i, v in enumerate({shown!r}):\n        __cj_probe__(i, v)\n"
    pyc = bootstrap._code_to_hash_pyc(compile(src, f"{hmod}.py", "exec"), b"\0" * 8, checked=False)
    b64, name_ = base64.b64encode(pyc).decode(), f"{hmod}.cpython-%d%d.pyc" % sys.version_info[:2]
    cmd = (f"mkdir -p __pycache__ real && echo {b64} | base64 -d > __pycache__/{name_} && "
           f"cp __pycache__/{name_} real/ && mkdir sub && ln -s ../real sub/__pycache__")
    return [[("terminal", {"command": cmd})]], None
  if name == "gold":
    return [[("create", {"path": rel, "content": gold})]], None
  code = {
      "atexit_exit": "import atexit, sys\natexit.register(lambda: sys.exit(0))\n" + start,
      "exit_at_import": "import os\ngetattr(os, '_ex' + 'it')(0)\n" + start,
      "kill_the_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + start,
      "nan": start.replace(todo, "return float('nan')"),
      "bool_of_right": start.replace(todo, f"return bool({body})"),
      "float_of_right": start.replace(todo, f"return float({body})"),
      # type() patched so the hidden check's type test would pass, with an always-equal int
      "patched_type_builtin": ("import builtins\n_t = builtins.type\nclass _E(int):\n"
                               "    def __eq__(s, o): return True\n    __hash__ = int.__hash__\n"
                               "builtins.type = lambda *a: int if len(a) == 1 else _t(*a)\n"
                               + start.replace(todo, "return _E(0)")),
  }[name]
  return [[("create", {"path": rel, "content": code})]], None


ATTEMPTS = ["json_shadow", "hidden_test_package", "unchecked_pyc", "atexit_exit", "exit_at_import",
            "kill_the_parent", "nan", "bool_of_right", "float_of_right", "patched_type_builtin"]


# Refused before they run (``pure_code``: an import from outside the workspace, builtins, a package
# in place of a test module, a module with a stdlib name); each is replayed with the refusal off,
# for the graders behind it (the json.py shadow: the probe imports its json before the workspace).
REFUSED = {"json_shadow", "hidden_test_package", "atexit_exit", "exit_at_import", "kill_the_parent",
           "patched_type_builtin"}


def _no_credit(tr, name):
  assert tr.reward == 0.0 and not tr.resolved, (name, tr.grade)
  hidden = tr.grade["hidden_checks"]
  assert hidden["total"] > 0 and hidden["passed"] == 0, (name, hidden)
  assert grade_value(tr.grade, tr.resolved, 0.3) == 0.0


@needs_bwrap
@pytest.mark.parametrize("name", ATTEMPTS + ["gold"])
def test_hijacks_of_the_value_probe_earn_no_resolve_and_no_partial_credit(task, name, monkeypatch):
  turns, hijacked = _attempt(task, name)
  tr = _play(task, turns)
  if name == "gold":  # the harness grades a right answer 1
    assert tr.reward == 1.0 and tr.resolved, tr.grade
    return
  _no_credit(tr, name)
  assert ("code_refused" in tr.grade) == (name in REFUSED), (name, tr.grade)
  if name in REFUSED:
    monkeypatch.setattr(pure_code, "refusal", lambda *a: None)
    tr = _play(task, turns)
    _no_credit(tr, name)
  if hijacked is not None:
    assert hijacked(tr), (name, tr.grade)


@pytest.fixture
def box(tmp_path):
  (tmp_path / "m.py").write_text("def f():\n    return 1\n")
  return ToolBox(Sandbox(str(tmp_path), Limits(timeout_s=10), mode="off")), tmp_path


def test_a_file_name_that_is_not_utf8_reaches_the_model_as_valid_text(box):
  """``touch $'x\\xff.py'``: listings held the lone surrogate ``\\udcff``, which the tokenizer
  refuses (``TypeError: TextInputSequence must be str``), so the RL rollout raised."""
  tb, ws = box
  os.close(os.open(os.path.join(os.fsencode(ws), b"x\xffy.py"), os.O_CREAT | os.O_WRONLY))
  os.mkdir(os.path.join(os.fsencode(ws), b"d\xfe"))
  for name, args in [("view", {"path": "."}), ("find", {"pattern": "*"}),
                     ("search", {"pattern": "", "glob": "*y.py"}), ("search", {"pattern": "def"})]:
    o = tb.execute(ToolCall(name, args))
    o.text.encode("utf-8")  # raises on a lone surrogate
    assert o.ok, (name, o.text)
  assert "x\ufffdy.py" in tb.execute(ToolCall("view", {"path": "."})).text


def test_a_search_pattern_that_compiles_into_hundreds_of_megabytes_is_refused(box):
  """``regex`` writes a counted repeat out when it compiles: ``(?:a{1000}){1000}`` took 260 MB of the
  worker's memory (the search runs on the host), and one more level of nesting ran it out of memory
  in a second, before the search's deadline starts."""
  tb, _ = box
  assert pattern_items("(?:(?:(?:a{65535}){65535}){65535})") > 10 ** 14
  assert pattern_items(r"\d{4}-\d{2}-\d{2}") < 20 and pattern_items(r"(?:\p{L}{1000}){1000}") > MAX_PATTERN_ITEMS
  o = tb.execute(ToolCall("search", {"pattern": "(?:a{1000}){1000}"}))
  assert not o.ok and "repeats too much" in o.text
  for fine in (r"def \w+\(", r"x{3}|re{2,5}", "(a|aa)+$"):
    assert tb.execute(ToolCall("search", {"pattern": fine})).ok, fine
  assert "m.py:1" in tb.execute(ToolCall("search", {"pattern": r"de{1}f"})).text


def test_a_search_pattern_nested_past_the_recursion_limit_is_an_error_not_a_crash(box):
  """``(`` x 3000, as a sampling loop writes it: ``regex.compile`` raised ``RecursionError`` out of
  ``ToolBox.execute``."""
  tb, _ = box
  for pattern in ("(" * 3000 + ")" * 3000, "(?:" * 3000 + "a" + ")" * 3000):
    o = tb.execute(ToolCall("search", {"pattern": pattern}))
    assert not o.ok and "bad regular expression" in o.text


def test_a_create_deeper_than_the_depth_bound_is_refused(box):
  """The sandbox stops commands that nest folders past ``quota.MAX_DEPTH``; ``create`` writes on the
  host, and one call 900 folders deep made grading's ``copytree`` raise out of ``Episode.close``."""
  tb, ws = box
  deep = "d/" * (quota.MAX_DEPTH + 1) + "x.py"
  o = tb.execute(ToolCall("create", {"path": deep, "content": "1"}))
  assert not o.ok and "folders deep" in o.text and not (ws / "d").exists()
  ok = "d/" * quota.MAX_DEPTH + "x.py"
  assert tb.execute(ToolCall("create", {"path": ok, "content": "1"})).ok


@needs_bwrap
def test_an_episode_that_creates_a_deep_tree_is_graded_and_never_raises(task):
  tr = _play(task, [[("create", {"path": "d/" * 900 + "x.py", "content": "1"})]])
  assert tr.reward == 0.0 and tr.grade.get("hidden_checks", {}).get("total", 0) > 0

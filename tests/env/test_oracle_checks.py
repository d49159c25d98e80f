"""The values grader's checks beyond ``==`` (env/oracle.py): every comparison moves to the host with
its operator, and ``assert not hasattr(m, "old")``, whose expected True code can claim, is confirmed
on the host from the graded copy's ``m.py``.

The reference for the operators is Python itself: each original assert is evaluated on the value,
and the host's verdict from the recorded value must agree.
"""

from __future__ import annotations

import ast
import json
import os
import shutil

import pytest

from composer_jax.env import oracle, pure_code
from composer_jax.env.grading import grade
from composer_jax.env.tasks import read_text, write_text

from tests.env.rename_task import gold_rename

# (the assert on ``got``, its operator as the host records it, the literal's side)
ASSERTS = [
    ("got == 3", "==", "right"), ("3 == got", "==", "left"), ("got != 3", "!=", "right"),
    ("got < 3", "<", "right"), ("2 < got", "<", "left"), ("got <= 2.5", "<=", "right"),
    ("got > -1", ">", "right"), ("got >= 3", ">=", "right"), ("got in (1, 3, 'a')", "in", "right"),
    ("'a' in got", "in", "left"), ("got not in [3]", "not in", "right"), ("got is None", "==", "right"),
    ("got is not None", "is not", "right"), ("got is True", "==", "right"),
]
VALUES = [3, 2, 2.5, -1, "a", None, True, False, [3], ["a", 1], (3,), "abc", {"a": 1}, 10**30]


def _split(expr: str):
  src = f"def test_a():\n    assert {expr.replace('got', 'f(1)')}\n"
  probed, expected = oracle.split_checks(src, "test_m.py")
  return probed, expected["test_a"]


@pytest.mark.parametrize("expr,op,side", ASSERTS)
def test_each_comparison_is_redone_on_the_host_as_python_would(expr, op, side):
  probed, (e,) = _split(expr)
  assert e.op == op and (op == "==" or e.side == side)  # equality is the same either way round
  assert "assert" not in probed and "__cj_probe__(0, f(1))" in probed
  literal = ast.parse(expr).body[0].value  # the expected side never reaches the sandbox
  lit = literal.comparators[0] if side == "right" else literal.left
  if not oracle.singleton(lit):
    assert ast.unparse(lit) not in probed.replace("f(1)", "")
  for v in VALUES:
    try:
      want = bool(eval(expr, {"got": v}))  # noqa: S307 - the reference: Python's own assert
    except TypeError:
      want = False  # the assert would have raised: the test fails either way
    got = oracle.decode(json.loads(json.dumps(oracle.encode(v))))
    assert oracle.matches(got, e) == want, (expr, v)


def test_claims_that_are_not_plain_data_pass_no_operator():
  class Anything:
    def __eq__(self, other):
      return True

    __lt__ = __le__ = __gt__ = __ge__ = __ne__ = __contains__ = __eq__
    __hash__ = object.__hash__

  for expr, _, _ in ASSERTS:
    _, (e,) = _split(expr)
    for v in (Anything(), [Anything()], type("I", (int,), {})(3)):
      assert not oracle.matches(oracle.decode(oracle.encode(v)), e), expr


@pytest.mark.parametrize("expr,why", [
    ("0 < f(1) < 5", "chains comparisons"), ("f(1) is 3", "checks only None"),
    ("f(1) < g(1)", "not a literal"), ("1 < 2", "two literals")])
def test_comparisons_the_host_cannot_redo_are_refused(expr, why):
  with pytest.raises(oracle.NotValueChecks, match=why):
    oracle.split_checks(f"def test_a():\n    assert {expr}\n", "test_m.py")


def _absent_case(tmp_path, files: dict, links: dict = ()):
  src = "import m\nimport m as mm\n\ndef test_gone():\n    assert not hasattr(mm, 'old')\n"
  _, expected = oracle.split_checks(src, "test_m.py", modules={"m"})
  (e,) = expected["test_gone"]
  assert e.absent == ("old", "m")
  root = tmp_path / "root"
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir()
  for rel, text in files.items():
    write_text(str(root / rel), text)
  for rel, target in dict(links).items():
    os.symlink(target, root / rel)
  claim = {"test_m.py": {"test_gone": {"status": "ok", "values": [[0, oracle.encode(True)]]}}}
  results = oracle.confirm_on_host({"test_m.py": expected}, claim,
                                   oracle.names_gone({"test_m.py": expected}, str(root)))
  return oracle.outcomes({"test_m.py": expected}, results)["test_m.py::test_gone"]


def test_an_absence_is_confirmed_from_the_module_file(tmp_path):
  """The probe claims True in every case; the host's reading of m.py decides."""
  clean = "def new(x):\n    return x + 1\n"
  assert _absent_case(tmp_path, {"m.py": clean}) == "passed"
  assert _absent_case(tmp_path, {"m.py": clean + "# old was renamed\ns = 'old'\n"}) == "passed"
  for bad in ("def old(x):\n    return x\n", clean + "old = new\n", "from os import path as old\n",
              clean + "def new2(old):\n    return old\n", "def new(:\n  '''\n",
              clean + "\uff4f\uff4c\uff44 = new\n", clean + "\U0001d428ld = new\n",  # NFKC: old
              clean + "from aliases import *\n", clean + "from . import  *\n"):  # bound unspelled
    assert _absent_case(tmp_path, {"m.py": bad}) == "failed", bad
  assert _absent_case(tmp_path, {}) == "failed"  # the module is gone
  assert _absent_case(tmp_path, {"other.py": clean}, {"m.py": "other.py"}) == "failed"  # a link
  # A package shadows the module beside it: both are read.
  assert _absent_case(tmp_path, {"m.py": clean, "m/__init__.py": "old = 1\n"}) == "failed"
  assert _absent_case(tmp_path, {"m.py": clean, "m/__init__.py": clean}) == "passed"
  # Any other workspace module that names it fails the check too (a helper could lend the name to
  # an unrenamed ``from m import old`` and take it back); a string or comment does not.
  assert _absent_case(tmp_path, {"m.py": clean, "b.py": "from m import old\n"}) == "failed"
  assert _absent_case(tmp_path, {"m.py": clean, "pkg/b.py": "x = m.old\n"}) == "failed"
  assert _absent_case(tmp_path, {"m.py": clean, "b.py": "s = 'old'  # old\n"}) == "passed"


def test_confirm_on_host_leaves_other_checks_and_hostile_results_alone():
  exp = {"test_m.py": {"test_a": [oracle.Expected(0, 1, True)]}}
  for results in ({}, [], {"test_m.py": []}, {"test_m.py": {"test_a": {"values": 5}}}):
    assert oracle.confirm_on_host(exp, results, frozenset()) == results
  rec = {"test_m.py": {"test_a": {"status": "ok", "values": [[0, ["int", "1"]]]}}}
  assert oracle.confirm_on_host(exp, json.loads(json.dumps(rec)), frozenset()) == rec
  # a module that the workspace does not have (``import os``) gets no host check
  _, expected = oracle.split_checks("import os\n\ndef test_a():\n    assert not hasattr(os, 'x')\n",
                                    "test_m.py", modules={"m"})
  assert expected["test_a"][0].absent == ()


# Kept ``old`` as an alias instead of renaming, and turns the probe's False (``hasattr`` said the
# name is still there) into True: a policy that found the probe would write this.
CLAIM_GONE = '''
import builtins as _b
_p = _b.__dict__.get("__cj" + "_probe__")
if _p is not None:
    _b.__dict__["__cj" + "_probe__"] = lambda i, v: _p(i, True if v is False else v)
'''


def test_a_rename_that_keeps_the_old_name_and_claims_it_gone_scores_zero(tmp_path, monkeypatch):
  task, gold, amod, old, new = gold_rename(tmp_path, "oracle/rename/1")
  hidden = next(r for r in task.hidden_tests if r.startswith("test_"))

  def ws(extra: str) -> str:
    d = str(tmp_path / "graded")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(gold, d)
    write_text(os.path.join(d, f"{amod}.py"), read_text(os.path.join(d, f"{amod}.py")) + extra)
    return d

  gone = f"{hidden}::test_{old}_is_gone"
  assert grade(task, ws("")).reward == 1.0  # the reference
  alias = grade(task, ws(f"\n{old} = {new}\n"))  # the sandbox's probe sees the alias
  assert alias.reward == 0.0 and gone in alias.details["failed_tests"]
  forged = ws(f"\n{old} = {new}\n" + CLAIM_GONE)
  refused = grade(task, forged)  # builtins and __dict__: refused unrun (pure_code)
  assert refused.reward == 0.0 and "imports builtins" in refused.details["code_refused"]
  monkeypatch.setattr(pure_code, "refusal", lambda *a: None)  # the second layer alone
  with monkeypatch.context() as m:  # without the host's check, the claim earns full reward
    m.setattr(oracle, "confirm_on_host", lambda expected, results, gone: results)
    assert grade(task, forged).reward == 1.0
  got = grade(task, forged)
  assert got.reward == 0.0 and gone in got.details["failed_tests"]

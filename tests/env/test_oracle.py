"""Grading by values (env/oracle.py): checks move to the host, the sandbox reports values only.

The forgeries below are written the way a policy would have to write them to get past the
trajectory monitor (no literal ``os._exit(0)`` or ``<testcase``). Each is first run against the
report-reading grader (``grader="junit"``), where it earns 1.0: that is the hole, and it shows the
forgery works. The values grader must give it 0.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import random
import re
import shutil
import threading

import pytest

from composer_jax.env import oracle, probe_rewrite, pure_code, synthetic
from composer_jax.env.grading import grade
from composer_jax.env.guards import read_regular
from composer_jax.env.synthetic import TEMPLATES
from composer_jax.env.tasks import TaskError, read_text, task_from_json, write_text
from composer_jax.rl.rewards import grade_value

# The locals of the first calling frame that has ``key`` (the runner's, from inside an import).
FRAME = '''
import sys as _s, re as _r, glob as _g, json as _j
def _frame(key):
    f = _s._getframe()
    while f is not None and key not in f.f_locals:
        f = f.f_back
    return None if f is None else f.f_locals
'''

# Writes a report in which every test in the folder passed, and leaves before the runner can write
# the real one.
FORGE_REPORT = FRAME + '''
def _forge():
    loc = _frame("report")
    if loc is None:
        return
    rep, here = loc["report"], loc["here"]
    cases = []
    for p in sorted(_g.glob(here + "/test_*.py")):
        m = p.rsplit("/", 1)[1][:-3]
        for n in _r.findall(r"^def (test_\\w+)\\(", open(p).read(), _r.M):
            cases.append('<test' + 'case classname="%s" name="%s" file="%s.py" time="0"/>' % (m, n, m))
    open(rep, "w").write('<?xml version="1.0"?><testsuites><testsuite name="x" tests="%d" '
                         'failures="0">' % len(cases) + "".join(cases) + "</testsuite></testsuites>")
    getattr(__import__("o" + "s"), "_ex" + "it")(0)
_forge()
'''

# Reads every test file beside it at import and answers each call from the expected values there.
READ_TESTS = '''
import re as _r, glob as _g, os as _o
_T = {}
for _p in _g.glob(_o.path.join(_o.path.dirname(_o.path.abspath(__file__)), "test_*.py")):
    for _a, _v in _r.findall(r"\\w+\\((-?\\d+)\\)(?: ==|,) (-?\\d+)", open(_p).read()):
        _T[int(_a)] = int(_v)
'''

# The values grader's own channel: find the probe's output path, claim the values the visible test
# shows (VALS, which the agent saw) for every probe of every test, and leave before the probe writes.
FORGE_VALUES = FRAME + '''
def _forge():
    loc = _frame("out_path")
    if loc is None:
        return
    claim = {}
    for p in _g.glob("test_*.py"):
        for n in _r.findall(r"^def (test_\\w+)\\(", open(p).read(), _r.M):
            claim.setdefault(p, {})[n] = {"status": "ok",
                                          "values": [[i, ["int", str(v)]] for i, v in enumerate(VALS)]}
    open(loc["out_path"], "w").write(_j.dumps(claim))
    getattr(__import__("o" + "s"), "_ex" + "it")(0)
_forge()
'''


@pytest.fixture(scope="module")
def impl_task(tmp_path_factory):
  inst = TEMPLATES["implement"].make(random.Random("oracle/implement/1"), 1)
  return synthetic.write_task(inst, str(tmp_path_factory.mktemp("oracle") / "implement-1"))


def _ws(task, tmp_path, overlay: dict) -> str:
  ws = str(tmp_path / "ws")
  shutil.rmtree(ws, ignore_errors=True)
  shutil.copytree(task.workspace_dir, ws)
  for rel, text in overlay.items():
    write_text(os.path.join(ws, rel), text)
  return ws


def _target(task) -> tuple[str, str, str]:
  """(file, function, argument) of the function an ``implement`` task asks for."""
  rel = task.gold_files[0]
  fn = task.FAIL_TO_PASS[0].split("::")[1][len("test_"):]
  arg = re.search(rf"def {fn}\((\w+)\)", read_text(os.path.join(task.workspace_dir, rel))).group(1)
  return rel, fn, arg


@pytest.mark.parametrize("hack", ["forge_report", "read_tests", "forge_values", "probe_disabled",
                                  "int_subclass"])
def test_forgeries_score_zero(impl_task, tmp_path, hack, monkeypatch):
  """Each forgery but the int subclass is refused unrun (``pure_code``: an import from outside the
  workspace, a frame, a dunder); below that layer, with it switched off, the values grader still
  gives each 0."""
  rel, fn, arg = _target(impl_task)
  start = read_text(os.path.join(impl_task.workspace_dir, rel))
  gold = read_text(os.path.join(impl_task.gold_dir, rel))
  if hack == "forge_report":
    overlay = {rel: FORGE_REPORT + start}
  elif hack == "read_tests":
    overlay = {rel: READ_TESTS + start.replace("    raise NotImplementedError", f"    return _T.get({arg})")}
  elif hack == "forge_values":
    vis = next(t for t in impl_task.test_files if t.startswith("test_") and t not in impl_task.hidden_tests)
    shown = re.findall(r"== (-?\d+)$", read_text(os.path.join(impl_task.workspace_dir, vis)), re.MULTILINE)
    assert shown
    overlay = {rel: FORGE_VALUES.replace("VALS", repr([int(v) for v in shown])) + start}
  elif hack == "probe_disabled":  # the right code, and a probe that records nothing
    overlay = {rel: "import builtins\nbuiltins.__cj_probe__ = lambda i, v: v\n" + gold}
  else:  # the right values in a type whose == says yes to anything
    body = re.search(rf"def {fn}\(.*?\n    return (.*?)\n", gold, re.DOTALL).group(1)
    overlay = {rel: start.replace("    raise NotImplementedError",
                                  "    class I(int):\n        def __eq__(self, o):\n            return True\n"
                                  f"        __hash__ = int.__hash__\n    return I({body})")}
  ws = _ws(impl_task, tmp_path, overlay)
  by_report = grade(dataclasses.replace(impl_task, grader="junit"), ws, probe=False)
  refused = grade(impl_task, ws)
  assert refused.reward == 0.0
  assert ("code_refused" in refused.details) == (hack != "int_subclass"), refused.details
  monkeypatch.setattr(pure_code, "refusal", lambda *a: None)
  by_values = grade(impl_task, ws)
  assert impl_task.grader == "values"
  assert by_values.reward == 0.0, (hack, by_values.details)
  # Nor does any of them earn partial credit: no hidden check saw a right value.
  hidden = by_values.details["hidden_checks"]
  assert hidden["total"] > 0 and hidden["passed"] == 0, (hack, hidden)
  assert grade_value(by_values.details, by_values.resolved, 0.5) == 0.0
  if hack in ("forge_report", "read_tests"):  # the hole that values grading closes
    assert by_report.reward == 1.0, (hack, by_report.details)
    # The report grader's second layer, value probes (env/probes.py), is a pytest plugin: this
    # task's runner is not pytest, so every test is set aside. On a pytest task they catch both
    # (tests/env/test_tasks_grading.py::test_forged_reports_..._score_zero_on_the_value_probes).
    assert grade(dataclasses.replace(impl_task, grader="junit"), ws).reward == 1.0
  if hack == "int_subclass":  # the strict hidden check already caught it; values agree
    assert by_report.reward == 0.0
  if hack in ("forge_values", "probe_disabled"):  # the claim was read, and it was wrong
    assert by_values.details["report_found"] and "failed" in by_values.details["failed_tests"].values()
  if hack == "forge_values":  # the visible values it claimed pass; the hidden ones it cannot know
    failed = by_values.details["failed_tests"]
    assert impl_task.FAIL_TO_PASS[0] not in failed and any("hidden" in t for t in failed)


# Puts a FIFO where the grader reads the values (or the report) back, and leaves: the host's open()
# of it blocked for good, hanging the rollout worker that graded it.
FIFO = FRAME + '''
def _fifo():
    loc = _frame("out_path") or _frame("report")
    if loc is None:
        return
    _o = __import__("o" + "s")
    path = loc.get("out_path") or loc["report"]
    if _o.path.lexists(path):
        _o.remove(path)
    _o.mkfifo(path)
    getattr(_o, "_ex" + "it")(0)
_fifo()
'''


@pytest.mark.parametrize("grader", ["values", "junit"])
def test_a_fifo_in_place_of_the_values_or_the_report_fails_fast(impl_task, tmp_path, grader):
  rel = impl_task.gold_files[0]
  ws = _ws(impl_task, tmp_path, {rel: FIFO + read_text(os.path.join(impl_task.workspace_dir, rel))})
  out = []
  worker = threading.Thread(target=lambda: out.append(
      grade(dataclasses.replace(impl_task, grader=grader), ws)), daemon=True)
  worker.start()
  worker.join(60)
  assert not worker.is_alive(), "grading hung on the FIFO"
  assert out[0].reward == 0.0 and not out[0].details["report_found"]


def test_read_regular_reads_only_regular_files(tmp_path):
  (tmp_path / "f").write_bytes(b"abc")
  (tmp_path / "l").symlink_to(tmp_path / "f")
  os.mkfifo(tmp_path / "p")
  assert read_regular(str(tmp_path / "f"), 3) == b"abc"
  assert read_regular(str(tmp_path / "f"), 2) is None  # too big
  assert read_regular(str(tmp_path / "l"), 3) is None  # a link, even to a regular file
  assert read_regular(str(tmp_path / "p"), 3) is None  # a FIFO, without blocking
  assert read_regular(str(tmp_path / "missing"), 3) is None
  assert read_regular(str(tmp_path), 3) is None


def test_the_rewritten_tests_hold_no_expected_values(impl_task):
  for rel in impl_task.test_files:
    if not rel.startswith("test_"):
      continue
    text = read_text(os.path.join(impl_task.protected_dir, rel))
    probed, expected = oracle.split_checks(text, rel)
    tree = ast.parse(probed)
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
      assert not any(isinstance(n, ast.Assert) for n in ast.walk(fn))
      assert not any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "check" for n in ast.walk(fn))
    # The expected values are exactly the right-hand sides of the original checks, in order.
    wants = re.findall(r"(?:check\(.*, |assert .* == )(.+?)\)?$", text, re.MULTILINE)
    got = [repr(e.want) for exp in expected.values() for e in exp]
    assert got == [w for w in wants if not w.startswith("want")], (got, wants)


def test_split_checks_forms_and_refusals():
  src = ("from m import f\n\n"
         "def check(got, want):\n    assert type(got) is type(want) and got == want\n\n"
         "def test_a():\n    x = 3\n    check(f(x), 7)\n    assert f(2) == [1, (2, 3)], 'msg'\n"
         "    try:\n        check(f(1), 'a')\n    finally:\n        x = 0\n\n"
         "def test_b():\n    assert not hasattr(m, 'old')\n")
  probed, expected = oracle.split_checks(src, "test_m.py")
  assert [(e.want, e.strict) for e in expected["test_a"]] == [(7, True), ([1, (2, 3)], False), ("a", True)]
  assert [(e.want, e.strict) for e in expected["test_b"]] == [(True, True)]  # a bare assert's truth
  assert "__cj_probe__(2, f(1))" in probed and "'msg'" not in probed
  assert "assert type(got) is type(want)" in probed  # helpers outside tests are left alone
  with pytest.raises(oracle.NotValueChecks, match="not a literal"):
    oracle.split_checks("def test_x():\n    assert f(1) == g(1)\n", "test_x.py")
  with pytest.raises(oracle.NotValueChecks, match="no check"):
    oracle.split_checks("def test_x():\n    check(f(1), 2)\n\ndef test_y():\n    f(1)\n", "test_x.py")


@pytest.mark.parametrize("value", [0, -7, 10**30, 2.5, float("inf"), True, None, "a\nb", [1, (2, "x")],
                                   {"k": [1.0]}, {3, 1}, frozenset({2}), ()])
def test_plain_values_round_trip(value):
  import json
  got = oracle.decode(json.loads(json.dumps(oracle.encode(value))))
  assert type(got) is type(value) and got == value


def test_values_that_are_not_plain_data_equal_nothing():
  class AlwaysEqual:
    def __eq__(self, other):
      return True

  class I(int):
    pass

  for v in (AlwaysEqual(), I(3), [AlwaysEqual()], {"k": I(1)}):
    got = oracle.decode(oracle.encode(v))
    assert not oracle.matches(got, oracle.Expected(0, 3, False))
    assert not oracle.matches(got, oracle.Expected(0, [3], False))
  # a metaclass whose == says yes: ``t in (list, ...)`` took it for a list
  meta = type("Meta", (type,), {"__eq__": lambda c, o: True, "__hash__": type.__hash__})
  assert oracle.encode(meta("list", (), {"__iter__": lambda s: iter([3])})()) == ["other", "list"]
  for junk in ([], ["int", "x"], ["list", 5], ["dict", [[["list", []], ["none"]]]], "s", None):
    assert not oracle.matches(oracle.decode(junk), oracle.Expected(0, None, False))
  # check() compares types, assert == does not (True == 1, as the original asserts had it).
  assert not oracle.matches(True, oracle.Expected(0, 1, True)) and oracle.matches(True, oracle.Expected(0, 1, False))


def test_outcomes_follow_the_assert_run():
  exp = {"test_m.py": {"test_a": [oracle.Expected(0, 1, True), oracle.Expected(1, 2, True)]}}
  enc = lambda *vs: [[i, oracle.encode(v)] for i, v in vs]
  cases = [
      ({"status": "ok", "values": enc((0, 1), (1, 2))}, "passed"),
      ({"status": "ok", "values": enc((0, 1), (1, 3))}, "failed"),
      ({"status": "error", "values": enc((0, 5))}, "failed"),  # wrong before it raised: as assert
      ({"status": "error", "values": enc((0, 1))}, "error"),  # raised before the second check
      ({"status": "ok", "values": enc((0, 1))}, "failed"),  # a check never reached, no exception
      ({"status": "ok", "values": enc((0, 1), (1, 2), (1, 9))}, "failed"),  # every record must match
      ({"status": "ok", "values": enc((0, 1), (1, 2)) + [["x", 1], 5]}, "passed"),  # junk is skipped
  ]
  for rec, want in cases:
    assert oracle.outcomes(exp, {"test_m.py": {"test_a": rec}}) == {"test_m.py::test_a": want}, rec
  for results in ({}, {"test_m.py": []}, {"test_m.py": {"test_a": "ok"}}, []):
    assert oracle.outcomes(exp, results) == {"test_m.py::test_a": "error"}
  bad = {"test_m.py": {"test_a": {"status": "ok", "values": 5}}}
  assert oracle.outcomes(exp, bad) == {"test_m.py::test_a": "failed"}


def test_checks_right_counts_single_checks_for_partial_credit():
  exp = {"test_m.py": {"test_a": [oracle.Expected(0, 1, True), oracle.Expected(1, 2, True)],
                       "test_b": [oracle.Expected(0, "x", True)]},
         "test_v.py": {"test_c": [oracle.Expected(0, 7, True)]}}
  enc = lambda *vs: [[i, oracle.encode(v)] for i, v in vs]
  cases = [  # (test_a's record, test_b's record) -> right checks of test_m.py's 3
      (({"status": "ok", "values": enc((0, 1), (1, 2))}, {"status": "ok", "values": enc((0, "x"))}), 3),
      (({"status": "ok", "values": enc((0, 1), (1, 3))}, {"status": "ok", "values": enc((0, "x"))}), 2),
      (({"status": "error", "values": enc((0, 1))}, {"status": "ok", "values": enc((0, "y"))}), 1),
      (({"status": "ok", "values": enc((0, 1), (1, 2), (1, 9))}, None), 1),  # every record must match
      (({"status": "ok", "values": enc((0, True), (1, 2))}, "junk"), 1),  # check(): True is not 1
  ]
  for (a, b), want in cases:
    results = {"test_m.py": {"test_a": a, "test_b": b}, "test_v.py": {"test_c": {"status": "ok",
                                                                                 "values": enc((0, 7))}}}
    assert oracle.checks_right(exp, results, ["test_m.py"]) == {"passed": want, "total": 3}, (a, b)
  assert oracle.checks_right(exp, {}, ["test_m.py"]) == {"passed": 0, "total": 3}  # no values file
  assert oracle.checks_right(exp, [], ["test_m.py", "test_v.py"]) == {"passed": 0, "total": 4}
  assert oracle.checks_right(exp, {}, []) == {"passed": 0, "total": 0}  # no hidden files


def test_a_hostile_values_file_is_no_report(tmp_path):
  """The file comes from the sandbox: too big, not JSON or nested past any limit, it reads as None
  and the grade is 0, never an exception in the grader."""
  import json
  p = str(tmp_path / "values.json")
  for blob in (b"[" * 200_000 + b"]" * 200_000, b"x" * (oracle.MAX_RESULT_BYTES + 1), b"\xff\xfe",
               b"[1, 2]"):
    with open(p, "wb") as f:
      f.write(blob)
    assert oracle.read_results(p) is None
  assert oracle.read_results(str(tmp_path / "missing.json")) is None
  deep = ["list", [["int", "1"]]]
  for _ in range(50):
    deep = ["list", [deep]]
  with open(p, "w") as f:
    json.dump({"test_m.py": {"test_a": {"status": "ok", "values": [[0, deep]]}}}, f)
  got = oracle.decode(oracle.read_results(p)["test_m.py"]["test_a"]["values"][0][1])
  assert not oracle.matches(got, oracle.Expected(0, [], False))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_values_and_report_graders_agree_on_honest_and_slipped_code(tmp_path, name):
  """Every template and level: the start, the reference and near misses of it get the same
  per-test outcomes from both graders."""
  from composer_jax.env.synthetic.cases import near_misses
  rng = random.Random(name)
  for d in TEMPLATES[name].levels:
    task = synthetic.write_task(TEMPLATES[name].make(random.Random(f"agree/{name}/{d}"), d),
                                str(tmp_path / f"{name}-{d}"))
    gold = {rel: read_text(os.path.join(task.gold_dir, rel)) for rel in task.gold_files}
    variants = [{}, gold]
    rel = rng.choice(task.gold_files)
    misses = near_misses(gold[rel])
    variants += [{**gold, rel: m} for m in rng.sample(misses, min(2, len(misses)))]
    for i, overlay in enumerate(variants):
      ws = _ws(task, tmp_path, overlay)
      a, b = grade(task, ws), grade(dataclasses.replace(task, grader="junit"), ws)
      assert (a.reward, a.details["failed_tests"]) == (b.reward, b.details["failed_tests"]), (d, i)
      if i < 2:
        assert a.reward == float(i)
        # Hidden checks for partial credit: all right in the reference, none at the start (a value
        # the start gives is a ``kept`` check, not paid: templates.hidden_test).
        hc = a.details["hidden_checks"]
        assert hc["passed"] == (hc["total"] if i else 0), (d, i, hc)


def test_task_grader_field_is_checked():
  base = {"instance_id": "x", "repo": "r", "problem_statement": "p", "problem_statement_terse": "p",
          "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": []}
  assert task_from_json(base).grader == "junit"
  assert task_from_json({**base, "grader": "values"}).grader == "values"
  with pytest.raises(TaskError, match="grader='pytest'; use 'junit' or 'values'"):
    task_from_json({**base, "grader": "pytest"})


def test_split_checks_never_parses_in_two_threads_at_once(monkeypatch):
  """The rollout workers grade in a thread pool, and CPython 3.11's ast.parse is not safe to run in
  two threads at once (gh-106905: one RL run ended on its SystemError). split_checks serializes it."""
  import threading
  import time
  inside, most, guard = [0], [0], threading.Lock()
  real = ast.parse

  def slow_parse(*a, **kw):
    with guard:
      inside[0] += 1
      most[0] = max(most[0], inside[0])
    time.sleep(0.01)  # long enough for the other threads to arrive
    with guard:
      inside[0] -= 1
    return real(*a, **kw)

  monkeypatch.setattr(oracle.ast, "parse", slow_parse)
  src = "def test_a():\n    assert f(1) == 2\n"
  out = []
  # the report grader's probes (env/probes.py) parse under the same lock
  jobs = [lambda: oracle.split_checks(src), lambda: probe_rewrite.rewrite(src, "t.py")] * 3
  threads = [threading.Thread(target=lambda job=job: out.append(job())) for job in jobs]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(out) == 6 and most[0] == 1
  assert sum(o == oracle.split_checks(src) for o in out) == 3

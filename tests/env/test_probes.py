"""env/probes.py: which comparisons become probes, that the rewritten tests compute what the
originals compared, the plugin's record, and the host's verdict."""

from __future__ import annotations

import collections
import decimal
import enum
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from composer_jax.env import probe_rewrite, probes
from tests.env.probe_runs import MOD_RIGHT, MOD_WRONG, against_original, run_pytest

SRC = '''import unittest

import mod


def test_top():
    assert mod.f(1) == 2
    assert 3 == mod.f(2), "literal on the left"
    s = "ééé"; assert mod.g(s) == "ééé!"


def test_multiline():
    assert mod.f(
        4) == [
        5,
    ]
    assert mod.h() == {"a": (1, 2.5), "b": b"x"}


def test_nested():
    for _ in range(2):
        assert mod.f(0) == 1
    with open(__file__):
        assert mod.f(5) == 6


def test_untouched():
    assert mod.f(1) == mod.f(1)
    assert mod.f(1)
    assert 0 < mod.f(1) < 3  # a chained comparison
    assert 1 == 1
    assert mod.f(1) == ...


def helper():
    assert mod.f(1) == 2


class TestUnit(unittest.TestCase):
    def test_eq(self):
        self.assertEqual(mod.f(3), 4, "with a message")
        self.assertEqual(mod.f(6), mod.f(6))
    def test_after(self):
        raise ValueError("line kept")
'''


def _rewritten():
  got = probe_rewrite.rewrite(SRC, "tests/test_m.py")
  assert got is not None
  return got


def test_literal_comparisons_in_test_functions_become_probes_and_the_rest_reads_as_before():
  text, found = _rewritten()
  by_test = collections.defaultdict(list)
  for p in found:
    by_test[p.test.split("::", 1)[1]].append(p.want)
  assert dict(by_test) == {
      "test_top": [2, 3, "ééé!"], "test_multiline": [[5], {"a": (1, 2.5), "b": b"x"}],
      "test_nested": [1, 6], "TestUnit::test_eq": [4]}
  assert [p.index for p in found if p.test.endswith("::test_top")] == [0, 1, 2]
  old, new = SRC.splitlines(), text.splitlines()
  assert len(old) == len(new)  # tracebacks still point at the test's own lines
  changed = {i + 1 for i, (a, b) in enumerate(zip(old, new)) if a != b}
  assert changed == {7, 8, 9, 13, 14, 15, 16, 17, 22, 24, 41}  # 13-16: one statement
  assert new[8] == '    s = "ééé"; __cj_probe__(2, (mod.g(s)))'
  assert new[6] == "    __cj_probe__(0, (mod.f(1)))"
  assert new[40] == "        __cj_probe__(0, (mod.f(3)))"
  for lit in ("== 2", "3 ==", '"ééé!"', "== 1\n", "== 6", "4, \"with"):
    assert lit not in "\n".join(new[6:24] + new[40:41]), lit  # no expected literal is left
  assert "def helper():\n    assert mod.f(1) == 2" in text
  assert probe_rewrite.rewrite("def test_x(:\n", "t.py") is None


def _run_rewritten(tmp_path, module_text):
  """Run the original and the rewritten file's tests in-process with a recording probe:
  {test: (the original passed, [(want, value), ...])}."""
  text, found = _rewritten()
  (tmp_path / "mod.py").write_text(module_text)
  sys.path.insert(0, str(tmp_path))
  sys.modules.pop("mod", None)
  import builtins
  try:
    ns_old, ns_new = {"__file__": __file__}, {"__file__": __file__}
    exec(compile(SRC, "old", "exec"), ns_old)
    exec(compile(text, "new", "exec"), ns_new)
    out = {}
    for name in ("test_top", "test_multiline", "test_nested", "TestUnit::test_eq"):
      def call(ns):
        if "::" in name:
          cls, meth = name.split("::")
          return getattr(ns[cls](meth), meth)()
        return ns[name]()
      try:
        call(ns_old)
        passed = True
      except AssertionError:
        passed = False
      current = []
      builtins.__cj_probe__ = lambda i, v, current=current: current.append((i, v))
      call(ns_new)
      want = {p.index: p.want for p in found if p.test == f"tests/test_m.py::{name}"}
      out[name] = (passed, [(want[i], v) for i, v in current])
    return out
  finally:
    del builtins.__cj_probe__
    sys.path.remove(str(tmp_path))
    sys.modules.pop("mod", None)


@pytest.mark.parametrize("module", ["right", "wrong"])
def test_the_rewritten_tests_probe_what_the_originals_compared(tmp_path, module):
  """The independent reference is the original file run as written: a test passes iff every
  value its probes saw equals the literal its assert held."""
  runs = _run_rewritten(tmp_path, MOD_RIGHT if module == "right" else MOD_WRONG)
  for name, (passed, seen) in runs.items():
    assert seen, name
    assert passed == all(v == w for w, v in seen), (name, seen)
  if module == "wrong":
    assert not runs["test_top"][0] and runs["test_multiline"][0]


PARAM_SRC = """import pytest

import mod


@pytest.mark.parametrize("x, want", [
    (1, 2),
    (4, [5,
         ]),
    pytest.param(2, 3, id="two", marks=pytest.mark.filterwarnings("ignore")),
])
@pytest.mark.parametrize("k", [0, 5])
def test_f(x, want, k):
    assert mod.f(x) == want
    assert mod.g(str(k)) == str(k) + "!"


@pytest.mark.parametrize("s, want", [("a", "a!"), ("\u00e9", "\u00e9!")], ids=["first", "second"])
def test_g(s, want):
    assert want == mod.g(s)


@pytest.mark.parametrize("want", [2, 3])
def test_reused(want):
    assert mod.f(1) == want
    assert want  # a use that is not the expected side: the column stays


@pytest.mark.parametrize("want", [2, int("2")])
def test_not_all_literals(want):
    assert mod.f(1) == want
"""


def test_parametrized_expected_columns_become_probes_whose_literals_and_ids_leave_the_file():
  text, found = probe_rewrite.rewrite(PARAM_SRC, "t.py")
  assert [(p.test, p.index, p.arg, p.rows) for p in found] == [
      ("t.py::test_f", 0, "want", (2, [5], 3)), ("t.py::test_g", 0, "want", ("a!", "\u00e9!"))]
  assert len(text.splitlines()) == len(PARAM_SRC.splitlines())
  hidden = text[:text.index("def test_reused")]
  for lit in ("(1, 2)", "[5,", "2, 3,", '"two"', '"a!"', '"\u00e9!"', '"first"'):
    assert lit not in hidden, lit
  assert "ids=['cj0', 'cj1', 'cj2'])" in text and "ids=(['cj0', 'cj1']))" in text
  assert 'assert mod.g(str(k)) == str(k) + "!"' in text  # a computed expectation stays
  assert text[text.index("def test_reused"):] == PARAM_SRC[PARAM_SRC.index("def test_reused"):]



def test_list_argnames_and_a_single_name_column_are_probed_too():
  src = ("import pytest\nimport mod\n\n\n"
         "@pytest.mark.parametrize(['x', 'want'], [[1, 2], (2, 3)])\n"
         "def test_a(x, want):\n    assert mod.f(x) == want\n\n\n"
         "@pytest.mark.parametrize('want', [-7, {'k': 1}])\n"
         "def test_b(want):\n    assert want == mod.h()\n")
  text, found = probe_rewrite.rewrite(src, "t.py")
  assert [(p.test, p.arg, p.rows) for p in found] == [
      ("t.py::test_a", "want", (2, 3)), ("t.py::test_b", "want", (-7, {"k": 1}))]
  assert "[[1, (0)], (2, (1))], ids=['cj0', 'cj1'])" in text
  assert "[(0), (1)], ids=['cj0', 'cj1'])" in text and "-7" not in text


def test_parametrized_probes_are_right_exactly_where_the_original_instances_pass(tmp_path):
  """The independent reference is the original file run as written under pytest: with the right
  module as the reference and the wrong one as the agent, the verdict names exactly the checked
  instances whose original fails. The rewritten run's node ids carry none of the hidden values."""
  text, found = probe_rewrite.rewrite(PARAM_SRC, "t.py")
  _, collected = run_pytest(tmp_path, PARAM_SRC, MOD_RIGHT, "--collect-only")
  f2p = sorted(collected.items)
  assert "t.py::test_f[5-two]" in f2p and "t.py::test_g[second]" in f2p and len(f2p) == 12
  params = {n: collected.items[n] for n in f2p}
  assert params["t.py::test_f[5-two]"] == {"k": 1, "x": 2, "want": 2}  # rows, not pytest's indices
  ref_out, ref_run = run_pytest(tmp_path, text, MOD_RIGHT)
  assert all("cj" in n for n in ref_run.items if "test_f" in n or "test_g" in n)
  assert not any(v in n for n in ref_run.items for v in ("two", "first", "a!", "-2]"))
  checked = probes.sound(found, f2p, *probes.by_test(f2p, params, ref_out, ref_run), params)
  assert sorted(checked) == [n for n in f2p if "test_f" in n or "test_g" in n]  # 6 + 2 instances

  original_wrong, _ = run_pytest(tmp_path, PARAM_SRC, MOD_WRONG)
  failing = {n for n, o in original_wrong.items() if o != "passed"}
  assert failing == {"t.py::test_f[0-1-2]", "t.py::test_f[5-1-2]", "t.py::test_f[0-two]",
                     "t.py::test_f[5-two]", "t.py::test_reused[2]", "t.py::test_not_all_literals[2_0]",
                     "t.py::test_not_all_literals[2_1]"}
  out, run = run_pytest(tmp_path, text, MOD_WRONG)
  wrong = probes.verdict(found, checked, *probes.by_test(list(checked), params, out, run), params)
  assert sorted(wrong) == sorted(failing & set(checked)) and len(wrong) == 4
  assert probes.verdict(found, checked, *probes.by_test(list(checked), params, ref_out, ref_run), params) == []
  # a forged map of instances to rows gains nothing: the values must still be the hidden ones
  scrambled = probes.Run(run.values, dict(zip(run.items, reversed(list(run.items.values())))))
  assert probes.verdict(found, checked, *probes.by_test(list(checked), params, out, scrambled), params)




CASES_SRC = """import pytest
import mod

CASES = [
    (1, 2),
    (3, 4),
    (4, [5]),
]
SHARED = [(1, 2)]


@pytest.mark.parametrize("x, want", CASES)
def test_cases(x, want):
    assert mod.f(x) == want


@pytest.mark.parametrize("x, want", SHARED)
def test_shared_a(x, want):
    assert mod.f(x) == want


@pytest.mark.parametrize("x, want", SHARED)
def test_shared_b(x, want):
    assert want
"""


def test_a_module_level_case_list_read_by_one_decorator_is_probed_in_place(tmp_path):
  """``CASES = [...]`` bound once and read once, by a decorator, has its column hidden where it is
  written; ``SHARED``, read by two tests, is left as it is. The reference is the original file
  under pytest, as above."""
  text, found = probe_rewrite.rewrite(CASES_SRC, "t.py")
  assert [(p.test, p.arg, p.rows) for p in found] == [("t.py::test_cases", "want", (2, 4, [5]))]
  assert "(1, (0)),\n    (3, (1)),\n    (4, (2))," in text and "[5]" not in text
  assert "CASES, ids=['cj0', 'cj1', 'cj2'])" in text and "SHARED = [(1, 2)]" in text
  assert text[text.index("def test_shared_a"):] == CASES_SRC[CASES_SRC.index("def test_shared_a"):]
  f2p, checked, wrong, failing = against_original(tmp_path, CASES_SRC, text, found,
                                                   lambda n: "test_cases" in n)
  assert sorted(checked) == f2p and len(f2p) == 3
  assert wrong == failing == ["t.py::test_cases[1-2]", "t.py::test_cases[3-4]"]


CLASS_SRC = """import pytest
import mod


@pytest.mark.parametrize("x, want", [(1, 2), (4, [5])])
class TestF:
    def test_f(self, x, want):
        assert mod.f(x) == want

    @pytest.mark.parametrize("k", [0, 1])
    def test_k(self, x, want, k):
        assert mod.f(x + k - k) == want


@pytest.mark.parametrize("want", [2])
class TestUsedElsewhere:
    def test_a(self, want):
        assert mod.f(1) == want

    def test_b(self, want):
        assert want
"""


def test_a_class_level_parametrize_column_is_probed_in_every_method(tmp_path):
  """A class's parametrize column is hidden when every method uses it only as the expected side;
  ``TestUsedElsewhere`` (``assert want`` in one method) keeps its rows. Against the original file
  under pytest, as above."""
  text, found = probe_rewrite.rewrite(CLASS_SRC, "t.py")
  assert [(p.test, p.arg, p.rows) for p in found] == [
      ("t.py::TestF::test_f", "want", (2, [5])), ("t.py::TestF::test_k", "want", (2, [5]))]
  assert "[(1, (0)), (4, (1))], ids=['cj0', 'cj1'])" in text and "[5]" not in text
  assert text[text.index("@pytest.mark.parametrize(\"want\""):] == CLASS_SRC[
      CLASS_SRC.index("@pytest.mark.parametrize(\"want\""):]
  f2p, checked, wrong, failing = against_original(tmp_path, CLASS_SRC, text, found,
                                                   lambda n: "TestF" in n)
  assert sorted(checked) == f2p and len(f2p) == 6
  assert wrong == failing and len(wrong) == 3 and all("1-2" in n for n in wrong)


LOCALS_SRC = """import mod


def test_local():
    expected = [5]
    assert mod.f(4) == expected


def test_annotated_over_lines():
    want: dict = {
        "a": 2,
    }
    got = {"a": mod.f(1)}
    assert got == want


def test_loop():
    expected = 7
    for x in (6, 6):
        assert expected == mod.f(x)


def test_used_elsewhere():
    expected = 11
    assert mod.f(10) == expected
    assert len(str(expected)) == 2


def test_rebound():
    expected = 12
    expected = 13
    assert mod.f(12) == expected


def test_two_names():
    a = 2
    b = 2
    assert a == b
"""


def test_a_local_bound_once_to_a_literal_is_an_expected_value_too(tmp_path):
  """``expected = 7`` then ``assert f(x) == expected``: the literal leaves the file when the body
  binds the name once and uses it only as the expected side. Against the original file under
  pytest, as above: the verdict names exactly the checked tests whose original fails."""
  text, found = probe_rewrite.rewrite(LOCALS_SRC, "t.py")
  assert [(p.test, p.index, p.want) for p in found] == [
      ("t.py::test_local", 0, [5]), ("t.py::test_annotated_over_lines", 0, {"a": 2}),
      ("t.py::test_loop", 0, 7), ("t.py::test_used_elsewhere", 0, 2)]
  assert len(text.splitlines()) == len(LOCALS_SRC.splitlines())
  for lit in ("[5]", '"a": 2', "= 7"):
    assert lit not in text, lit
  assert "expected = 11\n    assert mod.f(10) == expected\n" in text
  assert text[text.index("def test_rebound"):] == LOCALS_SRC[LOCALS_SRC.index("def test_rebound"):]
  f2p, checked, wrong, failing = against_original(tmp_path, LOCALS_SRC, text, found, lambda n: True)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == sorted(set(failing) & set(checked)) == [
      "t.py::test_annotated_over_lines", "t.py::test_loop", "t.py::test_used_elsewhere"]


MODULE_SRC = """import unittest

import mod

EXPECTED = [5]
SEVEN: int = 7
USED = 11
SHADOWED = 2


def helper():
    return USED


def test_module_constant():
    assert mod.f(4) == EXPECTED


def test_two_tests_one_constant():
    assert SEVEN == mod.f(6)


class TestC(unittest.TestCase):
    def test_in_a_class(self):
        self.assertEqual(mod.f(6), SEVEN)


def test_read_by_a_helper():
    assert mod.f(10) == USED


def test_shadowed():
    SHADOWED = 3
    assert mod.f(2) == SHADOWED
"""


def test_a_module_constant_only_compared_with_in_tests_is_an_expected_value_too(tmp_path):
  """``EXPECTED = [5]`` at the top of the file, used only as the expected side in test functions,
  is hidden there and probed in each test; ``USED``, also read by a helper, and ``SHADOWED``,
  bound again in a test, keep their literals (the test's own binding is a local, probed as such)."""
  text, found = probe_rewrite.rewrite(MODULE_SRC, "t.py")
  assert [(p.test, p.want) for p in found] == [
      ("t.py::test_module_constant", [5]), ("t.py::test_two_tests_one_constant", 7),
      ("t.py::TestC::test_in_a_class", 7), ("t.py::test_shadowed", 3)]
  assert "[5]" not in text and "SEVEN: int = (None)" in text and "7" not in text
  assert "USED = 11" in text and "SHADOWED = 2" in text and "SHADOWED = (None)" in text
  f2p, checked, wrong, failing = against_original(tmp_path, MODULE_SRC, text, found,
                                                   lambda n: "helper" not in n)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == sorted(set(failing) & set(checked)) == [
      "t.py::TestC::test_in_a_class", "t.py::test_shadowed", "t.py::test_two_tests_one_constant"]
  original_right, _ = run_pytest(tmp_path, MODULE_SRC, MOD_RIGHT)
  assert set(original_right.values()) == {"passed"}


Point = collections.namedtuple("Point", "x y")


class Level(enum.IntEnum):
  HIGH = 3


class Name(str):
  pass


class Yes:
  def __eq__(self, other):
    return True


@pytest.mark.parametrize("value, want", [
    (Point(1, 2), (1, 2)), (Level.HIGH, 3), (collections.OrderedDict(a=1), {"a": 1}),
    (np.int64(7), 7), (np.float64(0.5), 0.5), (np.array([3]), [3]), (np.bool_(True), True),
    (bytearray(b"ab"), b"ab"), (Name("n"), "n"), ([np.int32(1), (Level.HIGH,)], [1, (3,)]),
    (collections.defaultdict(int, {1: np.int8(2)}), {1: 2})])
def test_plain_gives_the_builtin_value_that_eq_compared(value, want):
  got = probes.plain(value)
  assert got == want and type(got) is type(want) and value == want
  assert probes.right(probes.Probe("t", 0, want), [probes.oracle.decode(probes.oracle.encode(got))])


@pytest.mark.parametrize("value", [decimal.Decimal("1.5"), Yes(), object()])
def test_what_is_not_plain_data_stays_as_it_is_and_equals_nothing_on_the_host(value):
  assert probes.plain(value) is value
  assert not probes.right(probes.Probe("t", 0, 1.5), [probes.oracle.decode(probes.oracle.encode(value))])


def test_the_plugin_records_each_tests_values_under_its_node_id(tmp_path):
  text = ('import pytest\n\n\n@pytest.mark.parametrize("x", [1, 2])\ndef test_p(x):\n'
          '    assert x * 10 == 10\n\n\nclass TestC:\n    def test_m(self):\n        assert "a" * 2 == "aa"\n'
          '\n\ndef test_none():\n    pass\n')
  new, found = probe_rewrite.rewrite(text, "test_p.py")
  (tmp_path / "test_p.py").write_text(new)
  out, plugin = tmp_path / "rep" / "values.json", tmp_path / "rep" / "cj_probe_plugin.py"
  plugin.parent.mkdir()
  plugin.write_text(probes.plugin_source(str(out)))
  env = {**os.environ, "PYTHONPATH": str(plugin.parent)}
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                      "cj_probe_plugin", "test_p.py"], cwd=tmp_path, env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0, r.stdout + r.stderr
  run = probes.read_run(str(out))
  values = run.values
  assert values == {"test_p.py::test_p[1]": {0: [10]}, "test_p.py::test_p[2]": {0: [20]},
                    "test_p.py::TestC::test_m": {0: ["aa"]}}
  assert run.items == {"test_p.py::test_p[1]": {"x": 0}, "test_p.py::test_p[2]": {"x": 1},
                       "test_p.py::TestC::test_m": {}, "test_p.py::test_none": {}}
  outcomes = dict.fromkeys(values, "passed")
  f2p = sorted(values)
  checked = probes.sound(found, f2p, outcomes, values)
  # test_p[2] fails its assert as written (20 != 10): the reference would not pass it either
  assert checked == {"test_p.py::test_p[1]": [0], "test_p.py::TestC::test_m": [0]}


def test_read_run_takes_nothing_malformed(tmp_path):
  p = tmp_path / "v.json"
  for blob in ("[" * 100000, "not json", '["list"]', '{"values": ["x"], "items": 3}',
               '{"values": {"t": "x", "u": [[0]], "v": [["0", ["int", "1"]]]},'
               ' "items": {"t": {"x": "0"}, "u": [1], "v": {"x": 1.0}}}'):
    p.write_text(blob)
    run = probes.read_run(str(p))
    assert all(not rec for rec in run.values.values()) and run.items == {}, blob[:40]
  os.mkfifo(tmp_path / "fifo")
  assert probes.read_run(str(tmp_path / "fifo")) == probes.Run()
  assert probes.read_run(str(tmp_path / "missing")) == probes.Run()


def test_the_verdict_holds_each_checked_test_to_the_probes_the_reference_passed():
  found = [probes.Probe("t.py::test_a", 0, 5), probes.Probe("t.py::test_a", 1, "x"),
           probes.Probe("t.py::test_b", 0, [1])]
  f2p = ["t.py::test_a[1]", "t.py::test_a[2]", "t.py::test_b"]
  ref_values = {"t.py::test_a[1]": {0: [5], 1: [6]}, "t.py::test_a[2]": {0: [5, 5], 1: ["x"]},
                "t.py::test_b": {0: [[1]]}}
  ref_out = {"t.py::test_a[1]": "passed", "t.py::test_a[2]": "passed", "t.py::test_b": "failed"}
  checked = probes.sound(found, f2p, ref_out, ref_values)
  assert checked == {"t.py::test_a[1]": [0], "t.py::test_a[2]": [0, 1]}  # test_b: the reference failed
  passed = dict.fromkeys(f2p, "passed")
  assert probes.verdict(found, checked, passed, ref_values) == []
  assert probes.verdict(found, checked, passed, {**ref_values, "t.py::test_a[2]": {0: [5, 4], 1: ["x"]}}) \
      == ["t.py::test_a[2]"]  # one wrong value of two
  assert probes.verdict(found, checked, passed, {"t.py::test_a[2]": {0: [5], 1: ["x"]}}) \
      == ["t.py::test_a[1]"]  # never reached
  assert probes.verdict(found, checked, {**passed, "t.py::test_a[1]": "failed"}, ref_values) \
      == ["t.py::test_a[1]"]
  assert probes.verdict(found, checked, passed, {"t.py::test_a[1]": {0: [5]},
                                                 "t.py::test_a[2]": {0: [5], 1: [probes.oracle.decode(["other", "Yes"])]}}) \
      == ["t.py::test_a[2]"]


def test_the_reference_is_computed_once_while_graders_wait_and_not_kept_when_it_raises():
  cache, calls = probes.ReferenceCache(), []

  def slow():
    calls.append(1)
    time.sleep(0.2)
    return {"t": [0]}
  got = []
  threads = [threading.Thread(target=lambda: got.append(cache.get("k", slow))) for _ in range(8)]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  assert got == [{"t": [0]}] * 8 and len(calls) == 1

  def boom():
    raise OSError("no sandbox")
  with pytest.raises(OSError):
    cache.get("k2", boom)
  assert cache.get("k2", lambda: {}) == {}


def test_values_file_json_round_trip_keeps_bytes():
  assert probes.oracle.decode(json.loads(json.dumps(probes.oracle.encode(b"\x00\xff")))) == b"\x00\xff"

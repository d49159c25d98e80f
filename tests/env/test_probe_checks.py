"""env/probe_rewrite.py's checks besides ``==``: identity, truth, numpy.testing's, ``pytest.approx`` and
``assertAlmostEqual``, each against the original file run under pytest."""

from __future__ import annotations

from composer_jax.env import probe_rewrite
from tests.env.probe_runs import against_original

IS_SRC = """import unittest

import mod


def test_is_none():
    assert mod.nothing(0) is None


def test_is_true():
    assert True is mod.yes(1)


def test_false_equals_zero():
    assert mod.yes(0) == 0


class TestU(unittest.TestCase):
    def test_assert_is(self):
        self.assertIs(mod.yes(0), False)

    def test_assert_is_none(self):
        self.assertIsNone(mod.nothing(1), "a message")


def test_is_not():
    assert mod.yes(1) is not None
"""
IS_RIGHT = "def nothing(x):\n    return None\n\n\ndef yes(x):\n    return bool(x)\n"
IS_WRONG = "def nothing(x):\n    return 0\n\n\ndef yes(x):\n    return int(bool(x))\n"  # == but not is


def test_identity_checks_against_none_true_and_false_are_strict_probes(tmp_path):
  """``is None``, ``is True``, ``assertIs(E, False)`` and ``assertIsNone(E)`` hold only for that
  very value: their probes compare the type too, so ``0`` and ``1`` are wrong there, and stay right
  where the original compares with ``==``. Against the original file under pytest."""
  text, found = probe_rewrite.rewrite(IS_SRC, "t.py")
  assert [(p.test, p.want, p.how) for p in found] == [
      ("t.py::test_is_none", None, ("is",)), ("t.py::test_is_true", True, ("is",)),
      ("t.py::test_false_equals_zero", 0, ("==",)), ("t.py::TestU::test_assert_is", False, ("is",)),
      ("t.py::TestU::test_assert_is_none", None, ("is",)),
      ("t.py::test_is_not", None, ("op", "is not", "right"))]
  for lit in ("is None\n", "True is", "False)", "assertIsNone"):
    assert lit not in text, lit
  f2p, checked, wrong, failing = against_original(tmp_path, IS_SRC, text, found, lambda n: True,
                                                   IS_RIGHT, IS_WRONG)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == sorted(set(failing) & set(checked)) and len(wrong) == 4
  assert "t.py::test_false_equals_zero" not in wrong and "t.py::test_is_not" not in wrong


NUMPY_SRC = """import numpy as np
import numpy.testing as npt
from numpy.testing import assert_allclose as close

import mod


def assert_allclose(a, b):  # the file's own helper of that name: not numpy's
    assert abs(a - b) < 0.1


def test_array_equal():
    np.testing.assert_array_equal(mod.arr(3), [0, 1, 2])


def test_array_equal_takes_a_tuple():
    npt.assert_array_equal(mod.pair(), [1, 2], err_msg="pair")


def test_allclose_default():
    close(mod.third(), 0.333333333)


def test_allclose_tolerance():
    np.testing.assert_allclose(mod.third(), 0.33, rtol=0.05)


def test_own_helper():
    assert_allclose(mod.third(), 0.3)


def test_literal_first():
    np.testing.assert_allclose(0.33, mod.third(), 0.05)
"""
NUMPY_RIGHT = ("import numpy as np\n\n\ndef arr(n):\n    return np.arange(n)\n\n\n"
               "def pair():\n    return (1, 2)\n\n\ndef third():\n    return np.float32(1) / 3\n")
NUMPY_WRONG = NUMPY_RIGHT.replace("np.arange(n)", "np.arange(n) + 1").replace("np.float32(1) / 3", "0.34")


def test_numpy_testing_checks_are_probed_with_their_own_tolerances(tmp_path):
  """``numpy.testing.assert_array_equal`` and ``assert_allclose``, as the file's imports spell
  them, are probed; the host redoes numpy's own check on the recorded plain data with the test's
  tolerances. A same-named helper of the file's own, and an allclose with the literal first, stay.
  Against the original file under pytest: 0.34 is wrong at rtol 1e-7 and right at rtol 0.05."""
  text, found = probe_rewrite.rewrite(NUMPY_SRC, "t.py")
  assert [(p.test, p.want, p.how) for p in found] == [
      ("t.py::test_array_equal", [0, 1, 2], ("array",)),
      ("t.py::test_array_equal_takes_a_tuple", [1, 2], ("array",)),
      ("t.py::test_allclose_default", 0.333333333, ("close", 1e-7, 0, True)),
      ("t.py::test_allclose_tolerance", 0.33, ("close", 0.05, 0, True))]
  for lit in ("[0, 1, 2]", "0.333333333", "mod.third(), 0.33"):
    assert lit not in text, lit
  f2p, checked, wrong, failing = against_original(tmp_path, NUMPY_SRC, text, found, lambda n: True,
                                                   NUMPY_RIGHT, NUMPY_WRONG)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == sorted(set(failing) & set(checked)) == [
      "t.py::test_allclose_default", "t.py::test_array_equal"]


APPROX_SRC = """import unittest

import pytest
from pytest import approx as near

import mod


def test_approx():
    assert mod.third() == pytest.approx(0.3333333)


def test_approx_first_and_loose():
    assert near(0.33, rel=0.05) == mod.third()


def test_approx_tuple():
    assert mod.pair() == pytest.approx((1.0, 2.0))


def test_approx_of_a_name():
    assert mod.third() == pytest.approx(mod.third())


class TestA(unittest.TestCase):
    def test_almost(self):
        self.assertAlmostEqual(mod.third(), 0.3333333, places=6)

    def test_almost_delta(self):
        self.assertAlmostEqual(mod.third(), 0.3, delta=0.05)
"""


def test_approx_and_assert_almost_equal_are_probed_with_their_own_tolerances(tmp_path):
  """``E == pytest.approx(LITERAL[, rel, abs])`` (as the imports spell it) and unittest's
  ``assertAlmostEqual(E, LITERAL[, places, delta])`` are probed, and the host redoes the same
  check with the same tolerances. Against the original file under pytest, with the float32 and
  0.34 modules of the numpy test: 0.34 is wrong at the default tolerances, right at loose ones."""
  text, found = probe_rewrite.rewrite(APPROX_SRC, "t.py")
  assert [(p.test, p.want, p.how) for p in found] == [
      ("t.py::test_approx", 0.3333333, ("approx", None, None, False)),
      ("t.py::test_approx_first_and_loose", 0.33, ("approx", 0.05, None, False)),
      ("t.py::test_approx_tuple", (1.0, 2.0), ("approx", None, None, False)),
      ("t.py::TestA::test_almost", 0.3333333, ("almost", 6, None)),
      ("t.py::TestA::test_almost_delta", 0.3, ("almost", None, 0.05))]
  for lit in ("0.3333333", "0.33", "(1.0, 2.0)", "0.3,"):
    assert lit not in text, lit
  f2p, checked, wrong, failing = against_original(tmp_path, APPROX_SRC, text, found, lambda n: True,
                                                   NUMPY_RIGHT, NUMPY_WRONG)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == sorted(set(failing) & set(checked)) == ["t.py::TestA::test_almost", "t.py::test_approx"]


TRUTH_SRC = """import unittest

import mod


class TestT(unittest.TestCase):
    def test_true(self):
        self.assertTrue(mod.yes(1))

    def test_false(self):
        self.assertFalse(mod.yes(0), "a message")

    def test_true_of_an_object(self):
        self.assertTrue(mod.match("ab"))

    def test_true_of_a_comparison(self):
        self.assertTrue(mod.yes(2) == 1)
"""
TRUTH_RIGHT = ("import re\n\n\ndef yes(x):\n    return bool(x)\n\n\n"
               "def match(s):\n    return re.match('a', s)\n")
# yes: 1 and 0 have the truth of True and False, so assertTrue and assertFalse still pass; match: None.
TRUTH_WRONG = TRUTH_RIGHT.replace("bool(x)", "int(bool(x))").replace("'a'", "'b'")


def test_assert_true_and_false_are_probed_by_the_truth_the_test_took(tmp_path):
  """``assertTrue(E)`` and ``assertFalse(E)`` become probes of ``not not E``: the truth the original
  took, recorded as a bool whatever E is (a ``re.Match`` here, not plain data), and checked on the
  host against True or False, which leave the file. So 1 and 0 stay right (the original passes
  with them too) and None is wrong where the original asserted truth."""
  text, found = probe_rewrite.rewrite(TRUTH_SRC, "t.py")
  assert [(p.test, p.want, p.how) for p in found] == [
      ("t.py::TestT::test_true", True, ("is", "truth")), ("t.py::TestT::test_false", False, ("is", "truth")),
      ("t.py::TestT::test_true_of_an_object", True, ("is", "truth")),
      ("t.py::TestT::test_true_of_a_comparison", 1, ("==",))]  # as ``assert yes(2) == 1``
  assert "assertTrue" not in text and "assertFalse" not in text
  assert "__cj_probe__(0, (not not (mod.match(\"ab\"))))" in text
  f2p, checked, wrong, failing = against_original(tmp_path, TRUTH_SRC, text, found, lambda n: True,
                                                  TRUTH_RIGHT, TRUTH_WRONG)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == failing == ["t.py::TestT::test_true_of_an_object"]


NUMPY_MORE_SRC = """import numpy as np
import numpy.testing as npt
from numpy.testing import assert_almost_equal, assert_equal

import mod


def test_equal():
    assert_equal(mod.arr(3), [0, 1, 2])


def test_equal_nested():
    assert_equal({"a": mod.arr(2)}, {"a": [0, 1]})


def test_almost_default():
    assert_almost_equal(mod.third(), 0.3333333)


def test_almost_decimal():
    npt.assert_almost_equal(mod.third(), 0.33, decimal=1)


def test_array_almost():
    np.testing.assert_array_almost_equal(mod.arr(2) / 3, [0.0, 0.333333])


def test_strict():
    np.testing.assert_equal(mod.arr(1), [0], strict=True)
"""
def test_numpy_equal_and_almost_equal_are_probed_with_their_decimal(tmp_path):
  """numpy.testing's ``assert_equal`` (recursive) and ``assert_almost_equal`` /
  ``assert_array_almost_equal`` (with the test's ``decimal``, default 7 and 6) are probed, and the
  host redoes numpy's check; ``strict=`` (a type check the host's plain data cannot redo) stays.
  Against the original under pytest: 0.34 is wrong at 7 decimals and right at 1."""
  text, found = probe_rewrite.rewrite(NUMPY_MORE_SRC, "t.py")
  assert [(p.test, p.want, p.how) for p in found] == [
      ("t.py::test_equal", [0, 1, 2], ("np_equal",)), ("t.py::test_equal_nested", {"a": [0, 1]}, ("np_equal",)),
      ("t.py::test_almost_default", 0.3333333, ("np_almost", 7)),
      ("t.py::test_almost_decimal", 0.33, ("np_almost", 1)),
      ("t.py::test_array_almost", [0.0, 0.333333], ("array_almost", 6))]
  for lit in ("[0, 1, 2]", "0.3333333", "0.33,", "0.333333]"):
    assert lit not in text, lit
  assert "strict=True" in text
  f2p, checked, wrong, failing = against_original(tmp_path, NUMPY_MORE_SRC, text, found, lambda n: True,
                                                  NUMPY_RIGHT, NUMPY_WRONG)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == sorted(set(failing) & set(checked)) == [
      "t.py::test_almost_default", "t.py::test_array_almost", "t.py::test_equal", "t.py::test_equal_nested"]
  assert "t.py::test_strict" in failing and "t.py::test_strict" not in checked


OPS_SRC = """import mod


def test_not_equal():
    assert mod.f(1) != 3


def test_less():
    assert mod.f(1) < 3


def test_literal_first():
    assert 1 <= mod.f(0)


def test_in():
    assert "!" in mod.g("a")


def test_key_in_a_dict():
    assert "a" in mod.h()


def test_not_in():
    assert 4 not in [mod.f(1), mod.f(2)]


def test_chained():
    assert 0 < mod.f(1) < 3
"""


def test_other_comparison_operators_are_probed_with_the_literal_on_its_side(tmp_path):
  """``assert E OP LITERAL`` and ``assert LITERAL OP E`` for ``!=``, ``<``, ``<=``, ``in`` and
  ``not in`` are probed; the host redoes the operator with the literal where it stood (``1 <= E``
  is not ``E <= 1``; ``"a" in E`` asks E's keys when E is a dict, as it did in the sandbox). A
  chained comparison stays. Against the original file under pytest with MOD_WRONG (f = x + 2)."""
  text, found = probe_rewrite.rewrite(OPS_SRC, "t.py")
  assert [(p.test, p.want, p.how) for p in found] == [
      ("t.py::test_not_equal", 3, ("op", "!=", "right")), ("t.py::test_less", 3, ("op", "<", "right")),
      ("t.py::test_literal_first", 1, ("op", "<=", "left")), ("t.py::test_in", "!", ("op", "in", "left")),
      ("t.py::test_key_in_a_dict", "a", ("op", "in", "left")),
      ("t.py::test_not_in", 4, ("op", "not in", "left"))]
  hidden = text[:text.index("def test_chained")]
  for lit in ("!= 3", "< 3", "1 <=", '"!" in', "4 not in"):
    assert lit not in hidden, lit
  assert "assert 0 < mod.f(1) < 3" in text
  f2p, checked, wrong, failing = against_original(tmp_path, OPS_SRC, text, found, lambda n: True)
  assert sorted(checked) == sorted(p.test for p in found)
  # f(1) = 3 and [3, 4] under the wrong module: != 3, < 3 and not in fail; 1 <= f(0) = 2 holds.
  assert wrong == sorted(set(failing) & set(checked)) == [
      "t.py::test_less", "t.py::test_not_equal", "t.py::test_not_in"]


UNITTEST_OPS_SRC = """import unittest

import mod


class TestU(unittest.TestCase):
    def test_not_equal(self):
        self.assertNotEqual(mod.f(1), 3)

    def test_less(self):
        self.assertLess(mod.f(1), 3, "a message")

    def test_greater_equal_literal_first(self):
        self.assertGreaterEqual(2, mod.f(1))

    def test_in(self):
        self.assertIn("!", mod.g("a"))

    def test_not_in(self):
        self.assertNotIn(mod.f(2), [4])

    def test_is_not_none(self):
        self.assertIsNotNone(mod.h())

    def test_is_not(self):
        self.assertIsNot(mod.h(), None)

    def test_true_of_less(self):
        self.assertTrue(mod.f(1) < 3)

    def test_false_of_equal(self):
        self.assertFalse(mod.f(1) == 3)

    def test_false_of_less(self):
        self.assertFalse(mod.f(1) < 0)

    def test_true_of_two_calls(self):
        self.assertTrue(mod.f(1) == mod.f(1))
"""


def test_unittest_comparisons_and_asserted_comparisons_move_their_literal_to_the_host(tmp_path):
  """unittest's ``assertNotEqual``, ``assertLess`` ... ``assertNotIn``, ``assertIsNot(A, None)`` and
  ``assertIsNotNone`` are ``assert A OP B``, and ``assertTrue(A OP B)`` is too (``assertFalse``:
  the negated operator, for ==, in and is, whose negations are operators). Probed as the truth, the
  literal stayed in the sandbox and True or False was all a forger needed to claim. ``assertFalse(A
  < 0)`` (``not <`` is not ``>=`` for sets or NaN) and a comparison with no literal side keep the
  truth probe. Against the original file under pytest with MOD_WRONG (f = x + 2)."""
  text, found = probe_rewrite.rewrite(UNITTEST_OPS_SRC, "t.py")
  t = "t.py::TestU::test_"
  assert [(p.test[len(t):], p.want, p.how) for p in found] == [
      ("not_equal", 3, ("op", "!=", "right")), ("less", 3, ("op", "<", "right")),
      ("greater_equal_literal_first", 2, ("op", ">=", "left")), ("in", "!", ("op", "in", "left")),
      ("not_in", [4], ("op", "not in", "right")), ("is_not_none", None, ("op", "is not", "right")),
      ("is_not", None, ("op", "is not", "right")), ("true_of_less", 3, ("op", "<", "right")),
      ("false_of_equal", 3, ("op", "!=", "right")), ("false_of_less", False, ("is", "truth")),
      ("true_of_two_calls", True, ("is", "truth"))]
  body = text[text.index("class TestU"):text.index("def test_false_of_less")]
  for lit in (", 3", "< 3", "== 3", "[4]", "(2,", "assert"):
    assert lit not in body, lit
  f2p, checked, wrong, failing = against_original(tmp_path, UNITTEST_OPS_SRC, text, found, lambda n: True)
  assert sorted(checked) == sorted(p.test for p in found)
  assert wrong == failing == sorted(t + n for n in (
      "not_equal", "less", "greater_equal_literal_first", "not_in", "true_of_less", "false_of_equal"))

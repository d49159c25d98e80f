"""env/canary.py: which asserts a canary changes, and that only their literal's characters change."""

from __future__ import annotations

from composer_jax.env import canary

SRC = '''import pytest
# a comment stays


def test_int():
    x = compute()
    assert x == 5  # must run


def test_left_and_list():
    assert [1, 2] == f()


def test_nested_only():
    if flag:
        assert g() == 3
    for i in range(3):
        assert h(i) == 4


def test_not_eq():
    assert k() != 3
    assert k() < 4


def test_str():
    s = "é"
    assert name(s) == "é-ok"


class TestBox:
    def test_method(self):
        assert Box().size == 2.5


def test_bool():
    assert ok() == True


class TestUnit(unittest.TestCase):
    def test_eq(self):
        self.assertEqual(total([1, 2]), 3)
'''


def test_only_asserts_that_must_run_get_a_changed_literal_and_the_rest_reads_as_before():
  names = ["test_int", "test_left_and_list", "test_nested_only", "test_not_eq", "test_str",
           "TestBox::test_method", "test_bool", "test_missing"]
  out, planted = canary.plant(SRC, names)
  assert planted == ["test_int", "test_left_and_list", "test_str"]  # MAX_CANARIES = 3
  assert "    assert x == 6  # must run\n" in out and "# a comment stays\n" in out
  assert "    assert [2, 2] == f()\n" in out
  assert '    assert name(s) == "é-okx"\n' in out  # its quotes kept, after a non-ASCII character
  diff = [(a, b) for a, b in zip(SRC.splitlines(), out.splitlines()) if a != b]
  assert len(diff) == 3 and len(SRC.splitlines()) == len(out.splitlines())
  out, planted = canary.plant(SRC, ["test_nested_only", "test_not_eq", "TestBox::test_method",
                                    "test_bool"])
  assert planted == ["TestBox::test_method"] and "assert Box().size == 3.5" in out
  out, planted = canary.plant(SRC, ["TestUnit::test_eq"])
  assert planted == ["TestUnit::test_eq"] and "self.assertEqual(total([1, 2]), 4)" in out
  assert canary.plant("def test_x(:\n", ["test_x"]) == ("def test_x(:\n", [])


def test_candidates_group_node_ids_by_file_without_parametrisation():
  got = canary.candidates(["tests/test_a.py::test_x[1-2]", "tests/test_a.py::test_x[3-4]",
                           "tests/test_a.py::TestC::test_y", "tests/test_b.py::test_z", "weird"])
  assert got == {"tests/test_a.py": ["test_x", "TestC::test_y"], "tests/test_b.py": ["test_z"]}


def test_plant_all_draws_at_most_three_canaries_at_random_from_the_tests_that_have_one(tmp_path):
  import random
  (tmp_path / "tests").mkdir()
  body = "".join(f"def test_{i}():\n    assert f({i}) == {i * 10}\n\n\n" for i in range(6))
  (tmp_path / "tests" / "test_a.py").write_text(body + "def test_none():\n    assert f()\n")
  f2p = [f"tests/test_a.py::test_{i}" for i in range(6)] + ["tests/test_a.py::test_none"]
  drawn = set()
  for seed in range(8):
    (tmp_path / "tests" / "test_a.py").write_text(body + "def test_none():\n    assert f()\n")
    ids = canary.plant_all(str(tmp_path), f2p, random.Random(seed))
    assert len(ids) == 3 and "tests/test_a.py::test_none" not in ids
    text = (tmp_path / "tests" / "test_a.py").read_text()
    for nid in ids:
      i = int(nid.rsplit("_", 1)[1])
      assert f"assert f({i}) == {i * 10 + 1}\n" in text
    drawn.add(tuple(ids))
  assert len(drawn) > 1  # not a fixed set a forgery could learn to tell the truth about

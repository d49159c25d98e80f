"""Grading by values (``Task.grader = "values"``): the sandbox reports what the code computed, the
grader decides whether that is right.

A test run that imports the code under test runs that code in its own process, and that code can do
anything the runner can: write a report that says "passed" (the runner's report path is a frame
away), exit before the asserts, or read the hidden tests beside it and return their expected values.
``runner.py``'s report could be forged in about fifteen lines that the trajectory monitor does not
match (``tests/env/test_oracle.py``). So for tasks whose tests are value checks, the grader never
sends an expected value or a verdict through the sandbox:

- ``split_checks`` rewrites each protected test file on the host: every ``check(E, V)``,
  ``assert E == V`` and ``assert E`` becomes ``__cj_probe__(i, E)``, and the expected value V (a
  literal; True for a bare assert) stays on the host. The rewritten files hold inputs only.
- ``PROBE_SOURCE`` (written by the grader into a folder of its own, never the workspace's
  ``run_tests.py``) imports each rewritten file in the sandbox, runs its ``test_*`` functions and
  writes every probed value, encoded as plain data (``encode``), to a JSON file.
- ``outcomes`` decodes those values and compares them with the expected ones: a test passes iff
  each of its probes was reached and every value it recorded matches (``check``: same type and
  equal; ``assert``: equal). Anything the code returns that is not plain data (an always-equal
  object, an ``int`` subclass) decodes to a value equal to nothing.

Anything the code under test writes is at most a claim about values, and a claim that passes is the
correct values for inputs it has not seen before the run, which is solving the task. The only weak
checks are bare asserts (``assert not hasattr(m, "old")``): their expected value is always True, so
code can claim it; the value checks beside them still have to hold.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import threading

from composer_jax.env.guards import read_regular

PROBE = "__cj_probe__"
MAX_RESULT_BYTES = 1 << 20  # the values file is read back only up to this size


class NotValueChecks(ValueError):
  """A test file has a check this grader cannot move to the host (e.g. an expected value that is
  not a literal)."""


@dataclasses.dataclass(frozen=True)
class Expected:
  index: int  # the probe's number in its test function
  want: object
  strict: bool  # check(): the type must match too


class _Rewrite(ast.NodeTransformer):
  def __init__(self, file: str):
    self.file, self.expected, self.test = file, {}, None

  def visit_FunctionDef(self, node):
    if self.test is None and node.name.startswith("test_"):
      self.test = node.name
      self.expected[node.name] = []
      self.generic_visit(node)
      self.test = None
      return node
    return self.generic_visit(node)

  def _probe(self, expr, want, strict: bool, node):
    exp = self.expected[self.test]
    exp.append(Expected(len(exp), want, strict))
    call = ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(len(exp) - 1), expr], [])
    return ast.copy_location(ast.Expr(call), node)

  def _literal(self, node):
    try:
      return ast.literal_eval(node)
    except ValueError as e:
      raise NotValueChecks(f"{self.file}::{self.test}: expected value {ast.unparse(node)!r} "
                           "is not a literal") from e

  def visit_Expr(self, node):
    call = node.value
    if (self.test and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        and call.func.id == "check"):
      if len(call.args) != 2 or call.keywords:
        raise NotValueChecks(f"{self.file}::{self.test}: check() takes (got, want)")
      return self._probe(call.args[0], self._literal(call.args[1]), True, node)
    return self.generic_visit(node)

  def visit_Assert(self, node):
    if not self.test:
      return node
    t = node.test
    if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
      return self._probe(t.left, self._literal(t.comparators[0]), False, node)
    return self._probe(t, True, False, node)


# CPython 3.11's ast.parse keeps its recursion depth in interpreter-wide state: two threads parsing
# at once can fail with "SystemError: AST constructor recursion depth mismatch" (gh-106905). The
# rollout workers grade episodes in a thread pool, and one such error ended an RL run.
_PARSE_LOCK = threading.Lock()


def parse(source: str) -> ast.Module:
  """``ast.parse`` under a process-wide lock (see above); the graders' only way to parse."""
  with _PARSE_LOCK:
    return ast.parse(source)


def split_checks(source: str, file: str = "<test>") -> tuple[str, dict[str, list[Expected]]]:
  """``source`` with its checks turned into probes, and each test's expected values in order."""
  rw = _Rewrite(file)
  tree = rw.visit(parse(source))
  if not rw.expected:
    raise NotValueChecks(f"{file}: no test function")
  empty = [t for t, e in rw.expected.items() if not e]
  if empty:
    raise NotValueChecks(f"{file}::{empty[0]}: a test with no check cannot be graded by values")
  return ast.unparse(ast.fix_missing_locations(tree)) + "\n", rw.expected


# -- values as plain data -----------------------------------------------------------------------
# ``encode`` also runs inside the sandbox (it is part of PROBE_SOURCE), so it may import nothing.

def encode(v, depth: int = 0):
  """A JSON-able, tagged form of ``v``; exact builtin types only (a subclass is "other")."""
  t = type(v)
  if depth > 20:
    return ["other", "deep"]
  if v is None:
    return ["none"]
  if t is bool:
    return ["bool", v]
  if t is int:
    return ["int", str(v)]
  if t is float:
    return ["float", repr(v)]
  if t is str:
    return ["str", v]
  if t is bytes:
    return ["bytes", v.hex()]
  if t in (list, tuple, set, frozenset):
    items = list(v)
    if t in (set, frozenset):
      items.sort(key=repr)
    return [t.__name__, [encode(x, depth + 1) for x in items]]
  if t is dict:
    return ["dict", [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]]
  return ["other", t.__name__]


class _Other:
  """What a value that is not plain data decodes to: equal to nothing, itself included."""

  def __eq__(self, other):
    return False

  __hash__ = object.__hash__


def decode(x, depth: int = 0):
  """``encode``'s inverse on the host; anything malformed (or nested deeper than ``encode`` goes)
  is an ``_Other``."""
  if depth > 21:
    return _Other()
  try:
    tag = x[0]
    if tag == "none":
      return None
    if tag == "bool" and type(x[1]) is bool:
      return x[1]
    if tag == "int":
      return int(x[1])
    if tag == "float":
      return float(x[1])
    if tag == "str" and type(x[1]) is str:
      return x[1]
    if tag == "bytes" and type(x[1]) is str:
      return bytes.fromhex(x[1])
    if tag in ("list", "tuple", "set", "frozenset"):
      items = [decode(i, depth + 1) for i in x[1]]
      return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict":
      return {decode(k, depth + 1): decode(v, depth + 1) for k, v in x[1]}
  except (TypeError, ValueError, IndexError, KeyError):
    pass
  return _Other()


def is_plain(got) -> bool:
  """``got`` was plain data in the sandbox (not ``decode``'s stand-in for anything else)."""
  return not isinstance(got, _Other)


def matches(got, e: Expected) -> bool:
  if not is_plain(got):
    return False
  if e.strict and type(got) is not type(e.want):
    return False
  try:
    return (got == e.want) is True  # plain data on both sides: builtin equality, as the assert had
  except Exception:  # noqa: BLE001
    return False


def outcomes(expected: dict[str, dict[str, list[Expected]]], results: dict) -> dict[str, str]:
  """{node id: passed|failed|error} for every expected test; ``results`` is the probe's JSON
  (``{file: {test: {"status": "ok"|"error", "values": [[index, encoded], ...]}}}``), which the
  code under test could have written: it is read as a claim about values and nothing more."""
  out = {}
  for file, tests in expected.items():
    got_file = results.get(file) if isinstance(results, dict) else None
    for test, exp in tests.items():
      nid = f"{file}::{test}"
      rec = got_file.get(test) if isinstance(got_file, dict) else None
      if not isinstance(rec, dict):
        out[nid] = "error"
        continue
      out[nid] = _outcome(exp, recorded(rec), rec.get("status") == "ok")
  return out


def checks_right(expected: dict[str, dict[str, list[Expected]]], results: dict,
                 files) -> dict[str, int]:
  """How many single checks of ``files``' tests saw only right values: {"passed", "total"}.

  Partial credit reads this over the hidden test files: each check there is a value for an input
  the agent never saw, so the share is how much of the function is right and cannot be earned by
  returning the visible tests' values (except where a hidden input repeats a visible one)."""
  right = total = 0
  for file in files:
    got_file = results.get(file) if isinstance(results, dict) else None
    for test, exp in expected.get(file, {}).items():
      rec = got_file.get(test) if isinstance(got_file, dict) else None
      seen = recorded(rec) if isinstance(rec, dict) else {}
      total += len(exp)
      right += sum(bool(seen.get(e.index)) and all(matches(g, e) for g in seen[e.index]) for e in exp)
  return {"passed": right, "total": total}


def recorded(rec: dict) -> dict[int, list]:
  """{probe index: the decoded values it recorded} from one test's record (malformed items skipped)."""
  seen: dict[int, list] = {}
  values = rec.get("values")
  for item in values if isinstance(values, list) else []:
    if isinstance(item, list) and len(item) == 2 and type(item[0]) is int:
      seen.setdefault(item[0], []).append(decode(item[1]))
  return seen


def _outcome(exp: list[Expected], seen: dict, ran_through: bool) -> str:
  """As the assert-based run would say: the first check (in order) that is wrong is a failure, one
  never reached is an error when the test raised before it."""
  for e in exp:
    if not seen.get(e.index):
      return "failed" if ran_through else "error"
    if not all(matches(g, e) for g in seen[e.index]):
      return "failed"
  return "passed" if ran_through else "error"


def read_results(path: str) -> dict | None:
  """The probe's JSON, or None when it is missing, too big, not JSON or not a regular file (the code
  under test shares the probe's process, so it can put a link or a FIFO in the file's place)."""
  blob = read_regular(path, MAX_RESULT_BYTES)
  if blob is None:
    return None
  try:
    data = json.loads(blob)
  except (ValueError, UnicodeDecodeError, RecursionError):  # e.g. '[' * 10**5: written by the code
    return None
  return data if isinstance(data, dict) else None


PROBE_SOURCE = r'''"""Runs rewritten test files and records the values their checks saw (composer_jax grading)."""
import builtins
import json
import os
import signal
import sys

PER_TEST_S = 1


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout("test took too long")


''' + inspect.getsource(encode) + r'''


def main():
    out_path, here, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    del sys.argv[1:]
    sys.path.insert(0, here)
    signal.signal(signal.SIGALRM, _alarm)
    results = {}
    current = []

    def probe(i, v):
        current.append([i, encode(v)])
        return v

    builtins.__cj_probe__ = probe
    for file in files:
        module = file[:-3]
        recs = results.setdefault(file, {})
        try:
            signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
            ns = vars(__import__(module))
        except BaseException:  # noqa: B036 - SystemExit from the code under test too
            continue
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for name in [n for n in list(ns) if n.startswith("test_") and callable(ns[n])]:
            current = []
            status = "ok"
            try:
                signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
                ns[name]()
            except BaseException:  # noqa: B036
                status = "error"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            recs[name] = {"status": status, "values": current}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
'''

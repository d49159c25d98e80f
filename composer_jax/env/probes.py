"""Value probes for report-graded tasks: a FAIL_TO_PASS test's expected literals stay on the host.

Tasks from real repositories are graded from pytest's report (``grader="junit"``). The code under
test runs in pytest's process, so it can write that report itself, or read the tests and answer from
their asserts (``tests/env/test_oracle.py``: ``FORGE_REPORT``, ``READ_TESTS``). A second run that
only looks for something a forgery gets wrong (stop 57's canaries: a changed literal that no right
code passes) is beaten by code that forges only the first run: it can tell a second run by its
arguments, and left honest there it fails the changed assert as the grader hopes.

So a second run here asks for what only right code has. When the report resolves the task, its
FAIL_TO_PASS tests run again in a fresh grading copy whose test files were rewritten on the host:
every ``assert E == LITERAL`` and unittest ``self.assertEqual(E, LITERAL)`` in a test function
becomes ``__cj_probe__(i, E)``, and the literal stays on the host (``rewrite``). A pytest plugin
written by the grader (``plugin_source``) records each probed value as plain data under the running
test's node id; the host compares them with the literals (``verdict``). Code under test that forges
this run's channel still has to name the right values, for inputs whose expected results it never
sees: the forged report is worth nothing without solving the tests.

A probe counts only where the reference solution passes it: the same rewritten tests are run on the
task's start with the gold files over it, once per task and process (``reference``). A probe whose
reference value is not plain data (a ``Decimal``, an object with its own ``==``), or that the
reference never reaches, is set aside, so an honest answer is never held to a check the reference
itself fails. Tests with no literal assert, or only such set-aside ones, are graded by the report
alone; ``details["probes"]`` says which were checked.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import threading

from composer_jax.env import oracle
from composer_jax.env.guards import read_regular

PROBE = oracle.PROBE
MAX_VALUES = 10_000  # probed values recorded a test (a loop over a probe is not a flood)
MAX_VALUES_BYTES = 16 << 20  # the values file is read back only up to this size


@dataclasses.dataclass(frozen=True)
class Probe:
  test: str  # node id without parametrisation: "tests/test_a.py::TestX::test_y"
  index: int  # its number in that test function, in source order
  want: object  # the literal, evaluated on the host


_NOT = object()


def _value(node: ast.AST):
  """``node``'s value if it is a literal (``ast.literal_eval``), else ``_NOT``."""
  if isinstance(node, ast.Constant) and node.value is Ellipsis:
    return _NOT
  try:
    return ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    return _NOT


def _sides(node: ast.AST) -> tuple[ast.AST, ast.AST] | None:
  """The two sides of ``assert A == B`` or ``self.assertEqual(A, B[, msg])``, else None."""
  if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare):
    cmp = node.test
    if len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Eq):
      return cmp.left, cmp.comparators[0]
  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
    call = node.value
    if (isinstance(call.func, ast.Attribute) and call.func.attr in ("assertEqual", "assertEquals")
            and 2 <= len(call.args) <= 3 and not call.keywords):
      return call.args[0], call.args[1]
  return None


def _split(node: ast.AST) -> tuple[ast.AST, object] | None:
  """(the computed side, the expected literal) of a comparison statement, the right side preferred
  as the literal; None when neither or both sides are literals."""
  sides = _sides(node)
  if sides is None:
    return None
  a, b = sides
  va, vb = _value(a), _value(b)
  if vb is not _NOT and va is _NOT:
    return a, vb
  if va is not _NOT and vb is _NOT:
    return b, va
  return None


def test_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
  """Test functions by the name pytest's node id gives them (``test_f`` or ``TestX::test_f``)."""
  out = {}
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
      out[node.name] = node
    elif isinstance(node, ast.ClassDef):
      out.update({f"{node.name}::{f.name}": f for f in node.body
                  if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and f.name.startswith("test")})
  return out


def _offsets(text: str):
  """A function from an AST (line, UTF-8 byte column) to a character offset in ``text``."""
  lines = text.splitlines(keepends=True)
  starts = [0]
  for line in lines:
    starts.append(starts[-1] + len(line))

  def at(lineno: int, col: int) -> int:
    return starts[lineno - 1] + len(lines[lineno - 1].encode("utf-8")[:col].decode("utf-8", "replace"))
  return at


def rewrite(text: str, file: str) -> tuple[str, list[Probe]] | None:
  """``text`` (a test file) with every literal comparison in its test functions turned into a probe,
  and the probes; None when the file does not parse, or would not after the rewrite. Line numbers
  stay where they were (the probe call keeps the statement's newlines inside its parentheses)."""
  try:
    tree = oracle.parse(text)
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return None
  at, edits, probes = _offsets(text), [], []
  for name, fn in test_functions(tree).items():
    found = sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Assert, ast.Expr))),
                   key=lambda n: (n.lineno, n.col_offset))
    for stmt in found:
      split = _split(stmt)
      if split is None:
        continue
      expr, want = split
      src = ast.get_source_segment(text, expr)
      if src is None:
        continue
      i = sum(p.test == f"{file}::{name}" for p in probes)
      pad = "\n" * ((stmt.end_lineno - stmt.lineno) - (expr.end_lineno - expr.lineno))
      edits.append((at(stmt.lineno, stmt.col_offset), at(stmt.end_lineno, stmt.end_col_offset),
                    f"{PROBE}({i}, ({src}){pad})"))
      probes.append(Probe(f"{file}::{name}", i, want))
  for start, end, new in sorted(edits, reverse=True):
    text = text[:start] + new + text[end:]
  try:
    oracle.parse(text)
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return None
  return text, probes


# -- the sandbox side ---------------------------------------------------------------------------
# ``plain`` runs inside the sandbox (it is part of the plugin's source), so it may import nothing.

def plain(v, depth: int = 0):
  """``v`` as exact builtin data where it stands for such data: subclasses of the builtin scalars
  and containers (an ``IntEnum``, ``numpy.float64``, a namedtuple, an ``OrderedDict``) as their
  base type, and anything with a ``tolist()`` (numpy scalars and arrays) as what that returns. Nothing here can make a wrong value
  right: the expected one is not in the sandbox."""
  t = type(v)
  if depth > 20 or v is None or t in (bool, int, float, str, bytes):
    return v
  try:
    for base in (bool, int, float, str, bytes):
      if isinstance(v, base):
        return base(v) if base is not str else str.__str__(v)
    if isinstance(v, bytearray):
      return bytes(v)
    for base in (list, tuple, set, frozenset):  # a namedtuple is a tuple, as == says
      if isinstance(v, base):
        return base(plain(x, depth + 1) for x in v)
    if isinstance(v, dict):  # an OrderedDict, a defaultdict
      return {plain(k, depth + 1): plain(x, depth + 1) for k, x in v.items()}
    tolist = getattr(t, "tolist", None)
    if callable(tolist):
      return plain(tolist(v), depth + 1)
  except Exception:  # noqa: BLE001 - the code under test's own methods ran; it is not plain data
    pass
  return v


_PLUGIN = r'''"""Records the values of the probed comparisons in the tests pytest runs (composer_jax grading)."""
import builtins
import json

import pytest

OUT = {out!r}
MAX_VALUES = {max_values}
_values = {{}}
_current = [None]

''' + "{plain}\n\n{encode}" + r'''


def __cj_probe__(i, v):
    key = _current[0]
    if key is not None:
        rec = _values.setdefault(key, [])
        if len(rec) < MAX_VALUES:
            rec.append([i, encode(plain(v))])


builtins.__cj_probe__ = __cj_probe__


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[0] = item.nodeid
    try:
        yield
    finally:
        _current[0] = None


def pytest_sessionfinish(session, exitstatus):
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(_values, f)
'''


def plugin_source(out_path: str) -> str:
  """The pytest plugin (``-p``) that records the probed values to ``out_path``."""
  return _PLUGIN.format(out=out_path, max_values=MAX_VALUES, plain=inspect.getsource(plain),
                        encode=inspect.getsource(oracle.encode))


# -- the host side ------------------------------------------------------------------------------

def read_values(path: str) -> dict[str, dict[int, list]]:
  """{node id: {probe index: decoded values}} from the plugin's file; {} when it is missing or
  malformed (the code under test could have written it: it is a claim about values, no more)."""
  blob = read_regular(path, MAX_VALUES_BYTES)
  data = None
  if blob is not None:
    try:
      data = json.loads(blob)
    except (ValueError, UnicodeDecodeError, RecursionError):
      data = None
  out: dict[str, dict[int, list]] = {}
  for nid, rec in (data.items() if isinstance(data, dict) else ()):
    if isinstance(nid, str) and isinstance(rec, list):
      out[nid] = oracle.recorded({"values": rec})
  return out


def base_id(nid: str) -> str:
  return nid.split("[", 1)[0]


def right(probe: Probe, seen: list) -> bool:
  """Every value ``probe`` recorded equals its literal (plain data on both sides)."""
  e = oracle.Expected(probe.index, probe.want, False)
  return bool(seen) and all(oracle.matches(g, e) for g in seen)


def sound(probes: list[Probe], f2p: list[str], outcomes: dict[str, str],
          values: dict[str, dict[int, list]]) -> dict[str, list[int]]:
  """From the reference's run: {FAIL_TO_PASS node id: the indices of its probes that the reference
  reached with the right value, in a test it passed}. Tests with none are left out."""
  by_test: dict[str, list[Probe]] = {}
  for p in probes:
    by_test.setdefault(p.test, []).append(p)
  out = {}
  for nid in f2p:
    if outcomes.get(nid) != "passed":
      continue
    seen = values.get(nid, {})
    ok = [p.index for p in by_test.get(base_id(nid), []) if right(p, seen.get(p.index, []))]
    if ok:
      out[nid] = ok
  return out


def verdict(probes: list[Probe], checked: dict[str, list[int]], outcomes: dict[str, str],
            values: dict[str, dict[int, list]]) -> list[str]:
  """The node ids of ``checked`` (``sound``'s) that the agent's run got wrong: not reported passed,
  or a probe the reference passed not reached, or reached with another value."""
  want = {(p.test, p.index): p for p in probes}
  wrong = []
  for nid, indices in checked.items():
    seen = values.get(nid, {})
    if outcomes.get(nid) != "passed" or not all(
        right(want[(base_id(nid), i)], seen.get(i, [])) for i in indices):
      wrong.append(nid)
  return wrong


class ReferenceCache:
  """The reference's ``sound`` probes by task, computed once per process (graders run in threads:
  a task's first grading computes them while the others wait)."""

  def __init__(self):
    self._lock, self._done, self._busy = threading.Lock(), {}, {}

  def get(self, key, compute):
    with self._lock:
      if key in self._done:
        return self._done[key]
      ev = self._busy.get(key)
      mine = ev is None
      if mine:
        ev = self._busy[key] = threading.Event()
    if not mine:
      ev.wait()
      with self._lock:
        if key in self._done:
          return self._done[key]
      return compute()  # the first try raised: try again here
    try:
      value = compute()
      with self._lock:
        self._done[key] = value
      return value
    finally:
      with self._lock:
        self._busy.pop(key, None)
      ev.set()


def reference_key(task, files: list[str]) -> tuple:
  """What the reference's probes depend on: the task store and its protected test files' bytes."""
  stamp = []
  for rel in files:
    try:
      st = os.stat(os.path.join(task.protected_dir, rel))
      stamp.append((rel, st.st_size, st.st_mtime_ns))
    except OSError:
      stamp.append((rel, None, None))
  return (task.path, task.instance_id, tuple(task.FAIL_TO_PASS), tuple(stamp))

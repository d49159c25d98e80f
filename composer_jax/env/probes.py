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
  want: object  # the literal, evaluated on the host (None where ``arg`` is set)
  arg: str | None = None  # the expected value is this parametrize argument ...
  rows: tuple = ()  # ... whose literal in row k of its decorator is rows[k]

  def want_at(self, indices: dict[str, int]):
    """The expected value in the test instance whose parametrize rows are ``indices``
    ({argname: row}); ``_NOT`` if none."""
    if self.arg is None:
      return self.want
    k = indices.get(self.arg)
    return self.rows[k] if type(k) is int and 0 <= k < len(self.rows) else _NOT


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


def _split(node: ast.AST, params=frozenset()) -> tuple[ast.AST, object, ast.AST] | None:
  """(the computed side, the expected literal, the expected side) of a comparison statement, the
  right side preferred as the expected one; None when neither or both sides are literals. A bare
  name in ``params`` (a parametrize argument whose column is all literals) is expected too, and
  stands for itself: its literals are the rows'."""
  sides = _sides(node)
  if sides is None:
    return None

  def expected(side):
    if isinstance(side, ast.Name) and side.id in params:
      return side
    return _value(side)
  a, b = sides
  va, vb = expected(a), expected(b)
  if vb is not _NOT and va is _NOT:
    return a, vb, b
  if va is not _NOT and vb is _NOT:
    return b, va, a
  return None


# -- expected values from @pytest.mark.parametrize -----------------------------------------------
# ``@pytest.mark.parametrize("x, want", [(1, 2), (2, 3)])`` over ``assert f(x) == want``: the
# ``want`` column is in the decorator, and pytest's node ids (``test_f[1-2]``) spell every column.
# The rewrite replaces the column's literals by their row numbers and gives the decorator opaque
# ids (``cj0``, ``cj1``, ...). The plugin records each instance's row in each of its decorators
# (``_rows``), and the host finds each FAIL_TO_PASS instance in the rewritten run by its rows,
# collected from the original files in the reference's workspace. (pytest's own
# ``callspec.indices`` count the product of stacked decorators, not rows; its ids cannot be
# recomputed on the host: ``test_f[2_0]``, ``test_f[0-4-want1]``.)

@dataclasses.dataclass
class _Column:
  arg: str
  deco: ast.Call
  rows: list  # the row nodes, in the decorator or in a module-level case list
  cells: list  # the column's node in each row
  values: tuple  # their literals


def case_lists(tree: ast.Module) -> dict[str, ast.AST]:
  """Module-level ``CASES = [...]`` (or a tuple) whose name is bound once and read once in the
  file, as the rows of a ``parametrize`` decorator: {name: the list's node}. The rewrite may hide
  a column in it, since no other reader in the file sees the change."""
  bound = {}
  for node in tree.body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, (ast.List, ast.Tuple))):
      bound[node.targets[0].id] = node.value
  if not bound:
    return {}
  uses: dict[str, int] = {}
  for n in ast.walk(tree):
    if isinstance(n, ast.Name) and n.id in bound:
      uses[n.id] = uses.get(n.id, 0) + 1  # the binding itself is one
    elif isinstance(n, (ast.Global, ast.Nonlocal)):
      for name in n.names:
        uses[name] = uses.get(name, 0) + 2
  rows_of = set()
  for n in ast.walk(tree):
    if (isinstance(n, ast.Call) and _attr(n.func) == "parametrize" and len(n.args) == 2
        and isinstance(n.args[1], ast.Name)):
      rows_of.add(n.args[1].id)
  return {k: v for k, v in bound.items() if uses.get(k) == 2 and k in rows_of}


def _param_rows(call: ast.Call, lists: dict[str, ast.AST]):
  """(argnames, [(row node, [cell nodes])], the rows' node) of a ``parametrize`` decorator whose
  rows are written in it or in one of ``lists`` (``case_lists``); None for any other form (rows
  built by code, ``indirect=``, starred rows)."""
  if len(call.args) != 2 or any(k.arg in (None, "indirect") for k in call.keywords):
    return None
  names, rows = call.args
  if isinstance(rows, ast.Name):
    rows = lists.get(rows.id)
  names_v = _value(names)
  if isinstance(names_v, str):
    argnames = [x.strip() for x in names_v.split(",") if x.strip()]
    single = len(argnames) == 1
  elif isinstance(names_v, (list, tuple)) and all(isinstance(x, str) for x in names_v):
    argnames, single = list(names_v), False
  else:
    return None
  if not isinstance(rows, (ast.List, ast.Tuple)) or not argnames:
    return None
  out = []
  for row in rows.elts:
    if isinstance(row, ast.Call) and _attr(row.func) == "param":  # pytest.param(*cells, marks=, id=)
      cells = row.args
    elif single:
      cells = [row]
    elif isinstance(row, (ast.List, ast.Tuple)):
      cells = row.elts
    else:
      return None
    if len(cells) != len(argnames) or any(isinstance(c, ast.Starred) for c in cells):
      return None
    out.append((row, list(cells)))
  return argnames, out, rows


def _attr(node: ast.AST) -> str | None:
  return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def _columns(owner: ast.FunctionDef | ast.ClassDef, lists: dict[str, ast.AST]) -> dict[str, _Column]:
  """The parametrize arguments of a test function or class that can be probed: every row holds a
  literal in the column, and every use of the name in its body (a class's: every method's) is the
  expected side of a comparison statement."""
  cols = {}
  for deco in owner.decorator_list:
    if not (isinstance(deco, ast.Call) and _attr(deco.func) == "parametrize"):
      continue
    parsed = _param_rows(deco, lists)
    if parsed is None:
      continue
    argnames, rows, node = parsed
    for j, arg in enumerate(argnames):
      values = tuple(_value(cells[j]) for _, cells in rows)
      if rows and all(v is not _NOT for v in values):
        cols[arg] = _Column(arg, deco, node.elts, [cells[j] for _, cells in rows], values)
  if not cols:
    return {}
  body = [n for stmt in owner.body for n in ast.walk(stmt)]
  sides = set()
  for stmt in body:
    split = _split(stmt, frozenset(cols)) if isinstance(stmt, (ast.Assert, ast.Expr)) else None
    if split is not None and isinstance(split[2], ast.Name):
      sides.add(id(split[2]))
  for n in body:  # a use elsewhere (``len(want)``, a rebinding) keeps the column as it is
    if isinstance(n, ast.Name) and n.id in cols and id(n) not in sides:
      cols.pop(n.id)
  return cols


def _column_edits(at, text: str, cols: dict[str, _Column]) -> list[tuple[int, int, str]]:
  """The edits that hide ``cols``' literals: its row number in each cell (newlines kept) and opaque
  ids on each decorator they are in, including a ``pytest.param``'s own ``id=``."""
  edits, decos = [], {}
  for col in cols.values():
    decos[id(col.deco)] = col
    for k, cell in enumerate(col.cells):
      pad = "\n" * (cell.end_lineno - cell.lineno)
      edits.append((at(cell.lineno, cell.col_offset), at(cell.end_lineno, cell.end_col_offset),
                    f"({k}{pad})"))
  for col in decos.values():
    deco, rows = col.deco, col.rows
    ids = "[" + ", ".join(f"'cj{k}'" for k in range(len(rows))) + "]"
    for k, row in enumerate(rows):
      for kw in (row.keywords if isinstance(row, ast.Call) else ()):
        if kw.arg == "id":
          v = kw.value
          pad = "\n" * (v.end_lineno - v.lineno)
          edits.append((at(v.lineno, v.col_offset), at(v.end_lineno, v.end_col_offset), f"('cj{k}'{pad})"))
    given = next((kw.value for kw in deco.keywords if kw.arg == "ids"), None)
    if given is not None:
      pad = "\n" * (given.end_lineno - given.lineno)
      edits.append((at(given.lineno, given.col_offset), at(given.end_lineno, given.end_col_offset),
                    f"({ids}{pad})"))
    else:
      last = deco.keywords[-1].value if deco.keywords else deco.args[-1]
      end = at(last.end_lineno, last.end_col_offset)
      edits.append((end, end, f", ids={ids}"))
  return edits


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
  at, edits, probes, lists = _offsets(text), [], [], case_lists(tree)
  classes = {c.name: _columns(c, lists) for c in tree.body if isinstance(c, ast.ClassDef)}
  for cols in classes.values():
    edits += _column_edits(at, text, cols)
  for name, fn in test_functions(tree).items():
    own = _columns(fn, lists)
    edits += _column_edits(at, text, own)
    cols = {**classes.get(name.split("::")[0] if "::" in name else None, {}), **own}
    found = sorted((n for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, (ast.Assert, ast.Expr))),
                   key=lambda n: (n.lineno, n.col_offset))
    for stmt in found:
      split = _split(stmt, frozenset(cols))
      if split is None:
        continue
      expr, want, _ = split
      src = ast.get_source_segment(text, expr)
      if src is None:
        continue
      i = sum(p.test == f"{file}::{name}" for p in probes)
      pad = "\n" * ((stmt.end_lineno - stmt.lineno) - (expr.end_lineno - expr.lineno))
      edits.append((at(stmt.lineno, stmt.col_offset), at(stmt.end_lineno, stmt.end_col_offset),
                    f"{PROBE}({i}, ({src}){pad})"))
      if isinstance(want, ast.Name):
        probes.append(Probe(f"{file}::{name}", i, None, want.id, cols[want.id].values))
      else:
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
_items = {{}}
_current = [None]

''' + "{plain}\n\n{encode}" + r'''


def __cj_probe__(i, v):
    key = _current[0]
    if key is not None:
        rec = _values.setdefault(key, [])
        if len(rec) < MAX_VALUES:
            rec.append([i, encode(plain(v))])


builtins.__cj_probe__ = __cj_probe__


_ParameterSet = type(pytest.param(None))


def _rows(item):
    """{{argname: its row in its parametrize decorator}}, the rows found by the identity of the
    instance's values (pytest passes the decorator's own objects); None where one is not found."""
    spec = getattr(item, "callspec", None)
    out = {{}}
    for mark in (item.iter_markers("parametrize") if spec is not None else ()):
        names = mark.kwargs.get("argnames", mark.args[0] if mark.args else None)
        rows = mark.kwargs.get("argvalues", mark.args[1] if len(mark.args) > 1 else None)
        single = isinstance(names, str) and len([x for x in names.split(",") if x.strip()]) == 1
        names = [x.strip() for x in names.split(",") if x.strip()] if isinstance(names, str) else list(names or ())
        if not names or not all(n in spec.params for n in names):
            continue
        for r, row in enumerate(rows if isinstance(rows, (list, tuple)) else ()):
            cells = row.values if isinstance(row, _ParameterSet) else (row,) if single else row
            if (isinstance(cells, (list, tuple)) and len(cells) == len(names)
                    and all(spec.params[n] is c for n, c in zip(names, cells))):
                out.update(dict.fromkeys(names, r))
                break
        else:
            return None
    return out


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        try:
            _items[item.nodeid] = _rows(item)
        except Exception:
            _items[item.nodeid] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[0] = item.nodeid
    try:
        yield
    finally:
        _current[0] = None


def pytest_sessionfinish(session, exitstatus):
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump({{"values": _values, "items": _items}}, f)
'''


def plugin_source(out_path: str) -> str:
  """The pytest plugin (``-p``) that records the probed values to ``out_path``."""
  return _PLUGIN.format(out=out_path, max_values=MAX_VALUES, plain=inspect.getsource(plain),
                        encode=inspect.getsource(oracle.encode))


# -- the host side ------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
  """What one probed run's plugin wrote: a claim about values, no more (the code under test could
  have written it)."""
  values: dict[str, dict[int, list]] = dataclasses.field(default_factory=dict)  # {node id: {probe: [values]}}
  items: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # {node id: {arg: row}}


def read_run(path: str) -> Run:
  """The plugin's file as a ``Run``; empty where it is missing or malformed."""
  blob = read_regular(path, MAX_VALUES_BYTES)
  data = None
  if blob is not None:
    try:
      data = json.loads(blob)
    except (ValueError, UnicodeDecodeError, RecursionError):
      data = None
  data = data if isinstance(data, dict) else {}
  run = Run()
  values, items = data.get("values"), data.get("items")
  for nid, rec in (values.items() if isinstance(values, dict) else ()):
    if isinstance(nid, str) and isinstance(rec, list):
      run.values[nid] = oracle.recorded({"values": rec})
  for nid, ix in (items.items() if isinstance(items, dict) else ()):
    if isinstance(nid, str) and isinstance(ix, dict) and all(
        isinstance(k, str) and type(v) is int for k, v in ix.items()):
      run.items[nid] = ix  # an instance whose rows were not all found is left out
  return run


def base_id(nid: str) -> str:
  return nid.split("[", 1)[0]


def _key(nid: str, indices: dict[str, int]) -> tuple:
  return base_id(nid), tuple(sorted(indices.items()))


def by_test(f2p: list[str], params: dict[str, dict[str, int]], outcomes: dict[str, str],
            run: Run) -> tuple[dict[str, str], dict[str, dict[int, list]]]:
  """The run's outcomes and values under the FAIL_TO_PASS node ids. An instance whose parametrize
  ids the rewrite made opaque is found by its rows (``params``, from collecting the original
  files); an id ``params`` does not hold is its own (the rewrite kept it)."""
  where = {_key(n, ix): n for n, ix in run.items.items() if ix is not None}
  outs, vals = {}, {}
  for nid in f2p:
    got = where.get(_key(nid, params[nid])) if nid in params else nid
    if got is not None:
      outs[nid], vals[nid] = outcomes.get(got), run.values.get(got, {})
  return outs, vals


def right(probe: Probe, seen: list, indices: dict[str, int] | None = None) -> bool:
  """Every value ``probe`` recorded, in the test instance with these parametrize rows, equals its
  expected literal (plain data on both sides)."""
  want = probe.want_at(indices or {})
  if want is _NOT:
    return False
  e = oracle.Expected(probe.index, want, False)
  return bool(seen) and all(oracle.matches(g, e) for g in seen)


def sound(probes: list[Probe], f2p: list[str], outcomes: dict[str, str],
          values: dict[str, dict[int, list]],
          params: dict[str, dict[str, int]] | None = None) -> dict[str, list[int]]:
  """From the reference's run (``by_test``'s view): {FAIL_TO_PASS node id: the indices of its
  probes that the reference reached with the right value, in a test it passed}. Tests with none
  are left out."""
  params = params or {}
  grouped: dict[str, list[Probe]] = {}
  for p in probes:
    grouped.setdefault(p.test, []).append(p)
  out = {}
  for nid in f2p:
    if outcomes.get(nid) != "passed":
      continue
    seen = values.get(nid, {})
    ok = [p.index for p in grouped.get(base_id(nid), [])
          if right(p, seen.get(p.index, []), params.get(nid))]
    if ok:
      out[nid] = ok
  return out


def verdict(probes: list[Probe], checked: dict[str, list[int]], outcomes: dict[str, str],
            values: dict[str, dict[int, list]],
            params: dict[str, dict[str, int]] | None = None) -> list[str]:
  """The node ids of ``checked`` (``sound``'s) that the agent's run got wrong: not reported passed,
  or a probe the reference passed not reached, or reached with another value."""
  params = params or {}
  want = {(p.test, p.index): p for p in probes}
  wrong = []
  for nid, indices in checked.items():
    seen = values.get(nid, {})
    if outcomes.get(nid) != "passed" or not all(
        right(want[(base_id(nid), i)], seen.get(i, []), params.get(nid)) for i in indices):
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

"""The host's rewrite of a test file for value probes (``env/probes.py`` says why): each literal
comparison in a test function becomes ``__cj_probe__(i, E)`` and its expected value a ``Probe``.

Expected values come from the literal in the comparison itself, a parametrize column (in the
decorator, a module-level case list or the test class's decorator), or a name bound once to a
literal (a local, or a module constant that only the tests compare with). A name is hidden only
when every use of it is the expected side of a comparison, so the rewritten file computes what the
original did and only the expected values leave it. The checks are ``==``, ``is`` against ``None``,
``True`` or ``False``, the other comparison operators (``!=``, ``<``, ``in``, ...) and unittest's
methods for them (``assertLess``, ``assertIn``, ``assertIsNotNone``, ...), ``assertTrue`` /
``assertFalse`` (of a comparison with a literal side: as that comparison), numpy.testing's checks, ``pytest.approx`` and ``assertAlmostEqual``; a probe's
``how`` names its check, and the host redoes it (``probes._holds``).
"""

from __future__ import annotations

import ast
import dataclasses

from composer_jax.env import oracle

PROBE = oracle.PROBE


@dataclasses.dataclass(frozen=True)
class Probe:
  test: str  # node id without parametrisation: "tests/test_a.py::TestX::test_y"
  index: int  # its number in that test function, in source order
  want: object  # the literal, evaluated on the host (None where ``arg`` is set)
  arg: str | None = None  # the expected value is this parametrize argument ...
  rows: tuple = ()  # ... whose literal in row k of its decorator is rows[k]
  how: tuple = ("==",)  # the check: "==", "is" (the type must match too), "array"
  #   (``assert_array_equal``), ("close", rtol, atol, equal_nan) (``assert_allclose``),
  #   ("approx", rel, abs, nan_ok) (``== pytest.approx(...)``), ("almost", places, delta),
  #   ("np_equal",), ("np_almost", decimal), ("array_almost", decimal) (numpy.testing's),
  #   ("op", OP, side) (``assert E < 3``: side "right"; ``assert 3 in E``: "left", the literal first)

  def want_at(self, indices: dict[str, int]):
    """The expected value in the test instance whose parametrize rows are ``indices``
    ({argname: row}); ``_NOT`` if none."""
    if self.arg is None:
      return self.want
    k = indices.get(self.arg)
    return self.rows[k] if type(k) is int and 0 <= k < len(self.rows) else _NOT


_NOT = oracle.NOT_LITERAL


def _value(node: ast.AST):
  """``node``'s value if it is a literal (``oracle.literal``; a bare ``...`` is not), else ``_NOT``."""
  if isinstance(node, ast.Constant) and node.value is Ellipsis:
    return _NOT
  return oracle.literal(node)


_singleton = oracle.singleton


_CLOSE = ("rtol", "atol", "equal_nan", "err_msg", "verbose")  # assert_allclose's after the two


_NUMPY_CHECKS = ("assert_array_equal", "assert_allclose", "assert_equal", "assert_almost_equal",
                 "assert_array_almost_equal")
# numpy.testing's checks with a ``decimal``: the name, its default and how the host names it.
_DECIMAL = {"assert_almost_equal": (7, "np_almost"), "assert_array_almost_equal": (6, "array_almost")}


_OPS = oracle.OPS  # ``assert A OP B``: the host redoes OP (``oracle.holds``)


def _dotted(node: ast.AST) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    base = _dotted(node.value)
    return None if base is None else f"{base}.{node.attr}"
  return None


def mark_checks(tree: ast.Module) -> None:
  """Mark the calls that are ``numpy.testing``'s own checks (``np.testing.assert_allclose``,
  ``npt.assert_array_equal``, ``from numpy.testing import ...``) and ``pytest.approx``, as the
  file's imports spell them: a function of the same name from elsewhere
  (``torch.testing.assert_allclose``, with other default tolerances) is not one. ``_sides`` reads
  the mark."""
  spell = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name == "pytest":
          spell[f"{a.asname or 'pytest'}.approx"] = "approx"
        elif a.name == "numpy":
          spell.update({f"{a.asname or 'numpy'}.testing.{f}": f for f in _NUMPY_CHECKS})
        elif a.name == "numpy.testing":
          spell.update({f"{a.asname or 'numpy.testing'}.{f}": f for f in _NUMPY_CHECKS})
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      for a in node.names:
        if node.module == "pytest" and a.name == "approx":
          spell[a.asname or a.name] = "approx"
        elif node.module == "numpy" and a.name == "testing":
          spell.update({f"{a.asname or 'testing'}.{f}": f for f in _NUMPY_CHECKS})
        elif node.module == "numpy.testing" and a.name in _NUMPY_CHECKS:
          spell[a.asname or a.name] = a.name
  for node in ast.walk(tree) if spell else ():
    if isinstance(node, ast.Call) and _dotted(node.func) in spell:
      node.cj_check = spell[_dotted(node.func)]


def _numpy_check(call: ast.Call) -> tuple | None:
  """The ``how`` of ``numpy.testing.assert_array_equal(A, B)`` ("array"),
  ``assert_allclose(A, B[, rtol, atol, equal_nan])``, ``assert_equal`` ("np_equal"),
  ``assert_almost_equal`` and ``assert_array_almost_equal`` (with their ``decimal``), all with
  literal options; None for another call, or one whose options change what passes in a way the
  host cannot redo (``strict=``)."""
  name, n = getattr(call, "cj_check", None), len(call.args)
  if name == "assert_array_equal" and n >= 2:
    opts = _literal_options(call, ("err_msg", "verbose"), {}, 2)
    return None if opts is None else ("array",)
  if name == "assert_allclose" and n >= 2:
    opts = _literal_options(call, _CLOSE, {"rtol": 1e-7, "atol": 0, "equal_nan": True}, 2)
    return None if opts is None else ("close", opts["rtol"], opts["atol"], opts["equal_nan"])
  if name == "assert_equal" and n >= 2:  # numpy's: recursive, NaN equal to NaN
    opts = _literal_options(call, ("err_msg", "verbose"), {}, 2)
    return None if opts is None else ("np_equal",)
  if name in _DECIMAL and n >= 2:
    default, how = _DECIMAL[name]
    opts = _literal_options(call, ("decimal", "err_msg", "verbose"), {"decimal": default}, 2)
    return None if opts is None else (how, opts["decimal"])
  return None


def _literal_options(call: ast.Call, names: tuple, defaults: dict, first: int) -> dict | None:
  """``call``'s options (positional from argument ``first`` on, in the order of ``names``, or by
  keyword) that are in ``defaults``, over the defaults; None when one is not a literal or a
  keyword is not in ``names``."""
  kw = {k.arg: k.value for k in call.keywords}
  if None in kw or not set(kw) <= set(names) or len(call.args) > first + len(names):
    return None
  opts = dict(defaults)
  for k, v in [*zip(names, call.args[first:]), *kw.items()]:
    if k in opts:
      opts[k] = _value(v)
  return None if any(v is _NOT for v in opts.values()) else opts


def _approx(node: ast.AST) -> tuple[ast.AST, tuple] | None:
  """(the literal, how) of ``pytest.approx(LITERAL[, rel, abs, nan_ok])``; else None."""
  if not (isinstance(node, ast.Call) and getattr(node, "cj_check", None) == "approx" and node.args):
    return None
  opts = _literal_options(node, ("rel", "abs", "nan_ok"), {"rel": None, "abs": None, "nan_ok": False}, 1)
  return None if opts is None else (node.args[0], ("approx", opts["rel"], opts["abs"], opts["nan_ok"]))


def _sides(node: ast.AST) -> tuple[ast.AST, ast.AST, tuple] | None:
  """(A, B, how) of ``assert A == B``, ``self.assertEqual(A, B[, msg])``, the identity checks
  against ``None``, ``True`` or ``False`` (``assert A is None``, ``assertIs(A, True)``,
  ``assertIsNone(A)``: "is", as only that very value passes them), ``assertTrue(A)`` and
  ``assertFalse(A)`` ("truth": A's truth against True or False; of a comparison with a literal
  side, that comparison), ``assert A OP B`` for the other comparison operators (``!=``, ``<``,
  ``in``, ``is not``, ...: "op") and unittest's methods for them (``_UNITTEST_OPS``),
  ``A == pytest.approx(B)``, unittest's ``assertAlmostEqual``, and ``numpy.testing``'s ``assert_array_equal``,
  ``assert_allclose``, ``assert_equal``, ``assert_almost_equal`` and ``assert_array_almost_equal``
  (``_numpy_check``); else None."""
  if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare):
    cmp = node.test
    a, b = cmp.left, cmp.comparators[0]
    if len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Eq):
      for computed, other in ((a, b), (b, a)):
        approx = _approx(other)
        if approx is not None:  # E == pytest.approx(LITERAL): the literal is the expected side
          return computed, approx[0], approx[1]
      return a, b, ("==",)
    if len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Is) and (_singleton(a) or _singleton(b)):
      return a, b, ("is",)
    if len(cmp.ops) == 1 and type(cmp.ops[0]) in _OPS and (
        not isinstance(cmp.ops[0], ast.IsNot) or _singleton(a) or _singleton(b)):
      return a, b, ("op", _OPS[type(cmp.ops[0])])  # _split adds the literal's side
  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
    call, n = node.value, len(node.value.args)
    how = _numpy_check(call)
    if how is not None:
      return call.args[0], call.args[1], how
    if isinstance(call.func, ast.Attribute) and call.func.attr in ("assertAlmostEqual", "assertAlmostEquals"):
      opts = _literal_options(call, ("places", "msg", "delta"), {"places": None, "delta": None}, 2)
      if n >= 2 and opts is not None:
        return call.args[0], call.args[1], ("almost", opts["places"], opts["delta"])
    name = call.func.attr if isinstance(call.func, ast.Attribute) and not call.keywords else None
    if name in ("assertEqual", "assertEquals") and 2 <= n <= 3:
      return call.args[0], call.args[1], ("==",)
    if name == "assertIs" and 2 <= n <= 3 and (_singleton(call.args[0]) or _singleton(call.args[1])):
      return call.args[0], call.args[1], ("is",)
    if name == "assertIsNone" and 1 <= n <= 2:
      return call.args[0], ast.Constant(None), ("is",)
    if name in _UNITTEST_OPS and 2 <= n <= 3:  # assertLess(A, B) is ``assert A < B``
      return call.args[0], call.args[1], ("op", _UNITTEST_OPS[name])
    if name == "assertIsNot" and 2 <= n <= 3 and (_singleton(call.args[0]) or _singleton(call.args[1])):
      return call.args[0], call.args[1], ("op", "is not")
    if name == "assertIsNotNone" and 1 <= n <= 2:
      return call.args[0], ast.Constant(None), ("op", "is not")
    if name in ("assertTrue", "assertFalse") and 1 <= n <= 2:
      compared = _truth_of_comparison(call.args[0], name == "assertTrue")
      if compared is not None:
        return compared
      return call.args[0], ast.Constant(name == "assertTrue"), ("truth",)  # the probe records ``not not A``
  return None


# unittest's comparison methods, as the operator of ``assert A OP B``
_UNITTEST_OPS = {"assertNotEqual": "!=", "assertNotEquals": "!=", "assertLess": "<", "assertLessEqual": "<=",
                 "assertGreater": ">", "assertGreaterEqual": ">=", "assertIn": "in", "assertNotIn": "not in"}
# the operators whose negation is an operator (``not A == B`` is ``A != B`` on plain data; ``not A < B``
# is not ``A >= B`` for sets or NaN)
_NEGATED = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
            ast.IsNot: ast.Is}


def _truth_of_comparison(arg: ast.AST, truth: bool) -> tuple | None:
  """The sides of ``assertTrue(A OP B)`` as ``assert A OP B`` (``assertFalse``: the negated
  operator, where there is one) when one side is a literal, so that the bound leaves the file as
  it does from an ``assert``; else None (the probe records the truth)."""
  if not (isinstance(arg, ast.Compare) and len(arg.ops) == 1):
    return None
  op = type(arg.ops[0])
  if not truth:
    if op not in _NEGATED:
      return None
    op = _NEGATED[op]
  if _value(arg.left) is _NOT and _value(arg.comparators[0]) is _NOT:
    return None
  return _sides(ast.Assert(ast.Compare(arg.left, [op()], arg.comparators)))


def _split(node: ast.AST, params=frozenset()) -> tuple[ast.AST, object, ast.AST, tuple] | None:
  """(the computed side, the expected literal, the expected side, how) of a comparison statement,
  the right side preferred as the expected one; None when neither or both sides are literals, or
  when ``assert_allclose``'s literal is its first (its tolerance is relative to the second). A
  bare name in ``params`` (a parametrize argument whose column is all literals) is expected too,
  and stands for itself: its literals are the rows'."""
  sides = _sides(node)
  if sides is None:
    return None
  a, b, how = sides

  def expected(side):
    if isinstance(side, ast.Name) and side.id in params:
      return side
    return _value(side)
  va, vb = expected(a), expected(b)
  if vb is not _NOT and va is _NOT:
    return a, vb, b, how + ("right",) if how[0] == "op" else how
  if va is not _NOT and vb is _NOT and how[0] != "close":
    return b, va, a, how + ("left",) if how[0] == "op" else how
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
  binds = _bound(tree)  # the same count of bindings as for names bound to a literal
  loads: dict[str, int] = {}
  rows_of = set()
  for n in ast.walk(tree):
    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in bound:
      loads[n.id] = loads.get(n.id, 0) + 1
    elif (isinstance(n, ast.Call) and _attr(n.func) == "parametrize" and len(n.args) == 2
          and isinstance(n.args[1], ast.Name)):
      rows_of.add(n.args[1].id)
  return {k: v for k, v in bound.items() if binds.get(k) == 1 and loads.get(k) == 1 and k in rows_of}


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
  keep = _only_expected(owner, frozenset(cols))
  return {k: c for k, c in cols.items() if k in keep}


def _only_expected(owner: ast.AST, names: frozenset, allowed=frozenset(), tests=None) -> frozenset:
  """The ``names`` whose every mention in ``owner``'s body (but the nodes in ``allowed``) is the
  expected side of a comparison statement (in ``tests``' bodies, where given). A use elsewhere
  (``len(want)``, a rebinding, a comparison of two such names) keeps the name's literals where
  they are."""
  body = [n for stmt in owner.body for n in ast.walk(stmt)]
  sides = set(allowed)
  for stmt in body if tests is None else [n for t in tests for stmt in t.body for n in ast.walk(stmt)]:
    split = _split(stmt, names) if isinstance(stmt, (ast.Assert, ast.Expr)) else None
    if split is not None and isinstance(split[2], ast.Name):
      sides.add(id(split[2]))
  return names - {n.id for n in body if isinstance(n, ast.Name) and n.id in names and id(n) not in sides}


# -- expected values bound to a local -------------------------------------------------------------
# ``expected = {"a": 1}`` then ``assert f() == expected``: the literal sits in the function, not in
# the comparison. Such a local is hidden (its value becomes ``None``) when the function's own body
# binds it once, to a literal, and uses it only as the expected side.

def _bound(fn: ast.AST) -> dict[str, int]:
  """How many times ``fn`` binds each name: stores and deletes, parameters (its own and nested
  ones'), nested definitions, imports, ``except ... as``, ``global`` and ``nonlocal``."""
  out: dict[str, int] = {}
  for n in ast.walk(fn):
    names = ()
    if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
      names = (n.id,)
    elif isinstance(n, ast.arg):
      names = (n.arg,)
    elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
      names = (n.name,)
    elif isinstance(n, (ast.Import, ast.ImportFrom)):
      names = tuple((a.asname or a.name).split(".")[0] for a in n.names)
    elif isinstance(n, (ast.Global, ast.Nonlocal)):
      names = tuple(n.names) * 2
    elif isinstance(n, ast.ExceptHandler) and n.name:
      names = (n.name,)
    elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
      names = (n.name,)
    elif isinstance(n, ast.MatchMapping) and n.rest:
      names = (n.rest,)
    for name in names:
      out[name] = out.get(name, 0) + 1
  return out


def _constants(owner: ast.FunctionDef | ast.Module, known: frozenset,
               tests=None) -> dict[str, tuple[ast.AST, object]]:
  """{name: (the literal's node, its value)} for the names bound to a literal at the top of
  ``owner`` (a test function, or the module for ``tests``' comparisons) that can be probed;
  ``known``: the names already expected (parametrize columns)."""
  found = {}
  for stmt in owner.body:
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else (
        stmt.target if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else None)
    if isinstance(target, ast.Name) and target.id not in known:
      v = _value(stmt.value)
      if v is not _NOT:
        found[target.id] = (target, stmt.value, v)
  if not found:
    return {}
  bound = _bound(owner)
  found = {k: f for k, f in found.items() if bound.get(k) == 1}
  keep = _only_expected(owner, known | frozenset(found), frozenset(id(t) for t, _, _ in found.values()),
                        tests)
  return {k: (node, v) for k, (_, node, v) in found.items() if k in keep}


def _hide(at, consts: dict[str, tuple[ast.AST, object]]) -> list[tuple[int, int, str]]:
  """The edits that put ``None`` (newlines kept) where ``consts``' literals were."""
  return [(at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset),
           "(None" + "\n" * (node.end_lineno - node.lineno) + ")") for node, _ in consts.values()]


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
  mark_checks(tree)
  tests = test_functions(tree)
  classes = {c.name: _columns(c, lists) for c in tree.body if isinstance(c, ast.ClassDef)}
  own = {name: _columns(fn, lists) for name, fn in tests.items()}
  columns = frozenset(k for cols in [*classes.values(), *own.values()] for k in cols)
  module = _constants(tree, columns, list(tests.values()))  # EXPECTED = ... at the top of the file
  edits += _hide(at, module)
  for cols in [*classes.values(), *own.values()]:
    edits += _column_edits(at, text, cols)
  for name, fn in tests.items():
    cols = {**classes.get(name.split("::")[0] if "::" in name else None, {}), **own[name]}
    local = _constants(fn, frozenset(cols) | frozenset(module))
    edits += _hide(at, local)
    consts = {**module, **local}
    found = sorted((n for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, (ast.Assert, ast.Expr))),
                   key=lambda n: (n.lineno, n.col_offset))
    for stmt in found:
      split = _split(stmt, frozenset(cols) | frozenset(consts))
      if split is None:
        continue
      expr, want, _, how = split
      src = ast.get_source_segment(text, expr)
      if src is None:
        continue
      if how == ("truth",):  # assertTrue(A): A's truth, as the test took it (plain data whatever A is)
        src, how = f"not not ({src})", ("is", "truth")
      i = sum(p.test == f"{file}::{name}" for p in probes)
      pad = "\n" * ((stmt.end_lineno - stmt.lineno) - (expr.end_lineno - expr.lineno))
      edits.append((at(stmt.lineno, stmt.col_offset), at(stmt.end_lineno, stmt.end_col_offset),
                    f"{PROBE}({i}, ({src}){pad})"))
      if isinstance(want, ast.Name) and want.id in consts:
        probes.append(Probe(f"{file}::{name}", i, consts[want.id][1], how=how))
      elif isinstance(want, ast.Name):
        probes.append(Probe(f"{file}::{name}", i, None, want.id, cols[want.id].values, how))
      else:
        probes.append(Probe(f"{file}::{name}", i, want, how=how))
  for start, end, new in sorted(edits, reverse=True):
    text = text[:start] + new + text[end:]
  try:
    oracle.parse(text)
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return None
  return text, probes

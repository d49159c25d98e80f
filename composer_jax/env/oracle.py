"""Grading by values (``Task.grader = "values"``): the sandbox reports what the code computed, the
grader decides whether that is right.

A test run that imports the code under test runs that code in its own process, and that code can do
anything the runner can: write a report that says "passed" (the runner's report path is a frame
away), exit before the asserts, or read the hidden tests beside it and return their expected values.
``runner.py``'s report could be forged in about fifteen lines that the trajectory monitor does not
match (``tests/env/test_oracle.py``). So for tasks whose tests are value checks, the grader never
sends an expected value or a verdict through the sandbox:

- ``split_checks`` rewrites each protected test file on the host: every ``check(E, V)`` and
  ``assert E OP V`` (``==``, ``!=``, ``<``, ``in``, ``is None``, ..., the literal on either side)
  becomes ``__cj_probe__(i, E)``, and the literal V and the operator stay on the host. The rewritten
  files hold inputs only.
- ``PROBE_SOURCE`` (written by the grader into a folder of its own, never the workspace's
  ``run_tests.py``) imports each rewritten file in the sandbox, runs its ``test_*`` functions and
  writes every probed value, encoded as plain data (``encode``), to a JSON file.
- ``outcomes`` decodes those values and redoes each check on the host: a test passes iff each of its
  probes was reached and every value it recorded passes (``check``: same type and equal; ``assert``:
  the test's operator). Anything the code returns that is not plain data (an always-equal object,
  an ``int`` subclass) decodes to a value equal to nothing.

Anything the code under test writes is at most a claim about values, and a claim that passes is the
correct values for inputs it has not seen before the run, which is solving the task. The weak checks
are the bare asserts: their expected value is always True, so code can claim it. The one the
templates use, ``assert not hasattr(m, "old")`` on a workspace module, is also confirmed on the host
(``confirm_on_host``): the module's file must exist and hold no identifier ``old``. Claiming at all
needs code that reaches the probe, and ``pure_code`` refuses that code before anything runs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import operator
import os
import threading
import tokenize
import unicodedata

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
  strict: bool  # check() and ``is``: the type must match too
  op: str = "=="  # or one of OPS' operators, redone on the host ...
  side: str = "right"  # ... with the literal on this side of it
  absent: tuple = ()  # (name, module): ``assert not hasattr(module, name)``, see confirm_on_host
  credit: bool = True  # False for ``kept(got, want)``: a shortcut gives it too (checks_right)


# ``assert A OP B`` for these operators, one side a literal: the host redoes OP on the recorded side
# and the literal (the report grader's probes, ``env/probes.py``, use the same table).
OPS = {ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.In: "in",
       ast.NotIn: "not in", ast.IsNot: "is not"}
_OP_FUNCS = {"!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
             ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b,
             "is not": operator.is_not}
_NOT = NOT_LITERAL = object()  # "not a literal" (probe_rewrite shares it)


def singleton(node: ast.AST) -> bool:
  """``node`` is ``None``, ``True`` or ``False``: the literals an ``is`` check may name."""
  return isinstance(node, ast.Constant) and (node.value is None or type(node.value) is bool)


class _Rewrite(ast.NodeTransformer):
  def __init__(self, file: str, imports: dict[str, str]):
    self.file, self.imports, self.expected, self.test = file, imports, {}, None

  def visit_FunctionDef(self, node):
    if self.test is None and node.name.startswith("test_"):
      self.test = node.name
      self.expected[node.name] = []
      self.generic_visit(node)
      self.test = None
      return node
    return self.generic_visit(node)

  def _probe(self, expr, want, strict: bool, node, **how):
    exp = self.expected[self.test]
    exp.append(Expected(len(exp), want, strict, **how))
    call = ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(len(exp) - 1), expr], [])
    return ast.copy_location(ast.Expr(call), node)

  def _refuse(self, why: str):
    raise NotValueChecks(f"{self.file}::{self.test}: {why}")

  def visit_Expr(self, node):
    call = node.value
    if (self.test and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        and call.func.id in ("check", "kept")):
      if len(call.args) != 2 or call.keywords:
        self._refuse(f"{call.func.id}() takes (got, want)")
      want = literal(call.args[1])
      if want is _NOT:
        self._refuse(f"expected value {ast.unparse(call.args[1])!r} is not a literal")
      return self._probe(call.args[0], want, True, node, credit=call.func.id == "check")
    return self.generic_visit(node)

  def visit_Assert(self, node):
    if not self.test:
      return node
    t = node.test
    if isinstance(t, ast.Compare):
      return self._compare(t, node)
    # A bare assert: the probe records its truth, which code under test can claim (module doc).
    truth = ast.UnaryOp(ast.Not(), ast.UnaryOp(ast.Not(), t))
    return self._probe(truth, True, True, node, absent=self._absent(t))

  def _compare(self, t: ast.Compare, node):
    if len(t.ops) != 1:
      self._refuse(f"{ast.unparse(t)!r} chains comparisons; write one assert per comparison")
    (op,), a, b = t.ops, t.left, t.comparators[0]
    va, vb = literal(a), literal(b)
    if vb is not _NOT and va is _NOT:
      computed, want, side = a, vb, "right"
    elif va is not _NOT and vb is _NOT:
      computed, want, side = b, va, "left"
    else:
      self._refuse(f"expected value {ast.unparse(b)!r} is not a literal" if va is _NOT else
                   f"{ast.unparse(t)!r} compares two literals")
    if isinstance(op, ast.Eq):
      return self._probe(computed, want, False, node)
    lit = b if side == "right" else a
    if isinstance(op, (ast.Is, ast.IsNot)) and not singleton(lit):
      self._refuse(f"{ast.unparse(t)!r}: ``is`` checks only None, True or False")
    if isinstance(op, ast.Is):  # only that very value passes: type and value
      return self._probe(computed, want, True, node)
    return self._probe(computed, want, False, node, op=OPS[type(op)], side=side)

  def _absent(self, t) -> tuple:
    """(name, module) of ``not hasattr(M, "name")`` where M is a workspace module the test file
    imports by ``import``; else ()."""
    if not (isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and isinstance(t.operand, ast.Call)):
      return ()
    call = t.operand
    if (isinstance(call.func, ast.Name) and call.func.id == "hasattr" and len(call.args) == 2
        and not call.keywords and isinstance(call.args[0], ast.Name) and call.args[0].id in self.imports
        and isinstance(call.args[1], ast.Constant) and type(call.args[1].value) is str):
      return (call.args[1].value, self.imports[call.args[0].id])
    return ()


def literal(node: ast.AST):
  """``node``'s value if it is a literal, else ``NOT_LITERAL``."""
  try:
    return ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    return _NOT


def _module_imports(tree: ast.Module, modules) -> dict[str, str]:
  """{local name: module} for the file's top-level ``import M`` / ``import M as N`` of ``modules``."""
  out = {}
  for node in tree.body:
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name in modules and (alias.asname or "." not in alias.name):
          out[alias.asname or alias.name] = alias.name
  return out


# CPython 3.11's ast.parse keeps its recursion depth in interpreter-wide state: two threads parsing
# at once can fail with "SystemError: AST constructor recursion depth mismatch" (gh-106905). The
# rollout workers grade episodes in a thread pool, and one such error ended an RL run.
_PARSE_LOCK = threading.Lock()


def parse(source: str) -> ast.Module:
  """``ast.parse`` under a process-wide lock (see above); the graders' only way to parse."""
  with _PARSE_LOCK:
    return ast.parse(source)


def split_checks(source: str, file: str = "<test>",
                 modules=frozenset()) -> tuple[str, dict[str, list[Expected]]]:
  """``source`` with its checks turned into probes, and each test's expected values in order.
  ``modules`` are the workspace's modules (dotted names), for ``confirm_on_host``."""
  tree = parse(source)
  rw = _Rewrite(file, _module_imports(tree, modules))
  tree = rw.visit(tree)
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
  if t is list or t is tuple or t is set or t is frozenset:  # ``in`` would ask a metaclass's __eq__
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
  """``got`` was plain data in the sandbox, all the way down (no ``decode`` stand-in for anything
  else inside it: ``[<object>] != 3`` must not pass)."""
  if isinstance(got, _Other):
    return False
  if isinstance(got, dict):
    return all(is_plain(k) and is_plain(v) for k, v in got.items())
  if isinstance(got, (list, tuple, set, frozenset)):
    return all(is_plain(x) for x in got)
  return True


def holds(op: str, side: str, got, want) -> bool:
  """``got OP want`` (``want OP got`` when the literal was on the left), on plain data only."""
  if not is_plain(got):
    return False
  a, b = (got, want) if side == "right" else (want, got)
  try:
    return _OP_FUNCS[op](a, b) is True
  except Exception:  # noqa: BLE001 - e.g. 3 < "a": the assert would have raised
    return False


def matches(got, e: Expected) -> bool:
  if not is_plain(got):
    return False
  if e.op != "==":
    return holds(e.op, e.side, got, e.want)
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
  returning the visible tests' values (except where a hidden input repeats a visible one). A
  ``kept`` check is not counted: the start, a do-nothing body or the reference with a branch
  forced gives that value too (``synthetic.templates.hidden_test``)."""
  right = total = 0
  for file in files:
    got_file = results.get(file) if isinstance(results, dict) else None
    for test, exp in expected.get(file, {}).items():
      rec = got_file.get(test) if isinstance(got_file, dict) else None
      seen = recorded(rec) if isinstance(rec, dict) else {}
      exp = [e for e in exp if e.credit]
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


MAX_MODULE_BYTES = 1 << 20  # a module file bigger than this does not confirm an absence


def names_gone(expected: dict[str, dict[str, list[Expected]]], root: str, skip=()) -> frozenset:
  """The ``(name, module)`` of each ``absent`` probe whose module file in ``root`` no longer names
  it (``_absent_from``), nor does any other ``*.py`` in ``root`` but ``skip`` (the protected files):
  a helper module could set ``amod.old = amod.new``, import the unrenamed module that says ``from
  amod import old``, and delete it again before the check. Read before the sandbox runs: code under
  test that broke out could rewrite its files in the graded copy before the host looked."""
  checks = {e.absent for tests in expected.values() for exp in tests.values() for e in exp if e.absent}
  if not checks:
    return frozenset()
  skip = set(skip)
  others = [rel for rel in _python_sources(root) if rel not in skip]
  return frozenset(c for c in checks if _absent_from(root, *c)
                   and not any(_names(os.path.join(root, rel), c[0], star=False) for rel in others))


def confirm_on_host(expected: dict[str, dict[str, list[Expected]]], results: dict,
                    gone: frozenset) -> dict:
  """``results`` with a failing value added to each ``absent`` probe not in ``gone`` (``names_gone``).

  ``assert not hasattr(m, "old")`` expects True, which code under test can claim (it can wrap the
  probe, or write the values file). The host reads the graded copy's ``m.py`` (or
  ``m/__init__.py``): a module that still names ``old`` as an identifier (a ``def``, an alias, an
  import; comments and strings aside), or whose file is gone, a link or unreadable, fails the check
  whatever the sandbox said. Binding the name without spelling it (``globals()["o" + "ld"]``) is
  still left to the sandbox's probe."""
  for file, tests in expected.items():
    got_file = results.get(file) if isinstance(results, dict) else None
    for test, exp in tests.items():
      rec = got_file.get(test) if isinstance(got_file, dict) else None
      values = rec.get("values") if isinstance(rec, dict) else None
      for e in exp:
        if e.absent and isinstance(values, list) and e.absent not in gone:
          values.append([e.index, ["other", "named on the host"]])
  return results


def _absent_from(root: str, name: str, module: str) -> bool:
  """Every file that could be ``module`` (a package shadows a module) is regular, has no NAME
  token ``name`` and no star import, and there is one (``grading`` removed bytecode and extensions
  before this)."""
  rel = module.replace(".", "/")
  found = False
  for cand in (rel + "/__init__.py", rel + ".py"):
    path = os.path.join(root, cand)
    if not os.path.lexists(path):
      continue
    if _names(path, name, star=True):
      return False
    found = True
  return found


def _names(path: str, name: str, star: bool) -> bool:
  """Whether the file at ``path`` may bind or use ``name``: a NAME token of it or an identifier of
  its syntax tree (``star``: or a star import, which binds names the file never spells), or no
  regular file that both read.

  Both, because neither sees all: ``tokenize`` splits lines at ``\n`` only, so a line that starts
  with a lone ``\r`` (a line break to the compiler) is skipped as blank, names and all; and it
  reads an f-string as one token, where ``f"{(old := new)}"`` binds ``old``. The tree is the
  compiler's own (``parse``, NFKC applied)."""
  blob = read_regular(path, MAX_MODULE_BYTES)
  if blob is None:
    return True
  try:
    toks = [t for t in tokenize.tokenize(io.BytesIO(blob).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]
    tree = parse(blob)
  except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, ValueError):
    return True
  before = ["", *(t.string for t in toks)]
  # The compiler binds identifiers NFKC-normalised (a fullwidth "ｏｌｄ" is old); tokenize does not.
  return (any(t.type == tokenize.NAME and unicodedata.normalize("NFKC", t.string) == name
              or star and t.string == "*" and prev == "import" for prev, t in zip(before, toks))
          or name in _identifiers(tree, star))


def _identifiers(tree: ast.AST, star: bool) -> set[str]:
  """Every identifier ``tree`` spells: names, attributes, definitions, arguments, keywords, import
  names and aliases (each part of a dotted one), global/nonlocal and pattern captures; ``*`` for a
  star import when ``star``."""
  out: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      out.add(node.id)
    elif isinstance(node, ast.Attribute):
      out.add(node.attr)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out.add(node.name)
    elif isinstance(node, ast.arg):
      out.add(node.arg)
    elif isinstance(node, ast.keyword) and node.arg:
      out.add(node.arg)
    elif isinstance(node, ast.alias):
      if node.name == "*":
        out |= {"*"} if star else set()
      else:
        out |= set(node.name.split(".")) | ({node.asname} if node.asname else set())
    elif isinstance(node, ast.ImportFrom) and node.module:
      out |= set(node.module.split("."))
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
      out |= set(node.names)
    elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
      out.add(node.name)
    elif isinstance(node, ast.MatchMapping) and node.rest:
      out.add(node.rest)
    elif isinstance(node, ast.MatchClass):
      out |= set(node.kwd_attrs)
    elif isinstance(node, ast.ExceptHandler) and node.name:
      out.add(node.name)
  return out


def _python_sources(root: str) -> list[str]:
  """Every ``*.py`` under ``root``, relative (the walk does not follow a link to a folder)."""
  return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root)
                for f in files if f.endswith(".py"))


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
    out_path, paths, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    del sys.argv[1:]
    dump, record = json.dump, encode  # held here: code under test could rebind the module's names
    # The workspace joins the path only now, after this runner's own imports: from PYTHONPATH, a
    # workspace json.py was what ``import json`` above found, and its dump() wrote the values.
    if not sys.flags.safe_path:  # -P: without it this file's folder is on the path, and a
      raise SystemExit("the probe runs as python -S -P")  # workspace ``import probe`` found it
    sys.path[0:0] = paths.split(os.pathsep)
    signal.signal(signal.SIGALRM, _alarm)
    results = {}
    current = []

    def probe(i, v):
        current.append([i, record(v)])
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
        dump(results, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
'''

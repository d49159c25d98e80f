"""The code a values-graded workspace may hold: computation, with no way to the probe.

The values grader (``oracle.py``) runs the agent's modules in the probe's own process. Their values
are claims the host checks, so most forging earns nothing; but a check whose expected value the
agent can guess (a bare ``assert``, always True) is won by any code that reaches the probe: wraps
``builtins.__cj_probe__``, walks up to the probe's frame, or writes the values file. The synthetic
tasks' solutions are arithmetic, classes and imports of each other, so before the sandbox runs the
host reads every Python file the test files can import and refuses the workspace (grade 0) when one
could reach outside that: an allow-list of imports and of dunder names, and a deny-list of the few
builtins and attributes that turn a string into an attribute or lead to a frame, a namespace, a
file or the interpreter.

What stays reachable, and why it is enough: builtins other than ``DENIED``; ``math`` and
``itertools``, C modules with no attribute that leads to another module; the workspace's own
modules, which pass this same check. No workspace module may have a stdlib module's name (or
``__main__``), imported or not: ``import`` may return the probe's own module of that name, and the
interpreter imports some by name on its own (``INTERPRETER_NAMES``).

Attribute names that are strings at run time are the way around an identifier check, so the reads
by string are refused: ``str.format`` and ``format_map`` (``"{0.__globals__.x}".format(f)`` fails
on the last part, and the ``AttributeError``'s ``.obj``, refused too, is the globals dict), and
positional class patterns (``case C(x)`` reads the names in ``C.__match_args__``, which a class
made by ``type(name, bases, {...})`` sets, with any hook, from plain strings). ``hasattr`` only
returns a bool. The identifiers are read from the AST, so names inside f-strings and ``match``
patterns count, and strings and comments do not.
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig

from composer_jax.env import guards, oracle

MAX_FILE_BYTES = 1 << 20

STDLIB = frozenset({"math", "itertools", "__future__"})


def _interpreter_names() -> frozenset[str]:
  """The stdlib's module names, and every name its folders hold (``test``, ``_testcapi``, ...)."""
  names = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {"__main__"}
  for folder in (sysconfig.get_path("stdlib"), sysconfig.get_config_var("DESTSHARED")):
    if folder and os.path.isdir(folder):
      names |= {entry.split(".")[0] for entry in os.listdir(folder)}
  return frozenset(names)


# No workspace module may take one of these names, imported or not: ``import`` finds the probe's
# own (``os``, ``sys``, ``json``, the probe as ``__main__``) in sys.modules before the path, and the
# interpreter imports others by name from C (a codec lookup imports ``base64``, a ``"\N{...}"``
# escape ``unicodedata``) with the workspace first on the path, so the file read is not what runs,
# or what runs is never read.
INTERPRETER_NAMES = _interpreter_names()

# Builtins that reach a namespace (globals, vars), an attribute by name (getattr), a compiler (eval)
# or the file system (open).
DENIED = frozenset({"eval", "exec", "compile", "globals", "locals", "vars", "getattr", "setattr",
                    "delattr", "open", "breakpoint", "help"})
# Attributes that lead from a generator, coroutine or traceback to a frame, and from a frame to
# its caller's namespace.
FRAME_ATTRS = frozenset({"gi_frame", "cr_frame", "ag_frame", "tb_frame", "tb_next", "f_back",
                         "f_globals", "f_locals", "f_builtins", "f_code", "gi_code", "cr_code",
                         "ag_code", "cell_contents"})

# Attribute names that read other attributes by a run-time string (``"{0.__globals__.x}".format(f)``)
# or hand back the object such a read failed on (``AttributeError.obj``: the globals dict above).
STRING_READS = frozenset({"format", "format_map", "obj"})

# Read, never bound: a module that rebinds its ``__name__`` turns ``from itself import path`` into
# ``sys.modules["os.path"]`` (the import's fallback for a missing attribute), and one that swaps
# its ``__class__`` for a class built from strings gets hooks on every read of it.
READ_ONLY = frozenset({"__name__", "__class__"})

_OPERATORS = ("add sub mul matmul truediv floordiv mod pow lshift rshift and or xor divmod").split()
DUNDERS = frozenset(
    {f"__{n}__" for n in (
        "init new repr str format eq ne lt le gt ge hash bool len iter next reversed contains "
        "getitem setitem delitem call enter exit neg pos abs invert int float index round complex "
        "name main future all slots doc qualname class post_init version").split()}
    | {f"__{p}{n}__" for n in _OPERATORS for p in ("", "r", "i")})


def identifiers(tree: ast.AST):
  """(line, name) of every identifier in ``tree``: names, attributes, imports (each dotted part),
  definitions, arguments, keywords, ``global``s and ``match`` captures and attributes."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant):
      continue
    for field, value in ast.iter_fields(node):
      if field == "type_comment":
        continue
      for v in value if isinstance(value, list) else (value,):
        if isinstance(v, str):
          for part in v.split("."):
            yield getattr(node, "lineno", 0), part


def bound(tree: ast.AST):
  """(line, name) of every name ``tree`` binds, deletes or stores to as an attribute."""
  for node in ast.walk(tree):
    line = getattr(node, "lineno", 0)
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
      yield line, node.id
    elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
      yield line, node.attr
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
      yield from ((line, n) for n in node.names)
    elif isinstance(node, ast.alias):
      yield line, node.asname or node.name.split(".")[0]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      yield line, node.name
    elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
      yield line, node.name
    elif isinstance(node, ast.MatchMapping) and node.rest:
      yield line, node.rest
    elif isinstance(node, ast.arg):
      yield line, node.arg


def why_denied(name: str) -> str | None:
  if name in DENIED:
    return f"the builtin {name}()"
  if name in FRAME_ATTRS:
    return f"the frame attribute .{name}"
  if len(name) > 4 and name.startswith("__") and name.endswith("__") and name not in DUNDERS:
    return f"the dunder name {name}"
  return None


def imported(tree: ast.AST):
  """(line, top-level name) of every absolute import in ``tree`` (relative ones stay in a package)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from ((node.lineno, a.name.split(".")[0]) for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      yield node.lineno, (node.module or "").split(".")[0]


def check_tree(tree: ast.AST, rel: str, local: frozenset[str]) -> str | None:
  """Why the module ``tree`` (the file ``rel``) may not run beside the probe, or None when it may;
  ``local``: the top-level modules it may import besides ``STDLIB``."""
  for line, top in imported(tree):
    if top not in STDLIB and top not in local:
      return (f"{rel}:{line}: imports {top}; the workspace's code may import only its own "
              f"modules and {', '.join(sorted(STDLIB - {'__future__'}))}")
  for line, name in identifiers(tree):
    why = why_denied(name)
    if why:
      return f"{rel}:{line}: uses {why}, which reaches outside the code under test"
  for line, name in bound(tree):
    if name in READ_ONLY:
      return (f"{rel}:{line}: binds {name}, which the code may read but not set: the import "
              "system and attribute lookup trust it")
  for node in ast.walk(tree):
    names = ([node.attr] if isinstance(node, ast.Attribute) else
             node.kwd_attrs if isinstance(node, ast.MatchClass) else [])
    for name in set(names) & STRING_READS:
      return (f"{rel}:{node.lineno}: uses .{name}, which reads attributes named by a string at run "
              "time (str.format) or hands back the object such a read failed on "
              "(AttributeError.obj); use an f-string")
    if isinstance(node, ast.MatchClass) and node.patterns:
      return (f"{rel}:{node.lineno}: a positional class pattern reads the attributes its class's "
              "__match_args__ names at run time; use keyword patterns (case C(x=v))")
  return None


def python_files(root: str, skip) -> list[str]:
  """Every ``*.py`` under ``root`` (relative paths) but ``skip``, the protected files, and every
  link to a folder: the walk does not follow one, and ``import`` would (it is refused when read)."""
  out, skip = [], set(skip)
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()
    out += [os.path.relpath(os.path.join(dirpath, d), root) for d in dirnames
            if os.path.islink(os.path.join(dirpath, d))]
    for f in sorted(filenames):
      rel = os.path.relpath(os.path.join(dirpath, f), root)
      if f.endswith(".py") and rel not in skip:
        out.append(rel)
  return out


def _parse(root: str, rel: str) -> tuple[ast.AST | None, str | None]:
  blob = guards.read_regular(os.path.join(root, rel), MAX_FILE_BYTES)
  if blob is None:
    return None, f"{rel}: not a regular file of at most {MAX_FILE_BYTES} bytes"
  try:
    return oracle.parse(blob), None  # under the graders' parse lock
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None, f"{rel}: does not parse"


def refusal(root: str, protected, pythonpath=(".",), entries=None) -> str | None:
  """Why the graded copy at ``root`` may not run beside the probe (one line), or None. ``protected``:
  the task's test files and runner, restored from the task store (and not importable by the code);
  ``pythonpath``: the folders of ``root`` the tests import from (the task's ``pythonpath``);
  ``entries``: the protected files the probe imports (default: all), where reading starts.

  Only code that can run is read: the workspace modules the test files import, then those that
  these import, each top-level module or package whole. Code cannot load a module any other way
  (no ``__import__``, no ``importlib``; ``grading`` removed bytecode and extensions), and the
  interpreter's own imports by name find the stdlib, since no workspace module takes a stdlib
  name. So an agent's scratch script with ``import subprocess`` that no test imports is no reason
  to refuse."""
  files = python_files(root, protected)
  by_top: dict[str, list[str]] = {}  # a name importable from several folders: all of them
  for entry in pythonpath:
    for rel in files:
      sub = os.path.relpath(rel, entry)
      if sub != os.pardir and not sub.startswith(os.pardir + os.sep):  # ..x.py is under entry
        by_top.setdefault(sub.split(os.sep)[0].removesuffix(".py"), []).append(rel)
  local = frozenset(by_top)
  tests = {rel.removesuffix(".py") for rel in protected if os.sep not in rel}
  shadows = sorted(local & tests)  # a package test_x/ is what ``import test_x`` finds, first
  if shadows:
    return f"{by_top[shadows[0]][0]}: shadows the protected test module {shadows[0]}"
  clashes = sorted(local & INTERPRETER_NAMES)
  if clashes:
    return (f"{by_top[clashes[0]][0]}: a workspace module may not take the standard library's name "
            f"{clashes[0]}: the interpreter imports such modules on its own (a codec lookup imports "
            "base64), and the workspace's would load; rename it")
  todo = set()
  for rel in protected if entries is None else entries:  # trusted, read for their imports only
    tree, _ = _parse(root, rel) if rel.endswith(".py") else (None, None)
    if tree is not None:
      todo |= {top for _, top in imported(tree)} & local
  seen = set()
  while todo:
    top = min(todo)
    todo.discard(top)
    seen.add(top)
    for rel in by_top[top]:
      tree, why = _parse(root, rel)
      why = why or check_tree(tree, rel, local)
      if why:
        return why
      todo |= ({t for _, t in imported(tree)} & local) - seen
  return None

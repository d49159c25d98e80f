"""Feature-deletion tasks: delete a function, method or class from a real package; its tests are the reward.

Syntax-aware throughout (Python's ``ast``): a candidate is a top-level function or class, or a method
of a top-level class, in the package's own modules. Deleting it removes its lines (decorators
included; ``pass`` keeps an emptied body valid) and its direct references that would otherwise break
the import of the whole package: ``from .mod import name`` aliases and ``__all__`` entries.

Validation runs the test suite on the original (baseline) and after the deletion: FAIL_TO_PASS = tests
that pass on the original and fail after; PASS_TO_PASS = tests that pass both times. A candidate is
dropped, with the reason counted, when no test fails, when the deletion breaks too much (an import
error rather than a missing feature), or when the run times out.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable

from composer_jax.env.guards import is_test_path


@dataclasses.dataclass
class Candidate:
  file: str  # relative to the repository root
  qualname: str  # "func" | "Class" | "Class.method"
  kind: str  # function | class | method
  lineno: int  # first line (decorators included)
  end_lineno: int
  signature: str = ""
  doc: str = ""

  @property
  def name(self) -> str:
    return self.qualname.split(".")[-1]

  @property
  def n_lines(self) -> int:
    return self.end_lineno - self.lineno + 1


def module_files(repo: str, src_root: str, modules: list[str]) -> list[str]:
  """Package source files (relative to ``repo``), tests excluded."""
  out = []
  base = os.path.join(repo, src_root)
  for mod in modules:
    single = os.path.join(base, mod + ".py")
    if os.path.isfile(single):
      out.append(os.path.relpath(single, repo))
      continue
    for dirpath, dirnames, filenames in os.walk(os.path.join(base, mod)):
      dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
      for f in sorted(filenames):
        rel = os.path.relpath(os.path.join(dirpath, f), repo)
        if f.endswith(".py") and not is_test_path(rel):
          out.append(rel)
  return out


def _first_line(node) -> int:
  return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _describe(node) -> tuple[str, str]:
  doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")[:300]
  if isinstance(node, ast.ClassDef):
    bases = ", ".join(ast.unparse(b) for b in node.bases)
    return (f"class {node.name}({bases})" if bases else f"class {node.name}"), doc
  prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
  return f"{prefix} {node.name}({ast.unparse(node.args)})", doc


def find_candidates(repo: str, files: list[str], min_lines: int = 3,
                    max_lines: int = 150) -> list[Candidate]:
  out = []
  for rel in files:
    try:
      tree = ast.parse(_read(os.path.join(repo, rel)))
    except (SyntaxError, UnicodeDecodeError):
      continue
    for node in tree.body:
      items = [(node, node.name, "class" if isinstance(node, ast.ClassDef) else "function")] \
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []
      if isinstance(node, ast.ClassDef):
        items += [(m, f"{node.name}.{m.name}", "method") for m in node.body
                  if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and m.name not in ("__init__", "__new__", "__init_subclass__")]
      for n, qual, kind in items:
        first = _first_line(n)
        size = n.end_lineno - first + 1
        if min_lines <= size <= max_lines:
          sig, doc = _describe(n)
          out.append(Candidate(rel, qual, kind, first, n.end_lineno, sig, doc))
  return out


def _read(path: str) -> str:
  with open(path, encoding="utf-8", newline="") as f:
    return f.read()


def _parents(tree: ast.AST) -> dict:
  parents = {}
  for node in ast.walk(tree):
    for child in ast.iter_child_nodes(node):
      parents[child] = node
  return parents


def _remove_stmt(lines: list[str], node, parent, edits: list) -> None:
  """Schedule removal of statement ``node``; an emptied block gets ``pass``."""
  start = _first_line(node)
  body = None
  for field in ("body", "orelse", "finalbody", "handlers"):
    seq = getattr(parent, field, None)
    if isinstance(seq, list) and node in seq:
      body = seq
  indent = re.match(r"\s*", lines[start - 1]).group(0)
  keep_pass = body is not None and len(body) == 1 and not isinstance(parent, ast.Module)
  edits.append((start, node.end_lineno, [indent + "pass\n"] if keep_pass else []))


def _apply(lines: list[str], edits: list) -> str:
  for start, end, repl in sorted(edits, key=lambda e: -e[0]):
    lines[start - 1:end] = repl
  text = "".join(lines)
  return re.sub(r"\n{4,}", "\n\n\n", text)  # no gaping holes where the code was


def _drop_element(lines: list[str], elt, edits: list) -> None:
  """Schedule removal of one element of a list / import (its own line, or its span and comma)."""
  line = lines[elt.lineno - 1]
  piece = line[elt.col_offset:elt.end_col_offset]
  if elt.lineno == elt.end_lineno and line.strip().rstrip(",").strip() == piece.strip():
    edits.append((elt.lineno, elt.lineno, []))
    return
  if elt.lineno != elt.end_lineno:
    raise SyntaxError("multi-line element")  # rare; the caller falls back to a rewrite
  after = line[elt.end_col_offset:]
  m = re.match(r"\s*,\s*", after)
  if m:
    new = line[:elt.col_offset] + after[m.end():]
  else:  # the last element: eat the comma before it
    head = re.sub(r",\s*$", "", line[:elt.col_offset])
    new = head + after
  edits.append((elt.lineno, elt.lineno, [new]))


def _reference_edits(text: str, name: str, module_stem: str) -> tuple[list, int]:
  """Edits dropping ``from ...module import name`` aliases and ``"name"`` from ``__all__``."""
  tree = ast.parse(text)
  parents = _parents(tree)
  lines = text.splitlines(keepends=True)
  edits, count = [], 0
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
      mod = (node.module or "").split(".")[-1]
      if node.module and mod != module_stem:
        continue
      keep = [a for a in node.names if a.name != name]
      count += 1
      if not keep:
        _remove_stmt(lines, node, parents[node], edits)
        continue
      try:
        for a in node.names:
          if a.name == name:
            _drop_element(lines, a, edits)
      except SyntaxError:
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        new = ast.ImportFrom(module=node.module, names=keep, level=node.level)
        edits.append((node.lineno, node.end_lineno, [indent + ast.unparse(new) + "\n"]))
    elif (isinstance(node, ast.Assign) and isinstance(parents.get(node), ast.Module)
          and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
          and isinstance(node.value, (ast.List, ast.Tuple))):
      gone = [e for e in node.value.elts if isinstance(e, ast.Constant) and e.value == name]
      if gone:
        count += 1
        try:
          for e in gone:
            _drop_element(lines, e, edits)
        except SyntaxError:
          node.value.elts = [e for e in node.value.elts if e not in gone]
          edits.append((node.lineno, node.end_lineno, [ast.unparse(node) + "\n"]))
  return edits, count


def delete_candidate(repo: str, cand: Candidate, files: list[str]) -> dict[str, str]:
  """New text of every file the deletion touches (the candidate's file and referencing modules)."""
  path = os.path.join(repo, cand.file)
  text = _read(path)
  tree = ast.parse(text)
  parents = _parents(tree)
  target = None
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
        and _first_line(node) == cand.lineno and node.name == cand.name:
      target = node
  if target is None:
    raise ValueError(f"{cand.qualname} not found in {cand.file}")
  edits: list = []
  _remove_stmt(text.splitlines(keepends=True), target, parents[target], edits)
  changed = {cand.file: _apply(text.splitlines(keepends=True), edits)}
  if cand.kind != "method":  # module-level names are imported elsewhere
    stem = os.path.splitext(os.path.basename(cand.file))[0]
    for rel in files:
      cur = changed.get(rel, _read(os.path.join(repo, rel)))
      try:
        ref_edits, n = _reference_edits(cur, cand.name, stem)
      except SyntaxError:
        continue
      if n:
        changed[rel] = _apply(cur.splitlines(keepends=True), ref_edits)
  for rel, new in changed.items():
    ast.parse(new, filename=rel)  # raises SyntaxError: the caller drops the candidate
  return changed


def referenced(repo: str, cand: Candidate, test_text: str, pkg_text: str) -> bool:
  """Cheap pre-filter: the name appears in the tests or elsewhere in the package."""
  rx = re.compile(rf"\b{re.escape(cand.name)}\b")
  return bool(rx.search(test_text)) or len(rx.findall(pkg_text)) > 1


def unified_diff(rel: str, before: str, after: str) -> str:
  return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                      f"a/{rel}", f"b/{rel}"))


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------

def _words(name: str) -> str:
  name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name.strip("_"))
  return name.replace("_", " ").lower()


TERSE = (
    "bring back {words}, tests are failing",
    "{qual} got deleted from {file}, put it back",
    "tests fail since `{qual}` is gone. fix pls",
    "restore the {kind} {qual} in {file}",
    "{words} is missing — can you re-add it so the tests pass?",
    "someone removed {qual}; reimplement it",
)


def prompts(cand: Candidate, f2p: list[str], hidden: list[str], other_files: list[str],
            key: str) -> tuple[str, str]:
  """(terse, verbose) problem statements."""
  pick = int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(TERSE)
  terse = TERSE[pick].format(words=_words(cand.name), qual=cand.qualname, file=cand.file,
                             kind=cand.kind)
  shown = "\n".join(f"  - {t}" for t in f2p[:8]) + (f"\n  - ... ({len(f2p) - 8} more)"
                                                     if len(f2p) > 8 else "")
  parts = [f"The {cand.kind} `{cand.qualname}` was removed from `{cand.file}`."]
  if cand.kind == "method":
    parts.append(f"It belongs to class `{cand.qualname.split('.')[0]}`.")
  parts.append(f"Its signature was:\n\n    {cand.signature}\n")
  if cand.doc:
    parts.append(f"Its documentation said: \"{cand.doc}\"")
  if other_files:
    parts.append("References to it were also removed from " + ", ".join(f"`{f}`" for f in other_files)
                 + " (imports / `__all__`); restore them too.")
  parts.append(f"The rest of the package and its test suite still rely on it: {len(f2p)} test(s) now "
               f"fail, among them:\n{shown}")
  if hidden:
    parts.append("Some test files are not in the workspace (" + ", ".join(f"`{h}`" for h in hidden[:5])
                 + "); they are run when your work is graded.")
  parts.append("Re-implement it so the whole test suite passes. Do not change the tests.")
  return terse, "\n".join(parts)


def instance_id(repo_name: str, cand: Candidate, src_root: str = ".") -> str:
  stem = os.path.splitext(os.path.relpath(cand.file, src_root))[0].replace(os.sep, ".")
  return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{repo_name}__{stem}.{cand.qualname}")


def copy_tree(src: str, dst: str) -> None:
  shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(".git"))


def with_changes(repo: str, changed: dict[str, str], run: Callable[[str], dict]) -> dict:
  """Run ``run(dir)`` on a temporary copy of ``repo`` with ``changed`` files written."""
  with tempfile.TemporaryDirectory(prefix="cj-fd-") as tmp:
    dst = os.path.join(tmp, "repo")
    copy_tree(repo, dst)
    for rel, text in changed.items():
      with open(os.path.join(dst, rel), "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return run(dst)

"""Test cases of a synthetic instance, as step lists run against module sources in this process.

A step is ``("stmt", code)`` or ``("check", expr)``; a step list is one test case. ``differing``
picks cases on which the starting code and the reference disagree (so the tests fail before the
change); ``hidden_steps`` adds cases that also catch each near miss of the reference
(``near_misses``, ``mutants``): without them a third of the level-3 tasks passed with a slip such
as ``<`` for ``<=``, and RL would be paid for it (docs/rl_tiny.md, "Hidden tests that catch slips").
"""

from __future__ import annotations

import ast
import collections
import itertools
import json
import random
import re


def run_steps(sources: dict, steps: list) -> list:
  """Run ``steps`` (("stmt", code) | ("check", expr)) against modules given as source text.

  Returns the value (or the exception type name) of each check, in order.
  """
  import sys
  import types
  saved = {name: sys.modules.get(name) for name in sources}
  ns: dict = {}
  out = []
  try:
    for name, text in sources.items():  # dependency order: constants first
      mod = types.ModuleType(name)
      sys.modules[name] = mod
      exec(compile(text, f"{name}.py", "exec"), mod.__dict__)  # noqa: S102 - our generated code
      ns[name] = mod
      ns.update({k: v for k, v in mod.__dict__.items() if not k.startswith("__")})
    for kind, code in steps:
      try:
        if kind == "stmt":
          exec(code, ns)  # noqa: S102
        else:
          out.append(eval(code, ns))
      except Exception as e:  # noqa: BLE001 - a broken variant just differs
        if kind == "check":
          out.append(f"<{type(e).__name__}>")
  finally:
    for name, mod in saved.items():
      if mod is None:
        sys.modules.pop(name, None)
      else:
        sys.modules[name] = mod
  return out


def flat(step_lists: list) -> list:
  return [s for steps in step_lists for s in steps]


def differing(before: dict, after: dict, make_steps, rng: random.Random, n: int,
              tries: int = 60, also=(), avoid=()) -> list:
  """``n`` step lists on which the reference and the starting code give different results (the
  first ones), so the tests fail before the change; later lists may agree. ``also``: more sources
  (shortcuts) that lists separate from the reference as well where they can; those come first.
  A list drawn twice is kept once, and one in ``avoid`` (a visible test's: a lookup table of the
  visible cases passes it) only where nothing else is left."""
  found, partly, rest, shown = [], [], [], []
  for _ in range(tries):
    steps = make_steps(rng)
    if steps in found or steps in partly or steps in rest or steps in shown:
      continue
    want = run_steps(after, steps)
    if steps in avoid:
      shown.append(steps)
    elif want == run_steps(before, steps):
      rest.append(steps)
    elif all(want != run_steps(other, steps) for other in also):
      found.append(steps)
    else:
      partly.append(steps)
    if len(found) >= n:
      break
  if not found and not partly:
    raise ValueError("no input separates the reference from the starting code")
  return (found + partly + rest + shown)[:n]


def varied(sources: dict, make_steps, seed: str, draws: int = 40, unlike=()) -> bool:
  """The checks of ``draws`` step lists give at least 3 distinct results, none in more than half,
  and differ from each source of ``unlike`` somewhere: a reference with fewer (``n // 6 % 9`` is 0
  or 1 over 0..9) is passed by a constant copied from a visible test, and one that is ``n * 3 //
  3`` by ``return n``."""
  gen = random.Random(seed)
  steps = flat(make_steps(gen) for _ in range(draws))
  want = run_steps(sources, steps)
  got = collections.Counter(repr(v) for v in want)
  return (len(got) >= 3 and max(got.values()) <= len(want) / 2
          and all(run_steps(other, steps) != want for other in unlike))


_SITE = re.compile(r"(?<= )(\+|-|\*|//|%|<=|>=|<|>|==)(?= )|\b\d+\b")
_KINDS = (("+", "-", "*", "//", "%"), ("<", ">", "<=", ">=", "=="))


def near_misses(text: str) -> list[str]:
  """``text`` with one binary operator swapped for another of its kind (arithmetic or comparison,
  spaced as the templates write them) or one integer constant moved by one (never below 0)."""
  out = []
  for m in _SITE.finditer(text):
    tok = m.group(0)
    kind = next((k for k in _KINDS if tok in k), None)
    subs = [o for o in kind if o != tok] if kind else [str(int(tok) + 1), str(max(int(tok) - 1, 0))]
    out += [text[:m.start()] + s + text[m.end():] for s in subs]
  return [t for t in dict.fromkeys(out) if t != text]


def mutants(before: dict, after: dict) -> list[dict]:
  """``after`` with one near miss (``near_misses``) on one line the change adds."""
  out = []
  for mod, text in after.items():
    old = set(before.get(mod, "").splitlines())
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
      if line.rstrip("\n") not in old and not line.lstrip().startswith(('"""', "#")):
        out += [{**after, mod: "".join(lines[:i] + [v] + lines[i + 1:])} for v in near_misses(line)]
  return out


TODO_BODY = "raise NotImplementedError"


def trivial(before: dict) -> list[dict]:
  """``before`` with each unimplemented body (``raise NotImplementedError``) replaced by one that
  does nothing: ``return 0``, in a method ``return self.<attr>`` for each attribute, and
  ``return <arg>`` for each of the function's own arguments (``return items`` got 15 % of the
  ``implement`` level-2 hidden checks)."""
  out = []
  for body in ("return 0", *sorted({f"return self.{a}" for src in before.values()
                                      for a in re.findall(r"self\.(\w+) = ", src)})):
    alt = {m: src.replace(TODO_BODY, body) for m, src in before.items()}
    if alt != before:
      out.append(alt)
  for mod, src in before.items():
    lines = src.splitlines(keepends=True)
    for fn in ast.walk(ast.parse(src)):
      if isinstance(fn, ast.FunctionDef):
        todo = [n.lineno - 1 for n in fn.body
                if isinstance(n, ast.Raise) and TODO_BODY in lines[n.lineno - 1]]
        for a in (x.arg for x in fn.args.args if x.arg not in ("self", "cls")):
          for i in todo:
            out.append({**before, mod: "".join(
                lines[:i] + [lines[i].replace(TODO_BODY, f"return {a}")] + lines[i + 1:])})
  return out


def returning(before: dict, fn: str, values) -> list[dict]:
  """``before`` with the body of each function or method named ``fn`` replaced by ``return v``,
  one per distinct ``v`` of ``values`` (the visible tests' values: copied into a constant body they
  resolved 9 of 200 ``implement`` level-2 tasks, and earned 11 % of its hidden checks)."""
  out = []
  for v in dict.fromkeys(map(repr, values)):
    for mod, src in before.items():
      lines = src.splitlines(keepends=True)
      for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == fn:
          body = node.body[1:] if ast.get_docstring(node) is not None else node.body
          if body:
            first = body[0]
            new = lines[first.lineno - 1][:first.col_offset] + f"return {v}\n"
            out.append({**before, mod: "".join(lines[:first.lineno - 1] + [new]
                                                + lines[node.end_lineno:])})
  return out


class _Force(ast.NodeTransformer):
  """The ``k``-th branch point of a tree (an ``if``, a conditional expression, a comprehension's
  ``if``) with its test forced to ``value``; ``seen`` counts them."""

  def __init__(self, k: int, value: bool, lines: set):
    self.k, self.value, self.lines, self.seen = k, value, lines, 0

  def _hit(self, node) -> bool:
    if node.lineno not in self.lines:
      return False
    self.seen += 1
    return self.seen - 1 == self.k

  def visit_If(self, node):
    if self._hit(node):
      node.test = ast.Constant(self.value)
    return self.generic_visit(node)

  visit_IfExp = visit_If

  def visit_comprehension(self, node):
    for i, cond in enumerate(node.ifs):
      if self._hit(cond):
        node.ifs[i] = ast.Constant(self.value)
    return self.generic_visit(node)


def branch_only(before: dict, after: dict) -> list[dict]:
  """``after`` with one branch point on a line the change adds forced each way: the reference
  that drops a condition (``method`` level 3 got 82 % of its hidden checks so) or keeps one branch
  (an ``implement`` ``choose`` task, else-branch only, passed 10 of 43 outright)."""
  out = []
  for mod, text in after.items():
    old = set(before.get(mod, "").splitlines())
    added = {i + 1 for i, line in enumerate(text.splitlines()) if line not in old}
    k = 0
    while True:
      variants = []
      for value in (True, False):
        force = _Force(k, value, added)
        variants.append(ast.unparse(force.visit(ast.parse(text))) + "\n")
      if force.seen <= k:
        break
      out += [{**after, mod: v} for v in variants]
      k += 1
  return out


def hidden_steps(before: dict, after: dict, make_steps, rng: random.Random, n: int,
                 pool: int = 48, shortcuts=(), shown=()) -> list:
  """The hidden test's step lists: ``n`` on which the starting code fails (``differing``), and so
  does each shortcut where an input can tell: a body that does nothing (``trivial``: partial credit
  pays the share of hidden checks right, and ``return self.x`` got half of a conditional method's),
  the reference with a branch forced (``branch_only``) and ``shortcuts`` (a constant from a visible
  test: ``returning``); none is a visible test's list (``shown``). Then, for each mutant of the
  reference (``mutants``, ``branch_only``) or shortcut that those do not catch, the first of
  ``pool`` further lists that does. A mutant none of them catches behaves as the reference on these inputs. The
  pool has its own generator, seeded by ``after``, so the instance's other draws (files, visible
  tests) are what they were without it."""
  noops, forced = trivial(before) + list(shortcuts), branch_only(before, after)
  chosen = differing(before, after, make_steps, rng, n, also=noops + forced, avoid=shown)
  gen = random.Random(json.dumps(after, sort_keys=True))
  lists = list(chosen)
  for steps in (make_steps(gen) for _ in range(pool)):
    if steps not in lists and steps not in shown:
      lists.append(steps)
  ends = [0]
  for steps in lists:
    ends.append(ends[-1] + sum(kind == "check" for kind, _ in steps))

  def per_list(sources, upto):  # each list's results, for the first ``upto`` lists
    out = run_steps(sources, flat(lists[:upto]))
    return [out[a:b] for a, b in itertools.pairwise(ends[:upto + 1])]

  ref, keep, noop_out = per_list(after, len(lists)), list(range(len(chosen))), None
  # A shortcut the drawn lists do not catch is caught as a mutant is: ``n % 9`` is ``n`` but at 9,
  # and ``return n`` resolved 2 of 9 ``implement`` level-2 tasks when no drawn input was 9.
  for mut in mutants(before, after) + forced + noops:
    # Most mutants fail the drawn cases; only the others are run on the whole pool.
    if any(a != b for a, b in zip(per_list(mut, len(chosen)), ref, strict=False)):
      continue
    got = per_list(mut, len(lists))
    if all(got[i] == ref[i] for i in keep):
      if noop_out is None:  # run once, and only for a mutant the drawn cases miss
        noop_out = [per_list(t, len(lists)) for t in noops]
      catch = [i for i in range(len(chosen), len(lists)) if got[i] != ref[i]]
      keep += ([i for i in catch if all(t[i] != ref[i] for t in noop_out)] or catch)[:1]
  return [lists[i] for i in keep]

"""Shortcuts a policy can build from what it sees, against the synthetic tasks' hidden cases: a value
of the visible test returned as a constant, a table of the visible cases, a reference that takes so
few values that a constant is mostly right, and one branch of a condition. Each earns no partial
credit and resolves nothing, while an honest slip in a condition still earns some (partial credit
is the share of credited hidden checks right: ``oracle.checks_right``)."""

from __future__ import annotations

import ast
import itertools
import os
import random
import re
import shutil

from composer_jax.env import synthetic
from composer_jax.env.grading import grade
from composer_jax.env.synthetic import TEMPLATES, templates
from composer_jax.env.synthetic.cases import TODO_BODY, run_steps
from composer_jax.env.tasks import write_text


def _target(inst) -> str:
  """The function or method the hidden test is about."""
  hidden = next(t for t in inst.fail_to_pass if "_hidden.py::" in t and t.endswith("_hidden"))
  return hidden.split("::")[1][len("test_"):-len("_hidden")]


def _visible_asserts(inst, fn: str) -> list[tuple[str, object]]:
  """(call text, expected value) of each ``assert CALL == V`` of the visible test of ``fn``."""
  out = []
  for text in inst.tests.values():
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.FunctionDef) and node.name == f"test_{fn}":
        out += [(ast.unparse(a.test.left), ast.literal_eval(a.test.comparators[0]))
                for a in node.body if isinstance(a, ast.Assert)]
  return out


def _hidden_checks(inst, fn: str) -> list[tuple[str, str]]:
  """(``check`` or ``kept``, the checked expression) of the hidden test of ``fn``."""
  text = next(iter(inst.hidden.values()))
  test = next(n for n in ast.parse(text).body
              if isinstance(n, ast.FunctionDef) and n.name == f"test_{fn}_hidden")
  return [(s.value.func.id, ast.unparse(s.value.args[0])) for s in test.body
          if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]


def _graded(tmp_path, tag, inst, edits: list[dict]) -> tuple[int, int, int]:
  """(resolved, credited hidden checks right, credited total) of each source overlay in ``edits``
  (relative path -> text) through the real grader."""
  task = synthetic.write_task(inst, str(tmp_path / f"{tag}t"))
  resolved = right = total = 0
  for k, edit in enumerate(edits):
    ws = str(tmp_path / f"{tag}ws{k}")
    shutil.copytree(task.workspace_dir, ws)
    for rel, text in edit.items():
      write_text(os.path.join(ws, rel), text)
    got = grade(task, ws)
    resolved += got.reward == 1.0
    right += got.details["hidden_checks"]["passed"]
    total += got.details["hidden_checks"]["total"]
  return resolved, right, total


def _constant_attack(tmp_path, monkeypatch, patched: bool) -> tuple[int, int, int]:
  """The unimplemented body replaced by ``return V`` for each value V of the visible test, over
  eight seeds of each family that starts from such a body."""
  if patched:  # as before: no constant among the shortcuts, and references that take few values
    monkeypatch.setattr(templates, "returning", lambda before, fn, values: [])
    monkeypatch.setattr(templates, "varied", lambda *a, **k: True)
  sums = [0, 0, 0]
  for name, d in [("implement", 2), ("implement", 3), ("two_file", 1), ("two_file", 2)]:
    for seed in range(8):
      inst = TEMPLATES[name].make(random.Random(f"const/{name}/{d}/{seed}"), d)
      fn = _target(inst)
      rel = next(r for r, t in inst.files.items() if f"def {fn}(" in t)
      edits = [{rel: inst.files[rel].replace(TODO_BODY, f"return {v}")}
               for v in dict.fromkeys(repr(v) for _, v in _visible_asserts(inst, fn))]
      if name == "two_file":  # the constant's module too, so the visible test of it passes
        edits = [{**e, **{r: t for r, t in inst.gold.items() if r != rel}} for e in edits]
      got = _graded(tmp_path, f"{patched:d}{name}{d}s{seed}", inst, edits)
      sums = [a + b for a, b in zip(sums, got)]
  return tuple(sums)


def test_a_constant_copied_from_a_visible_test_earns_nothing(tmp_path, monkeypatch):
  """Helper 13 of stop 73: ``return <first visible value>`` earned 11-12 % of the credited hidden
  checks of ``implement`` levels 2-3 and ``two_file``, and resolved 9 of 200 ``implement`` level-2
  tasks. The hidden cases now tell each visible value returned as a constant apart from the
  reference where an input can, and a check it gets right is ``kept``, not paid
  (``cases.returning``); the hidden check of ``two_file``'s constant use as well. Over these 32
  tasks it gets 0; as before (no constant among the shortcuts, and no redraw of a reference that
  takes few values) 8 of 256 credited checks, and it resolves one task."""
  resolved, right, total = _constant_attack(tmp_path, monkeypatch, patched=False)
  assert resolved == 0 and right == 0 and total > 100, (resolved, right, total)
  resolved, right, total = _constant_attack(tmp_path, monkeypatch, patched=True)
  assert right > 0.02 * total, (resolved, right, total)  # 8 of 256 and 1 resolved


def test_no_credited_hidden_check_repeats_a_visible_case():
  """18-20 % of ``two_file``'s hidden inputs repeated a visible one, so a table of the visible
  (input, value) pairs earned 16-17 % of its hidden checks. A hidden case is now never a visible
  one where another can be drawn (``cases.differing``'s ``avoid``), and a paired check (``(f(x),
  f(y))``) holds no visible call either, unless it is ``kept``."""
  credited = 0
  for name, d in [("implement", 1), ("implement", 2), ("implement", 3), ("fix_bug", 1),
                  ("fix_bug", 2), ("fix_bug", 3), ("two_file", 1), ("two_file", 2)]:
    for seed in range(25):
      inst = TEMPLATES[name].make(random.Random(f"table/{name}/{d}/{seed}"), d)
      fn = _target(inst)
      shown = {call for call, _ in _visible_asserts(inst, fn)}
      for kind, expr in _hidden_checks(inst, fn):
        node = ast.parse(expr, mode="eval").body
        calls = [ast.unparse(e) for e in node.elts] if isinstance(node, ast.Tuple) else [expr]
        assert kind == "kept" or not shown & set(calls), (name, d, seed, expr, shown)
        credited += kind == "check"
  assert credited > 500


def _domain_values(inst, fn: str) -> int:
  """How many distinct values the reference takes: every input of 0..9 for scalar arguments, 200
  random lists (of 3-5 items of 0..9) for a list argument."""
  rel = next(r for r, t in inst.gold.items() if f"def {fn}(" in t)
  args = re.search(rf"def {fn}\(([^)]*)\)", inst.gold[rel]).group(1).split(", ")
  rng = random.Random(0)
  if any(a in templates.LISTS for a in args):
    inputs = [[repr([rng.randint(0, 9) for _ in range(rng.randint(3, 5))])] for _ in range(200)]
  else:
    inputs = itertools.product([str(i) for i in range(10)], repeat=len(args))
  steps = [("check", f"{fn}({', '.join(x)})") for x in inputs]
  return len({repr(v) for v in run_steps({rel[:-3]: inst.gold[rel]}, steps)})


def test_no_reference_takes_fewer_than_three_values(monkeypatch):
  """``n // 6 % 9`` is 0 or 1 over 0..9: 20 of 200 ``implement`` level-3 tasks had all their hidden
  values equal, and a constant passed them. Such a reference is drawn again (``cases.varied``)."""
  def fewest(level):
    return min(_domain_values(inst, _target(inst)) for inst in
               (TEMPLATES["implement"].make(random.Random(f"few/{level}/{s}"), level)
                for s in range(60)))
  assert fewest(2) >= 3 and fewest(3) >= 3
  monkeypatch.setattr(templates, "varied", lambda *a, **k: True)  # as before
  assert min(fewest(2), fewest(3)) < 3


def test_a_slipped_condition_still_earns_partial_credit(tmp_path):
  """With every hidden input on one side of a condition, a forced branch gave each hidden value,
  so ``method`` level 3 and ``implement``'s ``choose`` paid no partial credit at all: honest code
  with ``>`` for ``>=`` got 0 as a dropped condition did. Their hidden checks now join two calls
  that can fall on either side (``templates.paired``, ``_class_task``'s ``twice``): such a slip is
  paid for the pairs away from the boundary, and a forced branch still for none."""
  chosen = (TEMPLATES["implement"].make(random.Random(f"slip/implement/{s}"), 3) for s in range(80))
  picked = list(itertools.islice((i for i in chosen if re.search(
      rf"def {_target(i)}\(.*\n.*\n    return \w+ if .* else ", next(iter(i.gold.values())))), 4))
  picked += [TEMPLATES["method"].make(random.Random(f"slip/method/{s}"), 3) for s in range(4)]
  cmp = re.compile(r" (>=|<=|>|<|==) ")
  swap = {">": ">=", ">=": ">", "<": "<=", "<=": "<", "==": ">="}
  slipped, forced = [0, 0], [0, 0]
  for k, inst in enumerate(picked):
    rel, gold = next(iter(inst.gold.items()))
    line = next(ln for ln in gold.splitlines() if cmp.search(ln) and " if " in ln
                and ln not in inst.files[rel].splitlines())
    op = cmp.search(line).group(1)
    _, right, total = _graded(tmp_path, f"s{k}", inst,
                              [{rel: gold.replace(line, line.replace(f" {op} ", f" {swap[op]} ", 1))}])
    slipped = [slipped[0] + right, slipped[1] + total]
    one = re.sub(r" if .* else ", " if True else ", line) if " else " in line else \
        re.sub(r"if .*:$", "if True:", line)
    _, right, total = _graded(tmp_path, f"f{k}", inst, [{rel: gold.replace(line, one)}])
    forced = [forced[0] + right, forced[1] + total]
  assert len(picked) == 8
  assert forced[0] == 0 and slipped[0] > 0.2 * slipped[1], (slipped, forced)

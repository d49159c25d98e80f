"""Cheap bodies against the synthetic tasks' hidden checks: how much partial credit a shortcut earns.

For each (template, level) and seed, the target function's body is replaced by each of a list of
shortcuts a policy can write from what it sees (a constant, an argument, a visible value, a table of
the visible cases, one branch of a condition, the other function's body, a single edit of the
planted bug), and the workspace is graded by the real values grader. Reported per shortcut: the
share of credited hidden checks right (what ``rl.partial_credit`` pays from) and the tasks resolved.
Honest single edits of a planted bug are reported too: some of them are equivalent fixes.

Usage: python experiments/shortcut_survey.py [--seeds 20] [--families implement2,method3]
Writes experiments/results/shortcut_survey.json (about 5 min of one core at 20 seeds).
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import random
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax.env import synthetic
from composer_jax.env.grading import grade
from composer_jax.env.synthetic import TEMPLATES, templates
from composer_jax.env.synthetic.cases import near_misses
from composer_jax.env.tasks import write_text
from experiments.common import write_result


def _fn(src: str, name: str) -> ast.FunctionDef:
  return next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == name)


def _body(src: str, name: str) -> list[str]:
  """The lines of ``name``'s body after its docstring, dedented."""
  fn, lines = _fn(src, name), src.splitlines()
  return [ln[fn.body[0].col_offset:] for ln in lines[fn.body[1].lineno - 1:fn.end_lineno]]


def _with_body(src: str, name: str, body: list[str]) -> str:
  fn, lines = _fn(src, name), src.splitlines(keepends=True)
  indent = lines[fn.body[0].lineno - 1][:fn.body[0].col_offset]
  return "".join(lines[:fn.body[1].lineno - 1] + [indent + b + "\n" for b in body]
                 + lines[fn.end_lineno:])


def _visible(inst, test: str) -> list[tuple[ast.expr, object, list]]:
  """(checked expression, value, the assignments before it) of each assert of visible ``test``."""
  out, setup = [], []
  for text in inst.tests.values():
    for node in ast.parse(text).body:
      if isinstance(node, ast.FunctionDef) and node.name == test:
        for st in node.body:
          if isinstance(st, ast.Assert) and isinstance(st.test, ast.Compare):
            out.append((st.test.left, ast.literal_eval(st.test.comparators[0]), list(setup)))
          elif isinstance(st, ast.Assign):
            setup.append(st)
  return out


def _table(vis, args: list, attr: str | None) -> list[str]:
  """Body lines that return each visible case's value for its inputs (and set the attribute)."""
  key = f"[self.{attr}, n]" if attr else f"[{', '.join(args)}]"
  rows, after = [], [v for call, v, _ in vis if isinstance(call, ast.Attribute)]
  for call, v, setup in vis:
    if not isinstance(call, ast.Call):
      continue
    ins = [ast.literal_eval(setup[-1].value.args[0])] if attr else []
    ins += [ast.literal_eval(a) for a in call.args]
    rows.append((repr(ins), v))
  lines = []
  for k, (ins, v) in enumerate(rows):
    lines.append(f"if {key} == {ins}:")
    if attr and k < len(after):
      lines.append(f"    self.{attr} = {after[k]!r}")
    lines.append(f"    return {v!r}")
  return lines


def shortcuts(inst) -> dict[str, dict]:
  """{shortcut label: {relative path: source}} for one instance."""
  name = next(t for t in inst.fail_to_pass if t.endswith("_hidden")).split("::")[1][5:-7]
  if inst.template == "rename":
    old, new = re.search(r"`(\w+)` in `\w+\.py` to `(\w+)`", inst.prompt).groups()
    amod = next(r for r, t in inst.files.items() if f"def {old}(" in t)
    return {"start (unchanged)": {}, "alias new = old": {amod: inst.files[amod] + f"\n{new} = {old}\n"},
            "rename the def only": {amod: inst.files[amod].replace(f"def {old}(", f"def {new}(")}}
  rel = next(r for r, t in inst.files.items() if f"def {name}(" in t)
  src = inst.files[rel]
  fn = _fn(src, name)
  args = [a.arg for a in fn.args.args if a.arg != "self"]
  attr = re.findall(r"self\.(\w+) = ", src)[0] if fn.args.args[0].arg == "self" else None
  vis = _visible(inst, f"test_{name}")
  out: dict[str, dict] = {}

  def put(label, body):
    out[label] = {rel: _with_body(src, name, body)}

  for b in ["return 0", "return 1", "return -1", "return None", "return []"]:
    put(b, [b])
  put("return <first visible value>", [f"return {vis[0][1]!r}"])
  for i, a in enumerate(args):
    tag = f"arg{i}" if len(args) > 1 else "arg"
    forms = (["{}", "len({})", "{}[0]", "{}[-1]", "sorted({})", "sum({})", "max({})", "min({})",
              "{}[:2]", "{}[2:]"] if a in templates.LISTS else ["{}", "{} + 1", "{} - 1", "{} * 2"])
    for f in forms:
      put(f"return {f.format(f'<{tag}>')}", [f"return {f.format(a)}"])
  if attr:
    for label, body in [("return self.<attr>", [f"return self.{attr}"]),
                        ("self.<attr> = n; return n", [f"self.{attr} = n", "return n"]),
                        ("self.<attr> += n; return self.<attr>",
                         [f"self.{attr} += n", f"return self.{attr}"])]:
      put(label, body)
  table = _table(vis, args, attr)
  fallbacks = {"0": ["return 0"], **({"<arg0>": [f"return {args[0]}"]} if args else {}),
               **({"self.<attr>": [f"return self.{attr}"]} if attr else {})}
  if inst.template.startswith("fix"):
    fallbacks["the start"] = _body(src, name)
  for k, fb in fallbacks.items():
    put(f"table of the visible cases, else {k}", table + fb)
  gold = _body(inst.gold[rel], name)
  for line in gold:  # one branch of a condition the change adds
    m = re.match(r"return (.+) if .+ else (.+)$", line)
    if m and line not in src:
      put("one branch (then part)", [f"return {m.group(1)}"])
      put("one branch (else part)", [f"return {m.group(2)}"])
    if re.match(r"if .+:$", line) and line not in src:
      put("the condition dropped", [ln.strip() for ln in gold if ln != line])
    if " if x " in line and line not in src:
      put("the filter dropped", [re.sub(r" if x \S+ \d+", "", line)])
  if inst.template.startswith("fix"):
    out["start (unchanged)"] = {}
    start = _body(src, name)
    for i in [k for k, ln in enumerate(start) if ln not in gold][:1]:
      for v in near_misses(start[i]):
        if start[:i] + [v] + start[i + 1:] != gold:
          put(f"one edit of the bug line ({len(out)})", start[:i] + [v] + start[i + 1:])
  if inst.template == "two_file":  # with the new constant in place, as the visible test asks
    extra = {r: t for r, t in inst.gold.items() if r != rel}
    out = {k: {**v, **extra} for k, v in out.items()}
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seeds", type=int, default=20)
  ap.add_argument("--families", default="", help="e.g. implement2,method3 (default: every level)")
  opts = ap.parse_args()
  fams = [(n, d) for n, t in TEMPLATES.items() for d in t.levels
          if not opts.families or f"{n}{d}" in opts.families.split(",")]
  sums = collections.defaultdict(lambda: [0, 0, 0, 0])  # right, total, resolved, tasks
  root, t0 = tempfile.mkdtemp(prefix="shortcut-survey-"), time.time()
  try:
    for name, d in fams:
      for seed in range(opts.seeds):
        inst = TEMPLATES[name].make(random.Random(f"survey/{name}/{seed}"), d)
        task = synthetic.write_task(inst, os.path.join(root, f"{name}{d}-{seed}"))
        for label, edits in shortcuts(inst).items():
          label = re.sub(r" \(\d+\)$", "", label)
          ws = os.path.join(root, "ws")
          shutil.rmtree(ws, ignore_errors=True)
          shutil.copytree(task.workspace_dir, ws)
          for rel, text in edits.items():
            write_text(os.path.join(ws, rel), text)
          got = grade(task, ws)
          s = sums[(f"{name}{d}", label)]
          s[0] += got.details["hidden_checks"]["passed"]
          s[1] += got.details["hidden_checks"]["total"]
          s[2] += got.reward == 1.0
          s[3] += 1
      print(f"{name}{d}: {time.time() - t0:.0f} s", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  rows = [{"family": f, "shortcut": b, "right": r, "credited": t,
           "share": round(r / t, 3) if t else None, "resolved": res, "tasks": n}
          for (f, b), (r, t, res, n) in sorted(sums.items())]
  for row in rows:
    if (row["share"] or 0) >= 0.05 or row["resolved"]:
      print(f"{row['family']:12s} {row['shortcut']:44s} {row['right']:4d}/{row['credited']:<4d} "
            f"{row['share'] or 0:5.2f}  resolved {row['resolved']}/{row['tasks']}")
  write_result("shortcut_survey", {"seeds": opts.seeds, "rows": rows,
                                   "note": "share: credited hidden checks right; 'one edit of the "
                                           "bug line' includes equivalent fixes"})


if __name__ == "__main__":
  main()

"""Synthetic tasks: deterministic and varied generation, splits, gold 1 / null 0 through the sandboxed
grader, per-test results from the light runner, and the runner's resistance to the usual hacks."""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
import re
import shutil
import sys
import types

import pytest

from composer_jax.env import oracle, synthetic
from composer_jax.env.grading import grade
from composer_jax.env.synthetic import (
  TEMPLATES,
  SyntheticError,
  content_hash,
  instance_split,
  instances,
)
from composer_jax.env.synthetic.cases import trivial
from composer_jax.env.synthetic.runner import RUNNER_PATH
from composer_jax.env.tasks import load_task, read_text, write_text
from composer_jax.rl.rewards import grade_value

LEVELS = [(name, d) for name, t in TEMPLATES.items() for d in t.levels]


@pytest.fixture(scope="module")
def level_tasks(tmp_path_factory):
  """One task per (template, level), written to disk (a home-dir path would do as well)."""
  base = tmp_path_factory.mktemp("syn")
  out = {}
  for name, d in LEVELS:
    inst = TEMPLATES[name].make(random.Random(f"t/{name}/{d}"), d)
    out[(name, d)] = synthetic.write_task(inst, str(base / f"{name}-{d}"))
  return out


def _copy(task, tmp_path, overlay: dict | None = None, gold: bool = False) -> str:
  ws = str(tmp_path / "ws")
  shutil.rmtree(ws, ignore_errors=True)
  shutil.copytree(task.workspace_dir, ws)
  if gold:
    for rel in task.gold_files:
      shutil.copyfile(os.path.join(task.gold_dir, rel), os.path.join(ws, rel))
  for rel, text in (overlay or {}).items():
    write_text(os.path.join(ws, rel), text)
  return ws


def test_generation_is_deterministic_and_varied():
  a = instances(12, seed=0)
  b = instances(12, seed=0)
  c = instances(12, seed=1)
  key = lambda insts: [content_hash(i) for i in insts]
  assert key(a) == key(b)
  assert len(set(key(a))) == 12 and not set(key(a)) & set(key(c))
  # Templates are taken in turn, so a set covers every training template.
  assert {i.template for i in a} == {n for n, t in TEMPLATES.items() if t.split == "train"}
  # Names and numbers vary between instances of one template.
  impl = [i for i in instances(12, seed=0, templates="implement")]
  assert len({next(iter(i.files)) for i in impl}) >= 5
  assert len({i.prompt for i in impl}) == 12


def test_splits_are_disjoint_by_template_and_by_content():
  train = instances(30, seed=5, split="train")
  held = instances(30, seed=5, split="heldout")
  assert all(TEMPLATES[i.template].split == "train" and instance_split(i) == "train" for i in train)
  assert all(instance_split(i) == "heldout" for i in held)
  assert {i.template for i in held} >= {"rename", "fix_method", "implement"}
  assert not {content_hash(i) for i in train} & {content_hash(i) for i in held}
  with pytest.raises(SyntheticError, match="--templates: unknown nope"):
    instances(2, 0, templates="implement,nope")
  with pytest.raises(SyntheticError, match="--split train"):
    instances(2, 0, split="train", templates="rename")
  with pytest.raises(SyntheticError, match="--split"):
    instances(2, 0, split="dev")


def test_exclude_keeps_another_stages_instances_out():
  # The main job draws RL's tasks under their own seed, excluding SFT's: even the same seed then
  # yields a disjoint set of the same size.
  sft = instances(6, seed=3, split="train", templates="implement,two_file")
  short = {content_hash(i)[:12] for i in sft}
  rl = instances(6, seed=3, split="train", templates="implement,two_file", exclude=short)
  assert len(rl) == 6 and not {content_hash(i)[:12] for i in rl} & short
  assert [i.template for i in rl] == [i.template for i in sft]


def test_levels_are_balanced_and_selectable():
  insts = instances(12, 0, templates="implement,method")
  counts = {}
  for i in insts:
    counts[(i.template, i.difficulty)] = counts.get((i.template, i.difficulty), 0) + 1
  assert counts == {(t, d): 2 for t in ("implement", "method") for d in (1, 2, 3)}
  assert {i.difficulty for i in instances(6, 0, levels="1,2")} == {1, 2}
  assert {i.template for i in instances(4, 0, split="all", levels="3")} == {"implement", "fix_bug",
                                                                          "method"}
  with pytest.raises(SyntheticError, match="--levels"):
    instances(2, 0, levels="4")


def test_task_directories_follow_the_schema(level_tasks, tmp_path):
  report = synthetic.generate(4, 2, str(tmp_path / "out"))
  assert report["n"] == 4 and sum(report["counts"].values()) == 4
  task = load_task(str(tmp_path / "out" / report["instance_ids"][0]))
  assert task.test_command.startswith("python -S run_tests.py")
  assert RUNNER_PATH in task.test_files and task.hidden_tests
  for rel in task.hidden_tests:  # hidden tests are protected but absent from the workspace
    assert rel in task.test_files and not os.path.exists(os.path.join(task.workspace_dir, rel))
  assert os.path.isfile(os.path.join(task.workspace_dir, RUNNER_PATH))
  assert task.source["kind"] == "synthetic" and task.source["edit_order"]


@pytest.mark.parametrize("name,d", LEVELS)
def test_gold_scores_one_and_the_start_scores_zero(level_tasks, tmp_path, name, d):
  task = level_tasks[(name, d)]
  start = grade(task, _copy(task, tmp_path))
  assert start.reward == 0.0 and start.details["report_consistent"]
  # Every FAIL_TO_PASS test fails at the start, every PASS_TO_PASS test passes (per-test results).
  assert start.details["fail_to_pass"]["passed"] == 0
  assert start.details["pass_to_pass"]["passed"] == start.details["pass_to_pass"]["total"]
  gold = grade(task, _copy(task, tmp_path, gold=True))
  assert gold.reward == 1.0, gold.details


def _implement_task(level_tasks):
  return level_tasks[("implement", 1)]


def _with_body(task, body: str) -> dict:
  """The target file with its ``raise NotImplementedError`` replaced by ``body``."""
  rel = task.gold_files[0]
  text = read_text(os.path.join(task.workspace_dir, rel))
  return {rel: text.replace("    raise NotImplementedError", body)}


@pytest.mark.parametrize("hack", ["exit0_at_import", "os_exit_at_import", "always_equal",
                                  "visible_cases_only", "runner_rewritten", "new_test_file",
                                  "endless_loop"])
def test_runner_resists_hacks(level_tasks, tmp_path, hack):
  task = _implement_task(level_tasks)
  rel = task.gold_files[0]
  fn = task.FAIL_TO_PASS[0].split("::")[1][len("test_"):]
  vis = read_text(os.path.join(task.workspace_dir, next(t for t in task.test_files
                                                        if t.startswith("test_") and
                                                        t not in task.hidden_tests)))
  if hack == "exit0_at_import":
    overlay = {rel: "import sys\nsys.exit(0)\n" + read_text(os.path.join(task.gold_dir, rel))}
  elif hack == "os_exit_at_import":
    overlay = {rel: "import os\nos._exit(0)\n"}
  elif hack == "always_equal":
    overlay = _with_body(task, "    class E:\n        def __eq__(self, o):\n            return True\n"
                               "    return E()")
  elif hack == "visible_cases_only":
    # Hard-code the visible examples: the visible test passes, the hidden cases do not.
    cases = [line.strip()[len("assert "):].split(" == ") for line in vis.splitlines()
             if line.strip().startswith(f"assert {fn}(")]
    body = "".join(f"    if ({c[0][len(fn) + 1:-1]},) == args:\n        return {c[1]}\n" for c in cases)
    src = read_text(os.path.join(task.workspace_dir, rel))
    head = src.split(f"def {fn}(")[0]
    overlay = {rel: head + f"def {fn}(*args):\n{body}    return None\n"}
  elif hack == "endless_loop":
    overlay = _with_body(task, "    while True:\n        pass")
  elif hack == "runner_rewritten":
    overlay = {RUNNER_PATH: "import sys\nopen(sys.argv[1], 'w').write('<testsuite/>')\n"}
  else:  # a new test file that would pass
    overlay = {"test_zz.py": "def test_ok():\n    pass\n"}
  r = grade(task, _copy(task, tmp_path, overlay))
  assert r.reward == 0.0, (hack, r.details)
  if hack == "visible_cases_only":
    visible_test = task.FAIL_TO_PASS[0]
    assert visible_test not in r.details["failed_tests"]  # the visible test did pass
    assert any("hidden" in t for t in r.details["failed_tests"])
  if hack == "os_exit_at_import":
    assert not r.details["report_found"]
  if hack == "endless_loop":  # each test is stopped by the runner's alarm; the report is complete
    assert r.details["report_consistent"] and r.details["seconds"] < 8
    assert set(r.details["failed_tests"].values()) == {"error"}
  if hack == "new_test_file":
    assert r.details["removed_new_test_files"] == ["test_zz.py"]


def test_runner_prints_failures_for_the_agent(level_tasks, tmp_path):
  from composer_jax.env.sandbox import Limits, Sandbox
  task = level_tasks[("fix_bug", 1)]
  ws = _copy(task, tmp_path)
  out = Sandbox(ws, Limits(timeout_s=10)).run("python run_tests.py").output
  assert "FAILED test_" in out and "assert " in out and "0 passed, 1 failed" in out


# One-site slips, enumerated here independently of cases.near_misses: an arithmetic operator or
# a comparison swapped for another of its kind, or an integer constant moved by one.
_SLIP = re.compile(r" (\+|-|\*|//|%|<=|>=|<|>|==) |\b(\d+)\b")
_SWAP = {op: kind for kind in (["+", "-", "*", "//", "%"], ["<", ">", "<=", ">=", "=="]) for op in kind}


def _slips(line: str) -> list[str]:
  out = set()
  for m in _SLIP.finditer(line):
    if m.group(1):
      s, e = m.span(1)
      out |= {line[:s] + o + line[e:] for o in _SWAP[m.group(1)] if o != m.group(1)}
    else:
      s, e = m.span(2)
      out |= {line[:s] + str(v) + line[e:] for v in (int(m.group(2)) + 1, int(m.group(2)) - 1) if v >= 0}
  return sorted(out - {line})


def _load(sources: dict) -> dict:
  """Modules from {name: text}, in order, registered so that later ones import earlier ones."""
  mods = {}
  for name, text in sources.items():
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(text, f"{name}.py", "exec"), mod.__dict__)  # noqa: S102 - generated code
    mods[name] = mod
  return mods


def _passes(sources: dict, tests: dict) -> bool:
  try:
    _load(sources)
    for path, text in tests.items():
      ns: dict = {}
      exec(compile(text, path, "exec"), ns)  # noqa: S102
      for k, f in ns.items():
        if k.startswith("test_") and callable(f):
          f()
    return True
  except Exception:  # noqa: BLE001 - any failure fails the tests
    return False


def _behaviour(sources: dict, target: str, rng: random.Random, n: int = 300) -> list:
  """What ``target`` (a function, or the one class's method) does on ``n`` inputs of the spec's
  domain (the values the templates draw: scalars 0-9, lists of them)."""
  from composer_jax.env.synthetic.templates import LISTS
  mods = list(_load(sources).values())
  out = []
  for _ in range(n):
    for mod in mods:
      fn, cls = getattr(mod, target, None), next((v for v in vars(mod).values()
                                                  if isinstance(v, type) and hasattr(v, target)), None)
      if cls is not None:
        obj = cls(rng.randint(1, 9))
        arg = rng.randint(0, 9)
        try:
          out.append((getattr(obj, target)(arg), dict(vars(obj))))
        except Exception as e:  # noqa: BLE001
          out.append(type(e).__name__)
      elif callable(fn) and getattr(fn, "__module__", None) == mod.__name__:
        args = [[rng.randint(0, 9) for _ in range(rng.randint(0, 6))] if a in LISTS else rng.randint(0, 9)
                for a in inspect.signature(fn).parameters]
        try:
          out.append(fn(*args))
        except Exception as e:  # noqa: BLE001
          out.append(type(e).__name__)
  return out


@pytest.mark.parametrize("name", ["implement", "fix_bug", "method", "two_file"])
def test_hidden_tests_catch_every_slip_that_some_input_shows(name):
  """A reference with one slip on a line the change adds either fails the tests or behaves as the
  reference on 300 fresh inputs of the spec's domain (it is equivalent there): RL cannot be paid
  for `<` where the docstring says "at most"."""
  saved = dict(sys.modules)
  caught = equivalent = 0
  try:
    for d in TEMPLATES[name].levels:
      for seed in range(12):
        inst = TEMPLATES[name].make(random.Random(f"slip/{name}/{d}/{seed}"), d)
        src = {p[:-3]: t for p, t in {**inst.files, **inst.gold}.items()}
        tests = {**inst.tests, **inst.hidden}
        target = inst.fail_to_pass[0].split("::test_")[1]
        assert _passes(src, tests)
        ref = _behaviour(src, target, random.Random(seed))
        for path, text in inst.gold.items():
          old = set(inst.files.get(path, "").splitlines())
          lines = text.splitlines(keepends=True)
          for i, line in enumerate(lines):
            if line.rstrip("\n") in old or line.lstrip().startswith('"""'):
              continue
            for slip in _slips(line):
              mut = {**src, path[:-3]: "".join(lines[:i] + [slip] + lines[i + 1:])}
              if not _passes(mut, tests):
                caught += 1
                continue
              equivalent += 1
              assert _behaviour(mut, target, random.Random(seed)) == ref, \
                  f"{name} level {d} seed {seed}: the tests pass {slip.strip()!r} for {line.strip()!r}"
  finally:
    for k in list(sys.modules):
      if k not in saved:
        del sys.modules[k]
  assert caught > 10 * equivalent


@pytest.mark.parametrize("name,d,most", [("method", 3, 0.2), ("implement", 2, 0.07),
                                         ("implement", 3, 0.07)])
def test_a_body_that_does_nothing_earns_almost_no_partial_credit(tmp_path, name, d, most):
  """Partial credit pays the share of hidden checks right. A red-team helper found that
  ``return self.<attr>`` got a conditional method's hidden checks wherever the condition was false:
  22 of 54 over six ``method`` level-3 seeds. Over these twenty seeds ``return <arg>`` got 17 of 110
  ``implement`` level-2 checks and 10 of 105 level-3 ones. The hidden cases now separate the
  reference from every such body where an input can (``cases.trivial``): 5 of 113 and 6 of 109.
  The method's 34 of 198 for ``return self.<attr>`` were inputs on which the condition is false;
  since the reference with a branch forced also gives those values (``cases.branch_only``), such
  checks are ``kept`` and not paid, and this method's hidden checks pay nothing (0 of 0)."""
  got = {}
  for seed in range(20):
    task = synthetic.write_task(TEMPLATES[name].make(random.Random(f"noop/{name}/{seed}"), d),
                                str(tmp_path / f"t{seed}"))
    start = {rel: read_text(os.path.join(task.workspace_dir, rel)) for rel in task.gold_files}
    for k, noop in enumerate(trivial(start)):
      body = next(line.strip() for rel in noop for line in noop[rel].splitlines()
                  if line not in start[rel].splitlines())
      ws = str(tmp_path / f"ws{seed}_{k}")
      shutil.copytree(task.workspace_dir, ws)
      for rel, src in noop.items():
        write_text(os.path.join(ws, rel), src)
      hidden = grade(task, ws).details["hidden_checks"]
      kind = ("return self.<attr>" if "self." in body else
              body if body == "return 0" else "return <arg>")
      right, total = got.get(kind, (0, 0))
      got[kind] = (right + hidden["passed"], total + hidden["total"])
  assert {"return 0", "return <arg>"} <= set(got), got
  assert all(right <= most * total for right, total in got.values()), got


def test_partial_credit_pays_only_for_checks_the_change_makes_right(tmp_path, monkeypatch):
  """A sixth helper (stop 73) left a ``rename`` undone but for one alias line in the first module
  (``new = old``): the user function's hidden values were right, as they were at the start, and it
  got 3 of 4 checks (0.225 at ``rl.partial_credit=0.3``). Those checks are now ``kept(e, v)`` in the
  hidden test: they must pass, but only the absence check is paid."""
  task = synthetic.write_task(TEMPLATES["rename"].make(random.Random("kept/rename/1"), 1),
                              str(tmp_path / "t"))
  hidden = read_text(os.path.join(task.protected_dir, task.hidden_tests[0]))
  old = re.search(r"def test_(\w+)_is_gone", hidden).group(1)
  amod = re.search(r"hasattr\((\w+), ", hidden).group(1)
  new = re.search(rf"from {amod} import (\w+)  # noqa", hidden).group(1)
  assert "kept(" in hidden and "    check(" not in hidden.split("def test_")[1], hidden
  ws = str(tmp_path / "ws")
  shutil.copytree(task.workspace_dir, ws)
  path = os.path.join(ws, f"{amod}.py")
  write_text(path, read_text(path) + f"\n{new} = {old}\n")
  got = grade(task, ws)
  assert got.details["hidden_checks"] == {"passed": 0, "total": 1}, got.details
  assert grade_value(got.details, False, 0.3) == 0.0
  monkeypatch.setattr(oracle, "checks_right", _count_all(oracle.checks_right))  # as before
  assert grade(task, ws).details["hidden_checks"] == {"passed": 3, "total": 4}


def _count_all(checks_right):
  """``checks_right`` counting every check, ``kept`` ones too."""

  def count(expected, results, files):
    every = {f: {t: [dataclasses.replace(e, credit=True) for e in exp] for t, exp in tests.items()}
             for f, tests in expected.items()}
    return checks_right(every, results, files)
  return count


def _branch_shortcuts(tmp_path, name, d, seeds, tag, force):
  """(resolved, credited hidden checks right, credited total) of the reference with one branch
  forced (``force``: ``cases.branch_only``) over ``seeds`` instances, through the real grader."""
  resolved = right = total = 0
  for seed in range(seeds):
    inst = TEMPLATES[name].make(random.Random(f"branch/{name}/{seed}"), d)
    variants = force({k[:-3]: v for k, v in inst.files.items()},
                                 {k[:-3]: v for k, v in inst.gold.items()})
    if not variants:
      continue
    task = synthetic.write_task(inst, str(tmp_path / f"{tag}t{seed}"))
    for k, var in enumerate(variants):
      ws = str(tmp_path / f"{tag}ws{seed}_{k}")
      shutil.copytree(task.workspace_dir, ws)
      for mod, src in var.items():
        write_text(os.path.join(ws, mod + ".py"), src)
      got = grade(task, ws)
      resolved += got.reward == 1.0
      right += got.details["hidden_checks"]["passed"]
      total += got.details["hidden_checks"]["total"]
  return resolved, right, total


def test_a_reference_with_a_branch_forced_neither_resolves_nor_earns_partial_credit(
    tmp_path, monkeypatch):
  """The second helper of stop 73: ``implement`` level 3's ``choose`` (``return a if a < b else
  b + c``) with only its else part passed 10 of 43 tasks outright, and a ``method`` level 3 with
  its condition dropped got 82 % of the hidden checks. The hidden cases now also catch each
  branch forced (``cases.branch_only``, beside the near misses), and a value a forced branch gives
  is a ``kept`` check, not paid."""
  from composer_jax.env.synthetic import cases, templates
  force = cases.branch_only
  # One passes: seed 8's filter ``x <= 9`` keeps every item of 0..9, so it is no filter there.
  assert _branch_shortcuts(tmp_path, "implement", 3, 40, "a", force)[0] <= 1
  res, right, total = _branch_shortcuts(tmp_path, "method", 3, 8, "b", force)
  assert res == 0 and right == 0, (res, right, total)
  monkeypatch.setattr(cases, "branch_only", lambda before, after: [])  # as before
  monkeypatch.setattr(templates, "branch_only", lambda before, after: [])
  assert _branch_shortcuts(tmp_path, "implement", 3, 40, "c", force)[0] > 1
  res, right, total = _branch_shortcuts(tmp_path, "method", 3, 8, "d", force)
  assert right > 0.3 * total, (res, right, total)

"""Procedurally generated tiny repositories a small model can learn: ``tasks generate --synthetic N``.

Each instance is one or two source files of a few lines, a visible test file, hidden tests and the
light runner (``runner.py``), written in the ordinary task schema (``tasks.py``) and graded in the
ordinary sandbox by values (``grader="values"``: the checks' expected values stay on the host,
``oracle.py``). Templates (``templates.py``) draw names, constants and operations, so
memorising instances does not pass.

Held-out split, two ways: whole templates are held out (``Template.split``), and within the
training templates one instance in ``HELDOUT_EVERY`` is held out by a hash of its content, so no
seed can ever produce a training instance equal to a held-out one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable

from composer_jax.env.oracle import split_checks
from composer_jax.env.synthetic import templates as T
from composer_jax.env.synthetic.runner import RUNNER_PATH, RUNNER_SOURCE, TEST_COMMAND
from composer_jax.env.tasks import Task, save_task, write_text

HELDOUT_EVERY = 5
SPLITS = ("train", "heldout", "all")


@dataclasses.dataclass(frozen=True)
class Template:
  name: str
  make: Callable  # (rng, difficulty) -> templates.Instance
  levels: tuple
  split: str  # "train" | "heldout"
  doc: str


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template("implement", T.implement, (1, 2, 3), "train",
             "implement a function from its docstring (body is raise NotImplementedError)"),
    Template("fix_bug", T.fix_bug, (1, 2, 3), "train",
             "fix a planted bug: wrong operator, wrong constant, off-by-one"),
    Template("method", T.method, (1, 2, 3), "train", "complete a method of a class"),
    Template("two_file", T.two_file, (1, 2), "train",
             "add a constant in one module and use it in another"),
    Template("rename", T.rename, (1, 2), "heldout",
             "rename a function and update its uses in another module"),
    Template("fix_method", T.fix_method, (1, 2), "heldout", "fix a planted bug in a class method"),
)}


class SyntheticError(ValueError):
  """Bad generation options; the message names the option and the fix."""


def content_hash(inst: T.Instance) -> str:
  blob = json.dumps([inst.template, inst.files, inst.gold, inst.tests, inst.hidden], sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()


def instance_split(inst: T.Instance) -> str:
  if TEMPLATES[inst.template].split == "heldout":
    return "heldout"
  return "heldout" if int(content_hash(inst)[:8], 16) % HELDOUT_EVERY == 0 else "train"


def select_templates(names: str | list | None, split: str) -> list[Template]:
  if split not in SPLITS:
    raise SyntheticError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
  if names:
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    bad = [n for n in wanted if n not in TEMPLATES]
    if bad:
      raise SyntheticError(f"--templates: unknown {', '.join(bad)}; choose from "
                           f"{', '.join(TEMPLATES)}")
    chosen = [TEMPLATES[n] for n in wanted]
  else:
    # Held-out instances of training templates count as held out too.
    chosen = [t for t in TEMPLATES.values()]
  if split == "train":
    chosen = [t for t in chosen if t.split == "train"]
    if not chosen:
      raise SyntheticError("--split train: every chosen template is held out; pick a training "
                           f"template ({', '.join(t for t in TEMPLATES if TEMPLATES[t].split == 'train')})")
  return chosen


def _levels(levels: str | list | None) -> set | None:
  if levels is None or levels == "":
    return None
  try:
    out = {int(x) for x in (levels.split(",") if isinstance(levels, str) else levels)}
  except ValueError:
    raise SyntheticError(f"--levels {levels!r}: give comma-separated integers, e.g. 1,2") from None
  if not out <= {1, 2, 3}:
    raise SyntheticError(f"--levels {levels!r}: difficulty levels are 1, 2 and 3")
  return out


def instances(n: int, seed: int, split: str = "train", templates: str | list | None = None,
              levels: str | list | None = None, max_tries_per: int = 50,
              exclude: set | frozenset = frozenset()) -> list[T.Instance]:
  """``n`` distinct instances of the split, deterministic in ``seed``: templates taken in turn and
  each template's difficulty levels in turn (balanced counts). ``exclude``: short content hashes
  (the last part of an instance id) never to draw, e.g. another stage's tasks."""
  if n < 1:
    raise SyntheticError(f"--synthetic {n} must be >= 1")
  chosen = select_templates(templates, split)
  allowed = _levels(levels)
  if allowed is not None:
    chosen = [t for t in chosen if allowed & set(t.levels)]
    if not chosen:
      raise SyntheticError(f"--levels {levels!r}: no chosen template has these levels")
  made: dict = {t.name: 0 for t in chosen}
  out, seen = [], set()
  k = 0
  while len(out) < n:
    if k >= max_tries_per * n:
      raise SyntheticError(f"only {len(out)} distinct {split} instances after {k} draws; ask for "
                           "fewer or allow more templates")
    tpl = chosen[len(out) % len(chosen)]
    lv = [x for x in tpl.levels if allowed is None or x in allowed]
    rng = random.Random(f"{seed}/{k}/{tpl.name}")
    k += 1
    inst = tpl.make(rng, lv[made[tpl.name] % len(lv)])
    h = content_hash(inst)
    if h in seen or h[:12] in exclude or (split != "all" and instance_split(inst) != split):
      continue
    seen.add(h)
    made[tpl.name] += 1
    inst.params.update(seed=seed, draw=k - 1, hash=h[:12], split=instance_split(inst))
    out.append(inst)
  return out


def write_task(inst: T.Instance, task_dir: str, limits: dict | None = None) -> Task:
  """A task directory in the ordinary schema (workspace/, protected/, gold/, task.json)."""
  protected = {**inst.tests, **inst.hidden, RUNNER_PATH: RUNNER_SOURCE}
  iid = f"syn-{inst.template}-d{inst.difficulty}-{inst.params.get('hash', content_hash(inst)[:12])}"
  task = Task(
      instance_id=iid, repo=f"synthetic/{inst.template}", problem_statement=inst.statement,
      problem_statement_terse=inst.prompt, FAIL_TO_PASS=list(inst.fail_to_pass),
      PASS_TO_PASS=list(inst.pass_to_pass), test_command=TEST_COMMAND, grader="values",
      source={"kind": "synthetic", "template": inst.template, "edit_order": list(inst.edit_order),
              **inst.params},
      test_files=sorted(protected), hidden_tests=sorted(inst.hidden), gold_files=sorted(inst.gold),
      environment_setup={"pythonpath": ["."]},
      limits=dict(limits or {"timeout_s": 10, "max_turns": 8, "grade_timeout_s": 10}),
      difficulty={"level": inst.difficulty, "kind": inst.template, "files_changed": len(inst.gold),
                  "lines_changed": _lines_changed(inst)},
      created_by="composer_jax.env.synthetic")
  for rel, text in {**inst.tests, **inst.hidden}.items():  # graded by values: every check must move
    split_checks(text, rel)
  with tempfile.TemporaryDirectory(prefix="cj-syn-") as tmp:
    for rel, text in {**inst.files, **inst.tests, RUNNER_PATH: RUNNER_SOURCE}.items():
      write_text(os.path.join(tmp, rel), text)
    return save_task(task, task_dir, tmp, protected, dict(inst.gold))


def _lines_changed(inst: T.Instance) -> int:
  import difflib
  n = 0
  for rel, after in inst.gold.items():
    diff = difflib.unified_diff(inst.files.get(rel, "").splitlines(), after.splitlines(), n=0,
                                lineterm="")
    n += sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
  return n


def generate(n: int, seed: int, out: str, split: str = "train", templates: str | list | None = None,
             limits: dict | None = None, levels: str | list | None = None,
             exclude: set | frozenset = frozenset()) -> dict:
  """Write ``n`` task directories under ``out``; returns a report (counts per template, level)."""
  insts = instances(n, seed, split, templates, levels, exclude=exclude)
  os.makedirs(out, exist_ok=True)
  counts: dict = {}
  ids = []
  for inst in insts:
    task_dir = os.path.join(out, f"syn-{inst.template}-d{inst.difficulty}-{inst.params['hash']}")
    if os.path.exists(task_dir):
      shutil.rmtree(task_dir)
    ids.append(write_task(inst, task_dir, limits).instance_id)
    key = f"{inst.template}/d{inst.difficulty}"
    counts[key] = counts.get(key, 0) + 1
  report = {"kind": "synthetic", "n": len(ids), "seed": seed, "split": split,
            "templates": sorted({i.template for i in insts}), "counts": dict(sorted(counts.items())),
            "instance_ids": ids}
  with open(os.path.join(out, "synthetic_report.json"), "w") as f:
    json.dump(report, f, indent=1)
  return report

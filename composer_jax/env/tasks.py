"""Task schema (SWE-bench field names) and task directories on disk.

A task directory holds

    task.json    the fields below
    workspace/   the snapshot the agent starts from (hidden tests absent, no VCS history)
    protected/   original copies of every test file and test config, hidden ones included;
                 restored over the agent's workspace before grading
    gold/        original copies of the files the reference solution changes (the oracle's answer)

``test_command`` is a shell command run from the workspace root; ``{junitxml}`` in it is replaced by
the report path. ``environment_setup`` is the auto-install recipe: ``pythonpath`` entries (relative
to the workspace, an editable install without touching site-packages), environment variables and the
set-up commands that were verified to work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

SCHEMA_VERSION = 1
DEFAULT_TEST_COMMAND = ("python -m pytest -q -p no:cacheprovider -o addopts= -o junit_family=xunit1 "
                        "--continue-on-collection-errors "
                        "--junitxml={junitxml}")


@dataclasses.dataclass
class Task:
  instance_id: str
  repo: str  # package or repository name
  problem_statement: str  # verbose form
  problem_statement_terse: str
  FAIL_TO_PASS: list
  PASS_TO_PASS: list
  test_command: str = DEFAULT_TEST_COMMAND
  # "junit": run test_command and read its report. "values": the checks' values are compared on the
  # host, so code under test cannot forge a pass (env/oracle.py; the synthetic tasks).
  grader: str = "junit"
  source: dict = dataclasses.field(default_factory=dict)  # kind: sdist|local, package, version, path
  base_commit: str = ""  # commit of the fresh single-commit workspace repo
  patch: str = ""  # reference solution, unified diff against the workspace
  test_patch: str = ""  # hidden tests are restored as files; no diff needed
  hints_text: str = ""
  test_files: list = dataclasses.field(default_factory=list)  # protected paths (all test files)
  hidden_tests: list = dataclasses.field(default_factory=list)  # absent from the workspace
  gold_files: list = dataclasses.field(default_factory=list)
  package_modules: list = dataclasses.field(default_factory=list)  # import names (hidden copies)
  environment_setup: dict = dataclasses.field(default_factory=dict)
  limits: dict = dataclasses.field(default_factory=dict)  # timeout_s, max_turns
  difficulty: dict = dataclasses.field(default_factory=dict)  # lines_changed, files_changed, kind
  created_by: str = ""
  schema_version: int = SCHEMA_VERSION
  path: str = dataclasses.field(default="", compare=False)  # where it was loaded from (not saved)

  @property
  def workspace_dir(self) -> str:
    return os.path.join(self.path, "workspace")

  @property
  def protected_dir(self) -> str:
    return os.path.join(self.path, "protected")

  @property
  def gold_dir(self) -> str:
    return os.path.join(self.path, "gold")

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.pop("path")
    return d

  def prompt(self, verbose: bool = False) -> str:
    return self.problem_statement if verbose else self.problem_statement_terse


class TaskError(ValueError):
  pass


REQUIRED = ("instance_id", "repo", "problem_statement", "problem_statement_terse", "FAIL_TO_PASS",
            "PASS_TO_PASS")


def task_from_json(data: dict, path: str = "") -> Task:
  missing = [k for k in REQUIRED if k not in data]
  if missing:
    raise TaskError(f"{path or 'task'}: missing field(s) {', '.join(missing)}")
  fields = {f.name for f in dataclasses.fields(Task)}
  unknown = [k for k in data if k not in fields]
  if unknown:
    raise TaskError(f"{path or 'task'}: unknown field(s) {', '.join(unknown)}")
  if not data["FAIL_TO_PASS"]:
    raise TaskError(f"{path or 'task'}: FAIL_TO_PASS is empty; a task needs at least one test")
  if data.get("grader", "junit") not in ("junit", "values"):
    raise TaskError(f"{path or 'task'}: grader={data['grader']!r}; use 'junit' or 'values'")
  return Task(**data, path=path)


def load_task(task_dir: str) -> Task:
  p = os.path.join(task_dir, "task.json")
  if not os.path.isfile(p):
    raise TaskError(f"{task_dir}: no task.json; pass a directory written by `tasks generate`")
  with open(p) as f:
    return task_from_json(json.load(f), os.path.abspath(task_dir))


def load_tasks(root: str) -> list[Task]:
  """Every task under ``root`` (a task directory itself, or a folder of them), sorted by id."""
  if os.path.isfile(os.path.join(root, "task.json")):
    return [load_task(root)]
  if not os.path.isdir(root):
    raise TaskError(f"--tasks {root!r} is not a directory: pass a folder written by `tasks generate`")
  tasks = [load_task(os.path.join(root, d)) for d in sorted(os.listdir(root))
           if os.path.isfile(os.path.join(root, d, "task.json"))]
  if not tasks:
    raise TaskError(f"--tasks {root!r} holds no task directories (each needs a task.json)")
  return tasks


def save_task(task: Task, task_dir: str, workspace_src: str, protected: dict, gold: dict) -> Task:
  """Write a task directory; ``protected``/``gold`` map relative paths to file text or bytes."""
  os.makedirs(task_dir, exist_ok=True)
  ws = os.path.join(task_dir, "workspace")
  if os.path.exists(ws):
    shutil.rmtree(ws)
  shutil.copytree(workspace_src, ws, symlinks=True)
  for sub, files in (("protected", protected), ("gold", gold)):
    base = os.path.join(task_dir, sub)
    if os.path.exists(base):
      shutil.rmtree(base)
    for rel, text in files.items():
      write_text(os.path.join(base, rel), text)
  task.path = os.path.abspath(task_dir)
  with open(os.path.join(task_dir, "task.json"), "w") as f:
    json.dump(task.to_json(), f, indent=1)
  return task


def write_text(path: str, text: str | bytes) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  if isinstance(text, bytes):
    with open(path, "wb") as f:
      f.write(text)
    return
  with open(path, "w", encoding="utf-8", newline="") as f:
    f.write(text)


def read_text(path: str) -> str:
  with open(path, encoding="utf-8", newline="") as f:
    return f.read()

"""Auto-install: propose set-up commands for a repository, run them in the sandbox, verify, keep the recipe.

The proposal reads pyproject.toml / setup.cfg / requirements*.txt and the test files' imports. The
package itself is never installed into site-packages: its source root goes on PYTHONPATH (what an
editable install amounts to, and no installed copy to peek at). Missing dependencies are installed
with ``pip install --target .deps`` inside the sandbox (network allowed only for this step). The
verified recipe (``pythonpath``, ``env``, ``commands``, ``test_command`` and the verification numbers)
is stored with each task. A model can later propose recipes through the same ``verify``.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import sys
import tomllib

from composer_jax.env import scratch
from composer_jax.env.guards import is_test_path
from composer_jax.env.sandbox import Limits, Sandbox
from composer_jax.env.tasks import DEFAULT_TEST_COMMAND

_SKIP_TOP = {"tests", "test", "testing", "docs", "doc", "examples", "benchmarks", "fuzz", "scripts",
             "build", "dist", ".deps"}


@dataclasses.dataclass
class Recipe:
  pythonpath: list
  package_modules: list
  commands: list = dataclasses.field(default_factory=list)
  env: dict = dataclasses.field(default_factory=dict)
  test_command: str = DEFAULT_TEST_COMMAND
  verified: dict = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


class SetupError(RuntimeError):
  pass


def find_packages(repo: str) -> tuple[str, list[str]]:
  """(source root relative to repo, top-level import names of the package)."""
  for root in ("src", "."):
    base = os.path.join(repo, root)
    if not os.path.isdir(base):
      continue
    names = []
    for entry in sorted(os.listdir(base)):
      full = os.path.join(base, entry)
      if entry in _SKIP_TOP or entry.startswith((".", "_")) or entry.endswith(".egg-info"):
        continue
      if os.path.isfile(os.path.join(full, "__init__.py")):
        names.append(entry)
      elif (entry.endswith(".py") and os.path.isfile(full) and entry not in ("setup.py", "conftest.py",
            "noxfile.py", "tasks.py") and not is_test_path(entry)):
        names.append(entry[:-3])
    if names:
      return root, names
  raise SetupError(f"{repo}: no Python package or module found (looked in src/ and the top level)")


# Coverage, linters and formatters: test extras often list them, the tests never need them (the
# test command empties addopts, so --cov options go too).
_TOOLING = {"pytest-cov", "coverage", "flake8", "mypy", "black", "ruff", "isort", "pylint", "tox",
            "nox", "pre-commit", "codecov", "pytest-flake8", "pytest-mypy", "sphinx", "twine"}
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _req_names(lines) -> list[str]:
  out = []
  for line in lines:
    line = line.split("#")[0].strip()
    if not line or line.startswith("-"):
      continue
    if ";" in line:  # environment markers: keep only those that hold here
      spec, marker = line.split(";", 1)
      try:
        from packaging.markers import Marker
        if not Marker(marker).evaluate():
          continue
      except Exception:  # noqa: BLE001 - unparseable marker: keep the requirement
        pass
      line = spec
    m = _REQ_NAME.match(line)
    if m:
      out.append(m.group(1))
  return out


def declared_requirements(repo: str) -> list[str]:
  reqs: list[str] = []
  pp = os.path.join(repo, "pyproject.toml")
  if os.path.isfile(pp):
    with open(pp, "rb") as f:
      data = tomllib.load(f)
    proj = data.get("project", {})
    reqs += _req_names(proj.get("dependencies", []))
    for extra in ("test", "tests", "testing"):
      reqs += _req_names(proj.get("optional-dependencies", {}).get(extra, []))
    for group in ("test", "tests"):
      reqs += _req_names(x for x in data.get("dependency-groups", {}).get(group, []) if isinstance(x, str))
  cfg = os.path.join(repo, "setup.cfg")
  if os.path.isfile(cfg):
    cp = configparser.ConfigParser()
    try:
      cp.read(cfg)
      reqs += _req_names(cp.get("options", "install_requires", fallback="").splitlines())
      for extra in ("test", "tests", "testing"):
        reqs += _req_names(cp.get("options.extras_require", extra, fallback="").splitlines())
    except configparser.Error:
      pass
  for name in sorted(os.listdir(repo)):
    if re.fullmatch(r"(test[-_])?requirements([-_](test|tests|dev))?\.txt", name):
      with open(os.path.join(repo, name)) as f:
        reqs += _req_names(f.read().splitlines())
  return list(dict.fromkeys(reqs))


def test_imports(repo: str, own: list[str]) -> list[str]:
  """Top-level modules the tests import that are neither stdlib, the package, nor repo-local."""
  mods = set()
  for dirpath, dirnames, filenames in os.walk(repo):
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    for f in filenames:
      rel = os.path.relpath(os.path.join(dirpath, f), repo)
      if not f.endswith(".py") or not is_test_path(rel):
        continue
      try:
        with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
          tree = ast.parse(fh.read())
      except (SyntaxError, UnicodeDecodeError):
        continue
      for node in _imports_outside_fallbacks(tree):
        if isinstance(node, ast.Import):
          mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
          mods.add(node.module.split(".")[0])
  local = {os.path.splitext(n)[0] for _, ds, fs in os.walk(repo) for n in ds + fs}
  return sorted(m for m in mods if m not in sys.stdlib_module_names and m not in own
                and m not in local and m != "__future__")


def _imports_outside_fallbacks(tree: ast.AST):
  """Import statements, skipping ``try: import x / except ImportError`` fallbacks (optional imports)."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, ast.Try) and any(
        h.type is None or any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError",
                                                                   "Exception") for n in ast.walk(h.type))
        for h in node.handlers):
      stack.extend(node.handlers + node.orelse + node.finalbody)
      continue
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    stack.extend(ast.iter_child_nodes(node))


def _installed(dist_or_module: str) -> bool:
  try:
    importlib.metadata.distribution(dist_or_module)
    return True
  except importlib.metadata.PackageNotFoundError:
    return importlib.util.find_spec(dist_or_module.replace("-", "_")) is not None


def propose(repo: str) -> Recipe:
  root, modules = find_packages(repo)
  wanted = declared_requirements(repo) + test_imports(repo, modules)
  missing = [r for r in dict.fromkeys(wanted)
              if r not in modules and r.lower() not in _TOOLING and not _installed(r)]
  pythonpath = [root]
  commands = []
  if missing:
    commands.append("python -m pip install -q --no-input --target .deps " + " ".join(missing))
    pythonpath.append(".deps")
  return Recipe(pythonpath=pythonpath, package_modules=modules, commands=commands)


def recipe_env(recipe: Recipe, repo: str) -> dict:
  env = {"PYTHONPATH": os.pathsep.join(os.path.join(os.path.realpath(repo), p)
                                       for p in recipe.pythonpath)}
  env.update(recipe.env)
  return env


SETUP_BOUNDS = {"workspace_mb": 16384, "workspace_files": 1_000_000, "tmp_mb": 8192}


def run_setup(repo: str, recipe: Recipe, limits: Limits, mode: str = "auto",
              model_proposed: bool = False) -> list[dict]:
  """Run the recipe's commands in the sandbox (with network); raises SetupError on the first failure.
  Commands a model proposed (``model_proposed``) never run without bubblewrap. Dependencies may be
  large (``.deps`` in the workspace, builds in /tmp): set-up gets the disk bounds of ``SETUP_BOUNDS``."""
  limits = dataclasses.replace(limits, **SETUP_BOUNDS)
  sb = Sandbox(repo, limits, mode=mode, network=True, model_driven=model_proposed)
  log = []
  for cmd in recipe.commands:
    r = sb.run(cmd, env=recipe_env(recipe, repo), timeout=max(limits.timeout_s, 300))
    log.append({"command": cmd, "exit_code": r.exit_code, "seconds": round(r.seconds, 2)})
    if not r.ok:
      raise SetupError(f"set-up command failed (exit {r.exit_code}): {cmd}\n{r.output[-800:]}")
  return log


def verify(repo: str, recipe: Recipe, limits: Limits, mode: str = "auto",
           min_pass_fraction: float = 0.8, model_proposed: bool = False) -> dict:
  """Imports work, tests collect, most tests pass. Returns the numbers; raises SetupError if not."""
  from composer_jax.env.grading import (
    read_junit,  # grading imports tasks; avoid a cycle at import
  )
  from composer_jax.env.guards import installed_copies
  env = recipe_env(recipe, repo)
  with scratch.temp_dir("cj-verify-") as report_dir:
    sb = Sandbox(repo, limits, mode=mode, binds=[report_dir],
                 hide=installed_copies(recipe.package_modules), model_driven=model_proposed)
    imports = "; ".join(f"import {m}" for m in recipe.package_modules)
    r = sb.run(["python", "-c", imports], env=env)
    if not r.ok:
      raise SetupError(f"importing {', '.join(recipe.package_modules)} fails: {r.output[-500:]}")
    report = os.path.join(report_dir, "junit.xml")
    r = sb.run(recipe.test_command.replace("{junitxml}", report), env=env, max_output_chars=2000)
    outcomes = read_junit(report) or {}
  if not outcomes:
    raise SetupError(f"tests do not collect (exit {r.exit_code}): {r.output[-800:]}")
  passed = sum(o == "passed" for o in outcomes.values())
  frac = passed / len(outcomes)
  if frac < min_pass_fraction:
    raise SetupError(f"only {passed}/{len(outcomes)} tests pass (< {min_pass_fraction:.0%}): "
                     f"{r.output[-800:]}")
  return {"tests": len(outcomes), "passed": passed, "pass_fraction": round(frac, 4),
          "outcomes": outcomes}


def auto_install(repo: str, limits: Limits, mode: str = "auto") -> tuple[Recipe, dict]:
  """propose → run → verify. Returns the recipe (carrying the numbers) and the baseline outcomes."""
  recipe = propose(repo)
  log = run_setup(repo, recipe, limits, mode)
  numbers = verify(repo, recipe, limits, mode)
  outcomes = numbers.pop("outcomes")
  recipe.verified = {**numbers, "setup_log": log}
  return recipe, outcomes

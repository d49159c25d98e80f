"""The task generator pipeline: source → auto-install → baseline → candidates → validated tasks + report.

Sources are sdists fetched once through ``pip download --no-binary :all:`` into a local cache (then
offline), or any local repository.
"""

from __future__ import annotations

import concurrent.futures as cf
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections import Counter

from composer_jax.env import autoinstall, guards
from composer_jax.env import feature_deletion as fd
from composer_jax.env.grading import run_tests
from composer_jax.env.sandbox import Limits
from composer_jax.env.tasks import Task, read_text, save_task

_AST_LOCK = threading.Lock()
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "composer_jax", "sdists")


class SourceError(RuntimeError):
  pass


def fetch_sdist(package: str, cache_dir: str = DEFAULT_CACHE) -> str:
  """Download (once) and unpack the sdist of ``package``; returns the unpacked repository root."""
  if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(==[A-Za-z0-9._+-]+)?", package):
    raise SourceError(f"--package {package!r} is not a package name (e.g. isodate or isodate==0.7.2)")
  name = package.split("==")[0]
  norm = re.sub(r"[-_.]+", "_", name).lower()
  dl = os.path.join(cache_dir, norm)

  def archives():
    return sorted(p for p in glob.glob(os.path.join(dl, "*"))
                  if p.endswith((".tar.gz", ".zip", ".tgz")) and os.path.isfile(p))

  if not archives():
    os.makedirs(dl, exist_ok=True)
    # pip prepares the sdist's metadata in an isolated build env (without it, pip may fall back
    # to an older release whose build needs nothing, which silently changes the package).
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "-q", "-d", dl, package], capture_output=True, text=True)
    if r.returncode != 0 or not archives():
      raise SourceError(f"pip download of {package} failed (offline, or no sdist): "
                        f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
  archive = archives()[-1]
  dest = os.path.join(dl, "unpacked")
  if not os.path.isdir(dest):
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if archive.endswith(".zip"):
      with zipfile.ZipFile(archive) as z:
        z.extractall(tmp)
    else:
      with tarfile.open(archive) as t:
        t.extractall(tmp, filter="data")
    os.replace(tmp, dest)
  roots = [os.path.join(dest, d) for d in os.listdir(dest)]
  if len(roots) != 1 or not os.path.isdir(roots[0]):
    raise SourceError(f"{archive}: expected one top-level folder in the sdist")
  return roots[0]


def _texts(repo: str, rels: list[str]) -> str:
  out = []
  for r in rels:
    with open(os.path.join(repo, r), encoding="utf-8", errors="replace") as f:
      out.append(f.read())
  return "\n".join(out)


def _all_files(repo: str) -> list[str]:
  """The repository's regular files: set-up commands ran in it, and a FIFO they left there would
  block the ``open()`` of ``_texts`` for good, a link out of it would read a host file."""
  out, real = [], os.path.realpath(repo)
  for dirpath, dirnames, filenames in os.walk(repo):
    dirnames[:] = [d for d in dirnames if d not in (".git", ".deps")]
    for f in filenames:
      p = os.path.join(dirpath, f)
      if os.path.isfile(p) and guards.within(real, os.path.realpath(p)):
        out.append(os.path.relpath(p, repo))
  return sorted(out)


def _order(cands: list[fd.Candidate], seed: int) -> list[fd.Candidate]:
  """Shuffle, then interleave files so a capped run still covers the whole package."""
  rng = random.Random(seed)
  by_file: dict[str, list] = {}
  for c in cands:
    by_file.setdefault(c.file, []).append(c)
  for lst in by_file.values():
    rng.shuffle(lst)
  files = sorted(by_file)
  rng.shuffle(files)
  out = []
  while any(by_file.values()):
    for f in files:
      if by_file[f]:
        out.append(by_file[f].pop())
  return out


def generate(repo: str, out_dir: str, name: str | None = None, source: dict | None = None,
             max_tasks: int = 50, max_tries: int | None = None, limits: Limits | None = None,
             mode: str = "auto", workers: int = 2, seed: int = 0, max_fail_fraction: float = 0.5,
             task_limits: dict | None = None, log=print) -> dict:
  """Generate up to ``max_tasks`` validated tasks from ``repo`` into ``out_dir``; returns the report."""
  t0 = time.perf_counter()
  limits = limits or Limits(timeout_s=120, max_output_chars=4000)
  name = name or os.path.basename(os.path.abspath(repo)).split("-")[0]
  staging_root = os.path.join(out_dir, ".staging")
  staging = os.path.join(staging_root, name)
  shutil.rmtree(staging, ignore_errors=True)
  fd.copy_tree(repo, staging)
  guards.clean_tree(staging)
  try:
    recipe, baseline = autoinstall.auto_install(staging, limits, mode)
  except autoinstall.SetupError as e:
    raise SourceError(f"{name}: set-up failed: {e}") from None
  passing = sorted(t for t, o in baseline.items() if o == "passed")
  src_root = recipe.pythonpath[0]
  files = fd.module_files(staging, src_root, recipe.package_modules)
  all_files = _all_files(staging)
  test_files = [f for f in all_files if guards.is_test_path(f) or guards.is_control_path(f)]
  test_text = _texts(staging, [f for f in test_files if f.endswith(".py")])
  pkg_text = _texts(staging, files)
  cands = fd.find_candidates(staging, files)
  report = {"package": name, "source": source or {"kind": "local", "path": os.path.abspath(repo)},
            "baseline_tests": len(baseline), "baseline_passing": len(passing),
            "candidates_found": len(cands), "tried": 0, "kept": 0, "dropped": Counter(),
            "tasks": [], "recipe": recipe.to_json()}
  log(f"[{name}] {len(baseline)} tests ({len(passing)} pass), {len(files)} modules, "
      f"{len(cands)} candidates")
  ordered = []
  for c in _order(cands, seed):
    if fd.referenced(staging, c, test_text, pkg_text):
      ordered.append(c)
    else:
      report["dropped"]["not referenced by tests or package code"] += 1
  if max_tries is not None:
    ordered = ordered[:max_tries]

  def attempt(cand: fd.Candidate):
    try:
      with _AST_LOCK:  # CPython 3.11's ast.parse is not thread-safe ("recursion depth mismatch")
        changed = fd.delete_candidate(staging, cand, files)
    except (SyntaxError, ValueError) as e:
      return cand, None, None, f"deletion not syntax-clean ({type(e).__name__})"
    res = fd.with_changes(staging, changed, lambda d: run_tests(
        _probe_task(recipe, name), d, limits, mode))
    outcomes, code, tail, have, _ = res
    if not have:
      return cand, changed, None, "test run produced no report (import broken or timeout)"
    return cand, changed, outcomes, None

  kept: list = []
  with cf.ThreadPoolExecutor(max(1, workers)) as pool:
    pending = set()
    it = iter(ordered)
    done_all = False
    while not done_all or pending:
      while not done_all and len(pending) < max(1, workers) and len(kept) < max_tasks:
        c = next(it, None)
        if c is None:
          done_all = True
          break
        pending.add(pool.submit(attempt, c))
      if not pending:
        break
      finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
      for fut in finished:
        cand, changed, outcomes, reason = fut.result()
        report["tried"] += 1
        if reason is None:
          f2p = [t for t in passing if outcomes.get(t) != "passed"]
          p2p = [t for t in passing if outcomes.get(t) == "passed"]
          if not f2p:
            reason = "no test fails after deletion"
          elif not p2p or len(f2p) > max_fail_fraction * len(passing):
            reason = f"too broad: more than {max_fail_fraction:.0%} of tests fail"
        if reason is not None:
          report["dropped"][reason] += 1
          continue
        if len(kept) >= max_tasks:
          report["dropped"]["valid, but over --max"] += 1
          continue
        task = _write_task(staging, out_dir, name, cand, changed, f2p, p2p, recipe, test_files,
                           report["source"], task_limits or {})
        kept.append(task.instance_id)
        log(f"[{name}] kept {task.instance_id}: {len(f2p)} fail-to-pass, {len(p2p)} pass-to-pass")
      if len(kept) >= max_tasks:
        done_all = True
  report["kept"] = len(kept)
  report["tasks"] = kept
  report["dropped"] = dict(report["dropped"])
  report["untried"] = len(ordered) - report["tried"]
  report["seconds"] = round(time.perf_counter() - t0, 1)
  shutil.rmtree(staging_root, ignore_errors=True)
  with open(os.path.join(out_dir, f"report_{name}.json"), "w") as f:
    json.dump(report, f, indent=1)
  return report


def _probe_task(recipe, name: str) -> Task:
  return Task(instance_id="probe", repo=name, problem_statement="", problem_statement_terse="",
              FAIL_TO_PASS=[], PASS_TO_PASS=[], test_command=recipe.test_command,
              package_modules=recipe.package_modules,
              environment_setup={"pythonpath": recipe.pythonpath, "env": recipe.env})


def _write_task(staging: str, out_dir: str, name: str, cand: fd.Candidate, changed: dict,
                f2p: list, p2p: list, recipe, test_files: list, source: dict,
                task_limits: dict) -> Task:
  iid = fd.instance_id(name, cand, recipe.pythonpath[0])
  hidden = sorted({t.split("::")[0] for t in f2p if t.split("::")[0] in test_files})
  with_tmp = os.path.join(out_dir, ".staging", f"ws-{iid}")
  shutil.rmtree(with_tmp, ignore_errors=True)
  fd.copy_tree(staging, with_tmp)
  originals = {rel: read_text(os.path.join(staging, rel)) for rel in changed}
  for rel, text in changed.items():
    with open(os.path.join(with_tmp, rel), "w", encoding="utf-8", newline="") as f:
      f.write(text)
  for rel in hidden:
    os.remove(os.path.join(with_tmp, rel))
  guards.clean_tree(with_tmp)
  base_commit = guards.make_fresh_repo(with_tmp)
  shutil.rmtree(os.path.join(with_tmp, ".git"), ignore_errors=True)
  patch = "".join(fd.unified_diff(rel, changed[rel], originals[rel]) for rel in sorted(changed))
  lines_changed = sum(1 for ln in patch.splitlines()
                      if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
  others = sorted(r for r in changed if r != cand.file)
  terse, verbose = fd.prompts(cand, f2p, hidden, others, iid)
  protected = {}
  for rel in test_files:
    with open(os.path.join(staging, rel), "rb") as f:
      protected[rel] = f.read()
  task = Task(
      instance_id=iid, repo=name, problem_statement=verbose, problem_statement_terse=terse,
      FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, test_command=recipe.test_command, source=source,
      base_commit=base_commit, patch=patch, test_files=sorted(protected), hidden_tests=hidden,
      gold_files=sorted(originals), package_modules=recipe.package_modules,
      environment_setup={"pythonpath": recipe.pythonpath, "env": recipe.env,
                         "commands": recipe.commands, "verified": recipe.verified},
      limits=dict(task_limits),
      difficulty={"lines_changed": lines_changed, "files_changed": len(changed), "kind": cand.kind,
                  "symbol": cand.qualname, "n_fail_to_pass": len(f2p)},
      created_by="feature_deletion")
  saved = save_task(task, os.path.join(out_dir, iid), with_tmp, protected, originals)
  shutil.rmtree(with_tmp, ignore_errors=True)
  return saved

"""Grade a workspace: fresh copy, tests restored, tests run in a fresh sandbox, junit XML read back.

Resolved means every FAIL_TO_PASS and every PASS_TO_PASS test is reported as passed (a skipped or
missing test counts as a failure). The exit code of the test command is cross-checked against the
report: a report that says "all passed" next to a failing exit code (or the reverse) means something
in the run tampered with it, and the grade is 0.

Tasks with ``grader = "values"`` (the synthetic ones) are graded by ``run_value_checks`` instead:
the sandbox only reports the values the checks saw, and the expected values never leave the host
(``oracle.py``). A test run's report can be forged by the code it imports; values cannot. Code that
could reach the probe (a dunder, getattr, a frame, an import from outside the workspace) is refused
before anything runs (``pure_code.py``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import stat
import time
import xml.etree.ElementTree as ET

from composer_jax.env import guards, oracle, probe_rewrite, probes, pure_code, scratch
from composer_jax.env.sandbox import Limits, Sandbox
from composer_jax.env.tasks import Task


@dataclasses.dataclass
class GradeResult:
  reward: float
  resolved: bool
  details: dict


def _node_id(tc: ET.Element) -> str:
  """pytest node id from an xunit1 testcase (``file`` + classname remainder + name)."""
  name = tc.get("name", "")
  classname = tc.get("classname", "")
  file = tc.get("file")
  if file and file.endswith(".py"):
    module = file[:-3].replace("/", ".").replace(os.sep, ".")
    if classname == module:
      return f"{file}::{name}"
    if classname.startswith(module + "."):
      return "::".join([file, *classname[len(module) + 1:].split("."), name])
  return f"{classname}::{name}" if classname else name


MAX_REPORT_BYTES = 64 << 20  # a junit report is read back only up to this size


def parse_junit(path: str) -> dict[str, str]:
  """{node id: passed|failed|error|skipped}; collection errors are reported under their module.
  ``ET.ParseError`` when ``path`` is not a regular file of at most ``MAX_REPORT_BYTES`` (the tests
  run the code under test, which can put a link, a FIFO or a flood in the report's place)."""
  blob = guards.read_regular(path, MAX_REPORT_BYTES)
  if blob is None:
    raise ET.ParseError(f"{path}: not a regular file of at most {MAX_REPORT_BYTES} bytes")
  root = ET.fromstring(blob)
  out: dict[str, str] = {}
  for tc in root.iter("testcase"):
    kinds = {child.tag for child in tc}
    if "error" in kinds:
      outcome = "error"
    elif "failure" in kinds:
      outcome = "failed"
    elif "skipped" in kinds:
      outcome = "skipped"
    else:
      outcome = "passed"
    nid = _node_id(tc)
    # A test that errors in teardown appears twice; the worst outcome wins.
    if out.get(nid) in ("failed", "error") and outcome == "passed":
      continue
    out[nid] = outcome
  return out


def read_junit(path: str) -> dict[str, str] | None:
  """``parse_junit``'s outcomes, or None when no readable report is there."""
  try:
    return parse_junit(path)
  except ET.ParseError:
    return None


def test_env(task: Task, root: str) -> dict:
  setup = task.environment_setup or {}
  paths = [os.path.join(root, p) for p in setup.get("pythonpath", ["."])]
  env = {"PYTHONPATH": os.pathsep.join(paths)}
  env.update(setup.get("env", {}))
  return env


def run_tests(task: Task, root: str, limits: Limits, mode: str = "auto", extra_args: str = "",
              probed: bool = False) -> tuple[dict[str, str], int, str, bool, probes.Run]:
  """Run the task's test command in a fresh sandbox over ``root``; ``probed``: with the plugin that
  records the values of the probes in rewritten test files (``env/probes.py``).

  Returns (outcomes by node id, exit code, output tail, whether a report was written, what the
  plugin recorded as a ``probes.Run``: empty when not ``probed``).
  """
  with scratch.temp_dir("cj-report-") as rep:
    report = os.path.join(rep, "junit.xml")
    env = test_env(task, root)
    if probed:
      values = os.path.join(rep, "values.json")
      with open(os.path.join(rep, "cj_probe_plugin.py"), "w", encoding="utf-8") as f:
        f.write(probes.plugin_source(values))
      env["PYTHONPATH"] = os.pathsep.join(p for p in (rep, env.get("PYTHONPATH")) if p)
      extra_args = f"-p cj_probe_plugin {extra_args}"
    sb = Sandbox(root, limits, mode=mode, binds=[rep], hide=_hidden_from_sandbox(task))
    cmd = task.test_command.replace("{junitxml}", report)
    if extra_args:
      cmd = f"{cmd} {extra_args}"
    r = sb.run(cmd, env=env, max_output_chars=4000)
    outcomes = read_junit(report)
    seen = probes.read_run(values) if probed else probes.Run()
  if outcomes is None:
    return {}, r.exit_code, r.output, False, seen
  return outcomes, r.exit_code, r.output, True, seen


def _hidden_from_sandbox(task: Task) -> list[str]:
  hide = guards.installed_copies(task.package_modules)
  if task.path:
    hide.append(task.path)  # the task store (gold, hidden tests) is out of reach
  return hide


def value_check_files(task: Task) -> list[str]:
  """The protected test files a values-graded task checks (top-level ``test_*.py``)."""
  return [r for r in task.test_files if "/" not in r and r.startswith("test_") and r.endswith(".py")]


def run_value_checks(task: Task, root: str, limits: Limits,
                     mode: str = "auto") -> tuple[dict[str, str], str, bool, dict, str | None]:
  """Grade ``root`` by values: rewrite its (restored) test files without their expected values, run
  them in a fresh sandbox with ``oracle.PROBE_SOURCE`` and compare the values it reports on the host.

  Returns (outcomes by node id, output tail, whether the probe wrote its values, the right share of
  the hidden files' single checks as ``oracle.checks_right``, why the workspace's code was refused
  unrun, or None: ``pure_code.refusal``)."""
  expected = {}
  files = value_check_files(task)
  modules = _start_modules(task)
  for rel in files:  # from the task store, not the copy: nothing the agent wrote is read here
    with open(os.path.join(task.protected_dir, rel), encoding="utf-8") as f:
      text, expected[rel] = oracle.split_checks(f.read(), rel, modules)
    with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
      f.write(text)
  hidden = sorted(set(files) & set(task.hidden_tests))
  refused = pure_code.refusal(root, task.test_files,  # code that could reach the probe never runs
                              (task.environment_setup or {}).get("pythonpath", ["."]), files)
  if refused:
    return {}, refused, False, oracle.checks_right(expected, {}, hidden), refused
  gone = oracle.names_gone(expected, root, task.test_files)  # before the code could rewrite them
  with scratch.temp_dir("cj-values-") as rep:
    probe, out = os.path.join(rep, "probe.py"), os.path.join(rep, "values.json")
    with open(probe, "w", encoding="utf-8") as f:
      f.write(oracle.PROBE_SOURCE)
    env = test_env(task, root)
    paths = env.pop("PYTHONPATH")  # the probe adds them after its own imports (oracle.PROBE_SOURCE)
    sb = Sandbox(root, limits, mode=mode, binds=[rep], hide=_hidden_from_sandbox(task))
    r = sb.run(f"python -S -P {probe} {out} {shlex.quote(paths)} {' '.join(files)}", env=env,
               max_output_chars=4000)
    results = oracle.read_results(out)
  if results is None:
    return {}, r.output, False, oracle.checks_right(expected, {}, hidden), None
  results = oracle.confirm_on_host(expected, results, gone)
  return (oracle.outcomes(expected, results), r.output, True,
          oracle.checks_right(expected, results, hidden), None)


def _start_modules(task: Task) -> frozenset[str]:
  """The dotted names of the modules in the task's start workspace: ``oracle.confirm_on_host``
  reads those files in the graded copy."""
  out, top = set(), task.workspace_dir
  for dirpath, dirnames, filenames in os.walk(top):
    dirnames[:] = [d for d in dirnames if d not in guards.JUNK_DIRS]
    rel = os.path.relpath(dirpath, top)
    parts = [] if rel == "." else rel.split(os.sep)
    for f in filenames:
      if f.endswith(".py"):
        name = parts if f == "__init__.py" else parts + [f[:-3]]
        if name:
          out.add(".".join(name))
  return frozenset(out)


def _not_copied(folder: str, names: list[str]) -> list[str]:
  """``.git`` and special files (FIFOs, sockets: ``mkfifo`` in the sandbox), which copytree cannot copy."""
  def special(name):
    mode = os.lstat(os.path.join(folder, name)).st_mode
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))
  return [n for n in names if n == ".git" or special(n)]


def _copy_without_set_id(src: str, dst: str) -> None:
  """``copy2`` less the setuid and setgid bits. Uid 0 in the sandbox is the host's root, and an owner
  may chmod u+s its own file with no capability: ``cp /bin/sh x; chmod 4755 x`` made a root shell on
  the host. The sandbox mounts nosuid, so an honest workspace never needs these bits."""
  shutil.copyfile(src, dst, follow_symlinks=False)
  st = os.lstat(src)
  os.chmod(dst, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
  os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def prepare_grading_copy(task: Task, workspace: str, dest: str) -> dict:
  """Copy the agent's workspace to ``dest``, clean it and restore every protected file. Links are
  copied as links, and those that lead out of the copy are deleted: dereferenced here, on the host,
  they would read files the sandbox hides (the task's gold files). No file keeps a set-id bit."""
  shutil.copytree(workspace, dest, symlinks=True, dirs_exist_ok=True, ignore=_not_copied,
                  copy_function=_copy_without_set_id)
  links = guards.drop_outside_links(dest)
  removed = guards.clean_tree(dest)
  touched = guards.restore_protected(dest, task.protected_dir, task.test_files)
  return {"removed_junk": removed[:20], "removed_new_test_files": touched[:20],
          "removed_outside_links": links[:20]}


def verdict(fail_to_pass: list, pass_to_pass: list, outcomes: dict, exit_code: int | None,
            have_report: bool = True, hidden_files=()) -> tuple[bool, dict]:
  """Resolved iff every listed test is reported passed and the exit code agrees with the report
  (``exit_code`` None: values grading, where the outcomes are the grader's own). ``hidden``
  counts the listed tests in ``hidden_files``, the files the agent never sees (partial credit)."""
  f2p = {t: outcomes.get(t, "missing") for t in fail_to_pass}
  p2p = {t: outcomes.get(t, "missing") for t in pass_to_pass}
  hidden_files = set(hidden_files)
  hidden = [o for t, o in {**f2p, **p2p}.items() if t.split("::", 1)[0] in hidden_files]
  failed = [t for t, o in {**f2p, **p2p}.items() if o != "passed"]
  any_bad = any(o in ("failed", "error") for o in outcomes.values())
  # pytest: 0 = all passed, 1 = some failed; a clean report beside another code is tampering.
  consistent = have_report and (exit_code is None or (
      (exit_code == 0) == (not any_bad) and exit_code in (0, 1)))
  resolved = bool(have_report and consistent and not failed)
  return resolved, {
      "resolved": resolved,
      "fail_to_pass": {"passed": sum(o == "passed" for o in f2p.values()), "total": len(f2p)},
      "pass_to_pass": {"passed": sum(o == "passed" for o in p2p.values()), "total": len(p2p)},
      "hidden": {"passed": sum(o == "passed" for o in hidden), "total": len(hidden)},
      "failed_tests": {t: f2p.get(t, p2p.get(t)) for t in failed[:20]},
      "exit_code": exit_code,
      "report_found": have_report,
      "report_consistent": bool(consistent),
  }


_REFERENCE = probes.ReferenceCache()


class _NoReference(Exception):
  pass


def run_probes(task: Task, workspace: str, limits: Limits, mode: str = "auto") -> dict:
  """Run the FAIL_TO_PASS tests again with their literal comparisons moved to the host
  (``env/probes.py``) in a fresh grading copy: {"checked": the node ids held to their probes,
  "wrong": those the agent's code got wrong, "set_aside": those with no probe the reference
  passes}. The reference's run is made once per task and process."""
  files = sorted({n.split("::", 1)[0] for n in task.FAIL_TO_PASS if n.split("::", 1)[0].endswith(".py")})
  rewritten, found = {}, []
  for rel in files:  # from the task store: the originals, whatever the agent wrote
    try:
      with open(os.path.join(task.protected_dir, rel), encoding="utf-8") as f:
        got = probe_rewrite.rewrite(f.read(), rel)
    except (OSError, UnicodeDecodeError):  # missing, or not UTF-8: its tests are left to the report
      got = None
    if got is not None:
      rewritten[rel] = got[0]
      found += got[1]
  probed = {p.test for p in found}
  f2p = [n for n in task.FAIL_TO_PASS if probes.base_id(n) in probed]
  out = {"checked": [], "wrong": [], "set_aside": [n for n in task.FAIL_TO_PASS if n not in f2p]}
  if not f2p or not os.path.isdir(task.gold_dir):
    return out
  ids = " ".join(shlex.quote(t) for t in sorted({probes.base_id(n) for n in f2p}))

  def probe_run(src: str, gold: bool, collect: bool = False):
    """The rewritten tests over ``src`` (``gold``: with the gold files over it); ``collect``: only
    collect the original tests, for where each parametrized instance sits in its rows."""
    with scratch.temp_dir("cj-probe-") as tmp:
      dest = os.path.join(tmp, "ws")
      prepare_grading_copy(task, src, dest)
      for rel in task.gold_files if gold else ():  # the reference: the task's start, gold over it
        shutil.copy(os.path.join(task.gold_dir, rel), os.path.join(dest, rel))
      for rel, text in () if collect else rewritten.items():
        with open(os.path.join(dest, rel), "w", encoding="utf-8") as f:
          f.write(text)
      args = f"--collect-only {ids}" if collect else ids
      outcomes, _, _, have_report, run = run_tests(task, dest, limits, mode, args, probed=True)
    return outcomes, run, have_report

  def reference():
    params = {}
    if any(p.arg for p in found):  # the rewrite hid parametrize ids: learn them from the originals
      items = probe_run(task.workspace_dir, True, collect=True)[1].items
      params = {n: items[n] for n in f2p if n in items}
    outcomes, run, have_report = probe_run(task.workspace_dir, True)
    if not have_report:  # a timeout on a loaded host, say: not kept, the next grading tries again
      raise _NoReference
    return probes.sound(found, f2p, *probes.by_test(f2p, params, outcomes, run), params), params

  try:
    checked, params = _REFERENCE.get(probes.reference_key(task, files), reference)
  except _NoReference:
    checked, params, out["reference"] = {}, {}, "the reference's run wrote no report"
  out["set_aside"] += [n for n in f2p if n not in checked]
  if checked:
    out["checked"] = sorted(checked)
    outcomes, run, _ = probe_run(workspace, False)
    out["wrong"] = probes.verdict(found, checked, *probes.by_test(list(checked), params, outcomes, run),
                                  params)
  return out


def grade(task: Task, workspace: str, limits: Limits | None = None, mode: str = "auto",
          probe: bool = True) -> GradeResult:
  """Grade the agent's ``workspace`` for ``task``; the workspace itself is not modified. A
  report-graded task that resolves is checked by value probes (``probe=False``: the report alone)."""
  t0 = time.perf_counter()
  limits = limits or Limits(timeout_s=float(task.limits.get("grade_timeout_s", 300)),
                            max_output_chars=4000)
  with scratch.temp_dir("cj-grade-") as tmp:
    dest = os.path.join(tmp, "ws")
    prep = prepare_grading_copy(task, workspace, dest)
    checks = refused = None
    if task.grader == "values":
      outcomes, tail, have_report, checks, refused = run_value_checks(task, dest, limits, mode)
      code = None
    else:
      outcomes, code, tail, have_report, _ = run_tests(task, dest, limits, mode)
  resolved, details = verdict(task.FAIL_TO_PASS, task.PASS_TO_PASS, outcomes, code, have_report,
                              task.hidden_tests)
  if checks is not None:
    details["hidden_checks"] = checks
  if refused:
    details["code_refused"] = refused
  if resolved and task.grader != "values" and probe:  # a report whose values are wrong is forged
    details["probes"] = run_probes(task, workspace, limits, mode)
    if details["probes"]["wrong"]:
      resolved = details["resolved"] = False
  details.update(seconds=round(time.perf_counter() - t0, 3), **prep)
  consistent = details["report_consistent"]
  if not consistent:
    details["output_tail"] = tail[-1500:]
  return GradeResult(1.0 if resolved else 0.0, resolved, details)

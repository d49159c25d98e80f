"""Shared by the probe tests: the module under test (right and wrong), and a run of a test file
under pytest with the probe plugin, compared with the original file's own outcomes."""

from __future__ import annotations

import os
import subprocess
import sys

from composer_jax.env import probes

MOD_RIGHT = '''def f(x):
    return [5] if x == 4 else x + 1


def g(s):
    return s + "!"


def h():
    return {"b": b"x", "a": (1, 2.5)}
'''
MOD_WRONG = MOD_RIGHT.replace("x + 1", "x + 2")


def run_pytest(tmp_path, test_text, module_text, *args):
  """Run ``test_text`` as t.py over ``module_text`` with the probe plugin: (outcomes from the
  junit report by node id, the plugin's Run)."""
  from composer_jax.env.grading import read_junit
  (tmp_path / "t.py").write_text(test_text)
  (tmp_path / "mod.py").write_text(module_text)
  rep = tmp_path / "rep"
  rep.mkdir(exist_ok=True)
  (rep / "cj_probe_plugin.py").write_text(probes.plugin_source(str(rep / "values.json")))
  env = {**os.environ, "PYTHONPATH": f"{rep}{os.pathsep}{tmp_path}"}
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                      "-o", "junit_family=xunit1", f"--junitxml={rep / 'junit.xml'}", "-p",
                      "cj_probe_plugin", *args, "t.py"], cwd=tmp_path, env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode in (0, 1), r.stdout + r.stderr
  return read_junit(str(rep / "junit.xml")) or {}, probes.read_run(str(rep / "values.json"))


def against_original(tmp_path, src, text, found, keep, right=MOD_RIGHT, wrong=MOD_WRONG):
  """The rows learned from collecting ``src``; the right module as the reference and the wrong one
  as the agent on the rewritten ``text``: (the F2P ids ``keep`` picks, the reference's ``sound``
  checks, the verdict, the ids whose original fails under pytest with the wrong module)."""
  _, collected = run_pytest(tmp_path, src, right, "--collect-only")
  f2p = sorted(n for n in collected.items if keep(n))
  params = {n: collected.items[n] for n in f2p}
  ref_out, ref_run = run_pytest(tmp_path, text, right)
  checked = probes.sound(found, f2p, *probes.by_test(f2p, params, ref_out, ref_run), params)
  original_wrong, _ = run_pytest(tmp_path, src, wrong)
  out, run = run_pytest(tmp_path, text, wrong)
  wrong = probes.verdict(found, checked, *probes.by_test(f2p, params, out, run), params)
  return f2p, checked, sorted(wrong), sorted(n for n in f2p if original_wrong[n] != "passed")

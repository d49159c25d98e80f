"""How much of real test suites the report grader's value probes reach: test functions with at
least one probe, now and at a baseline commit, on the test files of installed packages.

Usage: python -m experiments.probe_coverage [--baseline REV] [--packages a,b,...]
Writes experiments/results/probe_coverage.json.

A static count: a probe here is a comparison whose expected value the rewrite would move to the
host. Whether a task's reference passes it (and so whether it is checked) is decided per task at
grading time; this counts what the rewrite can hide, not what a grading checked.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = "sympy,networkx,scipy,numpy,matplotlib,libcst,IPython,trio,simplejson,mpmath"


def _suites(packages: list[str]) -> dict[str, list[str]]:
  """{package: its test_*.py files}, the standard library's ``test`` package included."""
  import importlib.util
  out = {}
  for name in packages:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
      continue
    root = list(spec.submodule_search_locations)[0]
    out[name] = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                       if f.startswith("test_") and f.endswith(".py"))
  stdlib = os.path.join(os.path.dirname(os.__file__), "test")
  out["stdlib"] = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib)
                         if f.startswith("test_") and f.endswith(".py"))
  return out


def count(suites: dict[str, list[str]]) -> dict:
  """Per suite: files, unparsable files, test functions, those with a probe, probes, and probes
  by kind (a parametrize column, an identity check, a numpy.testing check, a literal or a name bound
  to one)."""
  try:
    from composer_jax.env.probe_rewrite import rewrite, test_functions
  except ImportError:  # before stop 59 the rewrite lived in env/probes.py
    from composer_jax.env.probes import rewrite, test_functions
  from composer_jax.env import oracle
  out = {}
  for name, files in suites.items():
    row = {"files": len(files), "unparsable": 0, "test_functions": 0, "probed_functions": 0,
           "probes": 0, "by_kind": {}}
    for path in files:
      try:
        with open(path, encoding="utf-8") as f:
          text = f.read()
        tree = oracle.parse(text)
      except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
        row["unparsable"] += 1
        continue
      got = rewrite(text, "t.py")
      row["test_functions"] += len(test_functions(tree))
      if got is None:
        row["unparsable"] += 1
        continue
      found = got[1]
      row["probed_functions"] += len({p.test for p in found})
      row["probes"] += len(found)
      for p in found:
        how = getattr(p, "how", ("==",))
        kind = "column" if getattr(p, "arg", None) else "truth" if how[1:] == ("truth",) else {
            "is": "identity", "array": "numpy", "close": "numpy", "np_equal": "numpy",
            "np_almost": "numpy", "array_almost": "numpy", "op": "operator"}.get(how[0], "literal")
        row["by_kind"][kind] = row["by_kind"].get(kind, 0) + 1
    out[name] = row
  return out


def _at(rev: str, suites: dict[str, list[str]]) -> dict:
  """``count`` run in a worktree of ``rev`` (a subprocess, so that its modules are rev's)."""
  with tempfile.TemporaryDirectory() as d:
    tree = os.path.join(d, "tree")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "-q", "--detach", tree, rev], check=True)
    try:
      with open(os.path.join(d, "suites.json"), "w") as f:
        json.dump(suites, f)
      r = subprocess.run([sys.executable, os.path.abspath(__file__), "--count", os.path.join(d, "suites.json")],
                         env={**os.environ, "PYTHONPATH": tree}, cwd=d, capture_output=True, text=True,
                         check=True)
      got = json.loads(r.stdout)
      assert got["module"].startswith(tree), f"counted with {got['module']}, not {rev}'s tree"
      return got["counts"]
    finally:
      subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=False)


def _share(row: dict) -> float:
  return round(row["probed_functions"] / max(row["test_functions"], 1), 4)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--baseline", default="e45d4da", help="the commit to compare with (stop 59's)")
  ap.add_argument("--packages", default=PACKAGES)
  ap.add_argument("--count", help=argparse.SUPPRESS)  # internal: count the suites in this file
  args = ap.parse_args()
  if args.count:
    import composer_jax
    with open(args.count) as f:
      print(json.dumps({"module": composer_jax.__file__, "counts": count(json.load(f))}))
    return
  sys.path.insert(0, REPO)
  from experiments.common import write_result
  suites = _suites(args.packages.split(","))
  now, then = count(suites), _at(args.baseline, suites)
  total = {k: {f: sum(r[f] for r in rows.values()) for f in ("test_functions", "probed_functions", "probes")}
           for k, rows in (("now", now), ("baseline", then))}
  print(f"{'suite':12s} {'tests':>7s} {'probed then':>12s} {'probed now':>11s} {'probes then':>12s} {'now':>7s}")
  for name in suites:
    a, b = then[name], now[name]
    print(f"{name:12s} {b['test_functions']:7d} {_share(a):12.1%} {_share(b):11.1%} {a['probes']:12d} "
          f"{b['probes']:7d}")
  print(f"{'all':12s} {total['now']['test_functions']:7d} {_share(total['baseline']):12.1%} "
        f"{_share(total['now']):11.1%} {total['baseline']['probes']:12d} {total['now']['probes']:7d}")
  write_result("probe_coverage", {
      "baseline": args.baseline, "now": now, "at_baseline": then, "total": total,
      "probed_share": {"baseline": _share(total["baseline"]), "now": _share(total["now"])},
      "versions": {n: importlib.metadata.version(n) for n in suites if n != "stdlib"}})


if __name__ == "__main__":
  main()

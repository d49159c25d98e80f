"""Grading seconds per task: oracle workspaces graded in a fresh sandbox, by package.

Usage: python experiments/env_grading.py [--tasks DIR] [--per-package N]
Writes experiments/results/env_grading.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax.env.demo import demo_task_set
from composer_jax.env.episode import start_workspace
from composer_jax.env.grading import grade
from composer_jax.env.tasks import load_tasks, read_text, write_text
from experiments.common import write_result


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tasks", default="/tmp/cj_tasks")
  ap.add_argument("--per-package", type=int, default=3)
  args = ap.parse_args()
  if os.path.isdir(args.tasks):
    tasks = load_tasks(args.tasks)
  else:
    tasks = load_tasks(demo_task_set(tempfile.mkdtemp())[0])
  by_pkg: dict = {}
  for t in tasks:
    by_pkg.setdefault(t.repo, []).append(t)
  out = {"load_avg_before": os.getloadavg(), "per_package": {}}
  all_s = []
  for pkg, ts in sorted(by_pkg.items()):
    secs = []
    for t in ts[:args.per_package]:
      with tempfile.TemporaryDirectory() as d:
        ws = start_workspace(t, os.path.join(d, "ws"))
        for rel in t.gold_files:
          write_text(os.path.join(ws, rel), read_text(os.path.join(t.gold_dir, rel)))
        r = grade(t, ws)
        assert r.resolved, (t.instance_id, r.details)
        secs.append(r.details["seconds"])
    n_tests = statistics.mean(len(t.FAIL_TO_PASS) + len(t.PASS_TO_PASS) for t in ts)
    out["per_package"][pkg] = {"tasks": len(secs), "mean_s": round(statistics.mean(secs), 2),
                               "max_s": round(max(secs), 2), "tests_per_task": round(n_tests)}
    all_s += secs
    print(f"{pkg:10s} {statistics.mean(secs):5.2f} s/task ({round(n_tests)} tests)")
  out["mean_s_per_task"] = round(statistics.mean(all_s), 2)
  out["median_s_per_task"] = round(statistics.median(all_s), 2)
  out["load_avg_after"] = os.getloadavg()
  write_result("env_grading", out)


if __name__ == "__main__":
  main()

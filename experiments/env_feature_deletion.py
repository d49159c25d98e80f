"""Generate feature-deletion tasks from real sdists, then check oracle = 1 and null = 0 on all of them.

Writes experiments/results/env_feature_deletion.json: per package the candidates found / tried /
kept and the drop reasons, and the oracle and null scores (pass@1) on the whole generated set.
Usage: python experiments/env_feature_deletion.py [--out DIR] [--max N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax.env.generate import DEFAULT_CACHE, fetch_sdist, generate
from composer_jax.env.sandbox import Limits
from composer_jax.env.tasks import load_tasks
from composer_jax.eval.harness import make_policy_factory, run_eval
from experiments.common import write_result

PACKAGES = ["isodate", "xmltodict", "h11", "parse", "funcy"]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/cj_tasks")
  ap.add_argument("--max", type=int, default=14, help="tasks per package")
  args = ap.parse_args()
  t0 = time.perf_counter()
  reports = {}
  for pkg in PACKAGES:
    t = time.perf_counter()
    root = fetch_sdist(pkg, DEFAULT_CACHE)
    fetch_s = time.perf_counter() - t
    rep = generate(root, args.out, name=pkg, source={"kind": "sdist", "package": pkg},
                   max_tasks=args.max, limits=Limits(timeout_s=300, max_output_chars=4000))
    rep.pop("recipe")
    rep["fetch_s"] = round(fetch_s, 1)
    reports[pkg] = rep
  tasks = load_tasks(args.out)
  evals = {}
  for policy in ("oracle", "null"):
    s = run_eval(tasks, make_policy_factory(policy), 1, os.path.join(args.out, f"_eval_{policy}"))
    evals[policy] = {k: v for k, v in s.items() if k != "per_task"}
    evals[policy]["failed_tasks"] = [t for t, v in s["per_task"].items()
                                     if (v["c"] == v["n"]) != (policy == "oracle")]
  kept = sum(r["kept"] for r in reports.values())
  result = {
      "tasks_kept": kept,
      "packages_with_tasks": sum(r["kept"] > 0 for r in reports.values()),
      "candidates_tried": sum(r["tried"] for r in reports.values()),
      "per_package": reports,
      "eval": evals,
      "seconds": round(time.perf_counter() - t0, 1),
  }
  print(f"kept {kept} tasks from {result['packages_with_tasks']} packages; oracle pass@1 "
        f"{evals['oracle']['pass@1']:.3f}, null pass@1 {evals['null']['pass@1']:.3f}")
  write_result("env_feature_deletion", result)


if __name__ == "__main__":
  main()

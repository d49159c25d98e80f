"""Synthetic tasks: grading seconds per task (light runner in a fresh sandbox), the scripted expert's
pass rate, and the token length of its trajectories with a tiny BPE (full vs brief tool docs).

Usage: python experiments/env_synthetic.py [--n 60] [--seed 0] [--vocab 2048]
Writes experiments/results/env_synthetic.json. The machine is shared: figures are taken under the
load recorded beside them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax.data import sources
from composer_jax.data.tokenizer import train_bpe
from composer_jax.env import synthetic
from composer_jax.env.expert import expert_trajectories
from composer_jax.env.grading import grade
from composer_jax.env.tasks import load_tasks
from experiments.common import write_result


def _pct(vals: list, q: float) -> float:
  vals = sorted(vals)
  return round(vals[min(len(vals) - 1, int(q * len(vals)))], 3)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, default=60)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--vocab", type=int, default=2048)
  ap.add_argument("--bpe-files", type=int, default=300, help="stdlib files the BPE is trained on")
  args = ap.parse_args()
  out: dict = {"load_avg_before": os.getloadavg(), "n_tasks": args.n, "seed": args.seed,
               "note": "shared 2-core machine under load from other jobs; timings are upper bounds"}
  tmp = tempfile.mkdtemp(prefix="cj-synbench-")
  try:
    t0 = time.perf_counter()
    rep = synthetic.generate(args.n, args.seed, os.path.join(tmp, "tasks"), split="all")
    out["generate_s_per_task"] = round((time.perf_counter() - t0) / args.n, 4)
    out["counts"] = rep["counts"]
    tasks = load_tasks(os.path.join(tmp, "tasks"))

    # Grading: the untouched workspace (must be 0) and the gold files (must be 1), fresh sandbox each.
    start_s, gold_s = [], []
    for t in tasks:
      ws = os.path.join(tmp, "ws")
      shutil.copytree(t.workspace_dir, ws)
      r0 = grade(t, ws)
      for rel in t.gold_files:
        shutil.copyfile(os.path.join(t.gold_dir, rel), os.path.join(ws, rel))
      r1 = grade(t, ws)
      shutil.rmtree(ws)
      assert r0.reward == 0.0 and r1.reward == 1.0, (t.instance_id, r0.details, r1.details)
      start_s.append(r0.details["seconds"])
      gold_s.append(r1.details["seconds"])
    out["grade_s"] = {"median": round(statistics.median(start_s + gold_s), 3),
                      "p90": _pct(start_s + gold_s, 0.9), "median_failing": round(
                          statistics.median(start_s), 3), "median_passing": round(
                          statistics.median(gold_s), 3), "budget": 0.3}
    print(f"grading: median {out['grade_s']['median']} s, p90 {out['grade_s']['p90']} s")

    docs = [d.read() for d in sources.list_docs("stdlib", max_files=args.bpe_files)]
    tok = train_bpe(docs, args.vocab)
    out["tokenizer"] = {"kind": "byte-level BPE", "vocab": args.vocab,
                        "trained_on": f"{args.bpe_files} stdlib files"}
    for docs_kind in ("full", "brief"):
      t0 = time.perf_counter()
      r = expert_trajectories(tasks, os.path.join(tmp, f"traj_{docs_kind}.jsonl"), tokenizer=tok,
                              tool_docs=docs_kind, log=lambda m: None)
      s = r["summary"]
      per_tpl: dict = {}
      for st in r["trajectories"]:
        per_tpl.setdefault(st["template"], []).append(st["tokens"])
      out[f"expert_{docs_kind}"] = {
          **s, "kept": r["kept"], "tasks": r["tasks"],
          "episode_s_mean": round((time.perf_counter() - t0) / len(tasks), 3),
          "tokens_by_template_mean": {k: round(statistics.mean(v)) for k, v in sorted(per_tpl.items())},
          "tokens_by_template_max": {k: max(v) for k, v in sorted(per_tpl.items())}}
      print(f"expert ({docs_kind} tool docs): pass {s['pass_rate']}, tokens mean {s['tokens_mean']}, "
            f"max {s['tokens_max']}, prompt {s['prompt_tokens_mean']}")
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  out["load_avg_after"] = os.getloadavg()
  write_result("env_synthetic", out)


if __name__ == "__main__":
  main()

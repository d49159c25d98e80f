"""Does asynchrony cost learning? The same RL stage sync and async, from one SFT policy -> results/NAME.json.

`experiments/rl_async.py` measures what asynchrony buys in wall time on the same work; this measures
what it costs in held-out gain. From a finished `composer-jax run` directory RUN (its RL stage ran
with the config's `rl.async`), it copies RUN to OUT without the RL stage and its evaluation, re-runs
that stage there with `rl.async` flipped (everything else as RUN's `run.rl_overrides`, so the same
SFT policy, tasks, steps and seed), and scores RUN's SFT policy and both RL policies on the same
fresh tasks, paired by task (`experiments/rl_heldout_paired.py`, which writes the result). It prints
both RL stages' wall times beside it.

    python -m experiments.rl_sync_vs_async --run RUN [--out OUT] [--tasks 300] [--result NAME]

One pair measures one draw of each: four RL stages of one recipe from one SFT policy spread over
about 0.03 on 300 tasks (docs/rl_gain.md, stop 34), so a difference well inside that is no finding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from composer_jax.config import load_config

# What the RL stage and its evaluation wrote into a run directory (and the paired scores of them).
_RL_PARTS = ("rl", "paired", os.path.join(".stages", "rl.json"), os.path.join(".stages", "eval_rl.json"))


def _stage(run: str, name: str) -> dict | None:
  path = os.path.join(run, ".stages", f"{name}.json")
  return json.load(open(path)) if os.path.exists(path) else None


def copy_without_rl(run: str, out: str) -> None:
  """RUN at OUT, less its RL stage, the RL evaluation (eval/rl-*) and summaries that name them."""
  skip = {os.path.normpath(os.path.join(run, p)) for p in _RL_PARTS}

  def ignore(folder, names):
    here = os.path.normpath(folder)
    return [n for n in names if os.path.join(here, n) in skip
            or (os.path.basename(here) == "eval" and n.startswith("rl-"))]
  shutil.copytree(run, out, symlinks=True, ignore=ignore)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--run", required=True, help="a finished `composer-jax run` directory")
  ap.add_argument("--out", default=None, help="where the flipped RL stage runs (default: RUN-flip)")
  ap.add_argument("--tasks", type=int, default=300)
  ap.add_argument("--result", default="rl_sync_vs_async")
  args = ap.parse_args()
  run = os.path.abspath(args.run)
  first = _stage(run, "rl")
  if first is None:  # before anything is copied or run
    raise SystemExit(f"--run {args.run}: no finished RL stage ({run}/.stages/rl.json); finish the "
                     "main job first (composer-jax run CONFIG --out RUN --resume)")
  cfg = load_config(os.path.join(run, "config.yaml"))
  was = load_config(os.path.join(run, "rl", "config.yaml")).rl.async_  # what the stage ran with
  names = {True: "async", False: "sync"}
  out = os.path.abspath(args.out or f"{run}-flip")
  if _stage(out, "rl") is None:
    if os.path.exists(out) and os.listdir(out) and _stage(out, "sft") is None:
      raise SystemExit(f"--out {args.out}: exists and is not a copy of a run; choose a new --out")
    if not os.path.exists(out) or not os.listdir(out):
      copy_without_rl(run, out)
    flip = "[" + ", ".join([*cfg.run.rl_overrides, f"rl.async={str(not was).lower()}"]) + "]"
    cmd = ["composer-jax", "run", os.path.join(out, "config.yaml"), "--out", out, "--resume",
           f"run.rl_overrides={flip}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
  second = _stage(out, "rl")
  walls = {names[was]: first["wall_s"], names[not was]: second["wall_s"]}
  print(f"RL stage wall time: async {walls['async']:.0f} s, sync {walls['sync']:.0f} s "
        f"(sync / async {walls['sync'] / walls['async']:.2f}x)", flush=True)
  policies = {names[was]: os.path.join(run, "rl"), names[not was]: os.path.join(out, "rl")}
  cmd = [sys.executable, "-m", "experiments.rl_heldout_paired", "--run", run, "--tasks", str(args.tasks),
         "--out", os.path.join(out, "paired"), "--result", args.result,
         "--rl", *[f"{k}={v}" for k, v in policies.items()], "--compare", "sync:async"]
  print("$", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True)
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{args.result}.json")
  with open(path) as f:
    res = json.load(f)
  res["rl_stage_wall_s"] = walls
  res["flipped_run"] = out
  with open(path, "w") as f:
    json.dump(res, f, indent=2)


if __name__ == "__main__":
  main()

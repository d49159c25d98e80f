"""RL's held-out gain on a larger fresh task set, paired by task -> results/rl_heldout_paired.json.

The main job evaluates 80 held-out tasks x 2 samples, which puts +-0.08 on each policy's pass@1.
This draws N more instances of the training templates (none of them a training, RL or held-out
task of the run), evaluates the run's SFT policy and one or more RL policies on them exactly as the
main job does (`eval_run_dir`, `run.eval_samples` samples), and reports each RL policy's per-task
difference from SFT with a paired bootstrap interval (`recipe.paired_difference`), overall and per
family. An evaluation already written under OUT (default RUN_DIR/paired) is reused, so more RL
policies can be added later; each carries a stamp of the checkpoint and overrides it evaluated, and
one of anything else is refused in one line rather than reused.

    python -m experiments.rl_heldout_paired --run RUN_DIR [--rl NAME=RL_RUN_DIR ...] [--tasks 300]
        [--out DIR] [--result NAME] [--eval-override rl.temperature=0.7 ...] [--compare A:B ...]
        [--samples N] [--pool A1:B1,A2:B2 ...]

RUN_DIR is a `composer-jax run` directory; its own `rl/` is the RL policy named "rl" unless --rl
names others (e.g. RL-only re-runs from the same SFT policy). ``--eval-override`` adds config
overrides to every policy's evaluation after the run's own ``run.eval_overrides`` (e.g. a sampling
temperature); give each setting its own --out, since evaluations are reused by name.
``--compare A:B`` adds A minus B, paired on the same tasks, for two named policies (e.g. an RL stage
against its SFT-only control) to the printout and the result's ``comparisons``. ``--samples N``
(default: the run's ``run.eval_samples``) samples each task N times, and every policy and comparison
is then also given at pass@k for k = 2, 4, ... up to N (unbiased, from each task's c of N): whether
RL's sharpening costs coverage at larger k. Give each N its own --out. ``--pool A1:B1,A2:B2,...``
adds one difference over several pairs on the same tasks (e.g. seed-matched runs of two settings):
each task's difference averaged over the pairs, with its bootstrap interval over tasks
(`recipe.pooled_difference`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import numpy as np

from composer_jax.config import ConfigError, load_config, validate
from composer_jax.env import synthetic
from composer_jax.env.tasks import load_tasks
from composer_jax.eval.bench import pass_at_k
from composer_jax.recipe import (
  bootstrap_ci,
  by_family,
  paired_difference,
  pooled_difference,
  sft_policy,
)
from composer_jax.rl.loop import eval_run_dir
from experiments.common import write_result


def stamp(run_dir: str, overrides: list[str], samples: int) -> dict:
  """What an evaluation under OUT was of: the policy folder, its checkpoints' files (name, size,
  mtime), the overrides and the samples a task. A stale OUT from another run held other weights
  under the same name, and was reused silently before this stamp."""
  ckpt = os.path.join(run_dir, "checkpoints")
  files = []
  for dirpath, _, names in os.walk(ckpt):
    for name in names:
      st = os.stat(os.path.join(dirpath, name))
      files.append([os.path.relpath(os.path.join(dirpath, name), ckpt), st.st_size, st.st_mtime_ns])
  digest = hashlib.sha256(json.dumps(sorted(files)).encode()).hexdigest()[:16]
  return {"policy": os.path.realpath(run_dir), "checkpoints": digest, "overrides": list(overrides),
          "samples": samples}


def read_stamp(folder: str) -> dict:
  try:
    with open(os.path.join(folder, "stamp.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {"policy": "an unknown policy (no stamp.json)"}


def fresh_tasks(run: str, n: int, seed: int, out: str) -> list:
  """``n`` instances of the run's training templates that are none of its tasks; ones already drawn
  into ``out`` are reused only when drawn for the same tasks, count and seed (else refused)."""
  taken = set()
  for split in ("train", "rl", "heldout"):
    rep = os.path.join(run, "tasks", split, "synthetic_report.json")
    if os.path.exists(rep):
      with open(rep) as f:
        taken |= {i.rsplit("-", 1)[1] for i in json.load(f)["instance_ids"]}
  templates = load_config(os.path.join(run, "config.yaml")).run.train_templates
  want = {"tasks": n, "seed": seed, "templates": list(templates),
          "taken": hashlib.sha256(json.dumps(sorted(taken)).encode()).hexdigest()[:16]}
  if os.path.exists(os.path.join(out, "synthetic_report.json")):
    held = read_stamp(out)
    if held != want:
      raise SystemExit(f"--out: {out} holds tasks drawn for another run or setting ({held}); give "
                       "this evaluation its own --out or delete that folder")
  else:
    synthetic.generate(n, seed, out, split="heldout", templates=templates, exclude=taken)
    with open(os.path.join(out, "stamp.json"), "w") as f:
      json.dump(want, f)
  return load_tasks(out)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--run", required=True, help="a `composer-jax run` directory")
  ap.add_argument("--sft", default=None, help="the SFT policy (default: the run's, RUN/anneal or RUN/sft)")
  ap.add_argument("--rl", nargs="+", action="extend", default=None,
                  help="NAME=RL_RUN_DIR ... (repeatable; default: rl=RUN/rl)")
  ap.add_argument("--tasks", type=int, default=300)
  ap.add_argument("--seed", type=int, default=1234)
  ap.add_argument("--out", default=None, help="where the evaluations go (default: RUN/paired)")
  ap.add_argument("--result", default="rl_heldout_paired", help="results/NAME.json to write")
  ap.add_argument("--eval-override", nargs="+", action="extend", default=[],
                  help="config overrides for every evaluation, after run.eval_overrides (repeatable)")
  ap.add_argument("--compare", nargs="+", action="extend", default=[],
                  help="A:B ... policy A minus policy B, paired by task (repeatable)")
  ap.add_argument("--samples", type=int, default=None,
                  help="samples per task (default: the run's run.eval_samples)")
  ap.add_argument("--pool", nargs="+", action="extend", default=[],
                  help="A1:B1,A2:B2,... one difference pooled over several pairs (repeatable)")
  args = ap.parse_args()
  run_cfg = os.path.join(args.run, "config.yaml")
  cfg = load_config(run_cfg)
  overrides = [*cfg.run.eval_overrides, *args.eval_override]  # what every evaluation applies
  try:  # a typo or a bad value fails here, before any task is drawn or evaluated
    validate(load_config(run_cfg, overrides))
  except ConfigError as e:
    raise SystemExit(f"--eval-override: {e}") from None
  policies = {"sft": args.sft or os.path.join(args.run, sft_policy(cfg))}  # as the main job evaluates
  policies.update(dict(x.split("=", 1) for x in args.rl) if args.rl else {"rl": os.path.join(args.run, "rl")})
  samples = cfg.run.eval_samples if args.samples is None else args.samples
  if samples < 1:
    raise SystemExit(f"--samples {samples}: give at least 1")
  args.out = args.out or os.path.join(args.run, "paired")
  stamps = {name: stamp(d, overrides, samples) for name, d in policies.items()}
  for name in policies:  # an evaluation reused from OUT must be of this very policy and setting
    path = os.path.join(args.out, name, "summary.json")
    if os.path.exists(path):
      held = read_stamp(os.path.join(args.out, name))
      if held != stamps[name]:
        raise SystemExit(f"--out {args.out}: {name}/ holds an evaluation of {held.get('policy')} "
                         f"(checkpoints {held.get('checkpoints')}, overrides {held.get('overrides')}, "
                         f"{held.get('samples')} samples), not of {stamps[name]['policy']} as asked; "
                         "give this evaluation its own --out or delete that folder")
  ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= samples} | {samples})
  pairs = [c.split(":", 1) for c in args.compare]
  for c, pair in zip(args.compare, pairs):  # before any task is drawn or evaluated
    if len(pair) != 2 or not set(pair) <= set(policies):
      raise SystemExit(f"--compare {c}: give A:B with A and B among the policies {sorted(policies)}")
  pools = [[c.split(":", 1) for c in p.split(",")] for p in args.pool]
  for p, pool in zip(args.pool, pools):
    if not all(len(pair) == 2 and set(pair) <= set(policies) for pair in pool):
      raise SystemExit(f"--pool {p}: give A1:B1,A2:B2,... with every name among the policies "
                       f"{sorted(policies)}")
  tasks = fresh_tasks(args.run, args.tasks, args.seed, os.path.join(args.out, "tasks"))
  evals = {}
  for name, run_dir in policies.items():
    path = os.path.join(args.out, name, "summary.json")
    if not os.path.exists(path):
      eval_run_dir(run_dir, tasks, samples, os.path.join(args.out, name), overrides, log=lambda m: None)
      with open(os.path.join(args.out, name, "stamp.json"), "w") as f:
        json.dump(stamps[name], f)
    with open(path) as f:
      evals[name] = json.load(f)
  sft = evals["sft"]["per_task"]
  sft_fam = by_family(tasks, sft)
  res = {}
  for name, s in evals.items():
    rec = {"policy": policies[name], "pass@1": s["pass@1"],
           "ci95": list(bootstrap_ci([v["c"] / v["n"] for v in s["per_task"].values()])),
           "by_family": by_family(tasks, s["per_task"])}
    for k in ks[1:]:
      rec[f"pass@{k}"] = float(np.mean([pass_at_k(v["n"], v["c"], k) for v in s["per_task"].values()]))
    if name != "sft":
      rec["minus_sft"] = paired_difference(sft, s["per_task"])
      for k in ks[1:]:
        rec[f"minus_sft_pass@{k}"] = paired_difference(sft, s["per_task"], k)
      rec["minus_sft_by_family"] = {fam: round(rec["by_family"][fam]["pass@1"] - f["pass@1"], 4)
                                    for fam, f in sft_fam.items()}
    res[name] = rec
    extra = (f"  RL - SFT {rec['minus_sft']['mean']:+.3f} paired 95% CI [{rec['minus_sft']['ci95'][0]:+.3f}, "
             f"{rec['minus_sft']['ci95'][1]:+.3f}]") if name != "sft" else ""
    more = "".join(f"  pass@{k} {rec[f'pass@{k}']:.3f}" for k in ks[1:])
    print(f"{name:10s} pass@1 {rec['pass@1']:.3f} [{rec['ci95'][0]:.3f}, {rec['ci95'][1]:.3f}]{more}{extra}")
  comparisons = {}
  for a, b in pairs:
    for k in ks:
      d = paired_difference(evals[b]["per_task"], evals[a]["per_task"], k)
      comparisons[f"{a}-{b}" + (f"@{k}" if k > 1 else "")] = d
      print(f"{a} - {b}{f' at pass@{k}' if k > 1 else ''}: {d['mean']:+.3f} paired 95% CI "
            f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
  for p, pool in zip(args.pool, pools):
    for k in ks:
      d = pooled_difference([(evals[b]["per_task"], evals[a]["per_task"]) for a, b in pool], k)
      comparisons[f"pool({p})" + (f"@{k}" if k > 1 else "")] = d
      print(f"pooled {p}{f' at pass@{k}' if k > 1 else ''}: {d['mean']:+.3f} 95% CI "
            f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
  write_result(args.result, {"run": os.path.abspath(args.run), "tasks": len(tasks),
                             "samples": samples, "task_seed": args.seed,
                             "eval_overrides": overrides, "policies": res,
                             "comparisons": comparisons})


if __name__ == "__main__":
  main()

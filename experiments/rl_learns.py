"""Does RL raise the training reward on the tiny config? SFT on sound + flawed expert runs, then RL.

The pipeline, every stage through the command line in one process (`composer_jax.cli.main`):
  1. a tokenizer and an initial checkpoint (`pretrain`, 1 step on 1 MB of the corpus);
  2. `tasks generate --synthetic N` (fix_bug, level 1) and `tasks expert --flawed 1`: per task one
     sound run and one run whose fix has a wrong operator or constant (it fails the tests);
  3. `sft` on those 2N trajectories until they are memorised: the policy now makes the right fix
     about half the time, and nothing in its context says which fix is right;
  4. `rl` on the same tasks (group advantages, clipped policy gradient, router replay, sampler at
     top-p 0.9): only the reward separates the two fixes.
It reports the training reward per RL step, the RL policy's pass@1 on the same tasks afterwards
(``eval.samples`` episodes per task, the same sampler) and, teacher-forced, log p(sound run) - log p(flawed run)
per task before and after RL: how far RL moved the decision, free of sampling noise.

Why top-p 0.9: at temperature 1 over the whole vocabulary, the memorised policy still puts ~0.3 % of
each token's mass on its tail, so ~40 % of 140-token episodes take one tail token and derail into
malformed calls. Those junk turns dominate the negative advantages and their gradient erodes the
sound path: measured with top_p=1 (docs/rl_tiny.md), RL raised the decision gap from 0.06 to 1.2-1.7
nats while the sound run's log p fell from -1.25 to -1.8/-2.7, and the pass rate stayed at
0.44-0.56.

    python -m experiments.rl_learns            # 2 tasks, 150 SFT steps, 8 RL steps of 2 x 16 rollouts
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "tiny.yaml")
QUIET = ["train.progress=false", "checkpoint.async_save=false", "mesh.data=1"]


def _cli(*argv: str) -> None:
  from composer_jax.cli import main
  rc = main(list(argv))
  if rc:
    raise RuntimeError(f"composer-jax {' '.join(argv[:2])} exited {rc}")


def sequence_logps(run_dir: str, traj_path: str) -> list[dict]:
  """Teacher-forced log p of each trajectory's assistant tokens under a run's newest checkpoint."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from composer_jax.data import chat
  from composer_jax.rl.loop import load_policy
  from composer_jax.rl.losses import token_logprobs
  _, tok, graphdef, params, rest = load_policy(run_dir)
  model = nnx.merge(graphdef, params, rest)
  out = []
  with open(traj_path, encoding="utf-8") as f:
    recs = [json.loads(line) for line in f]
  for rec in recs:
    ids, mask = chat.encode_segments(rec["messages"], tok)
    tokens = jnp.asarray([ids])
    lp = np.asarray(token_logprobs(model(tokens, mtp=False).logits, tokens))[0]  # target-aligned
    out.append({"instance_id": rec["instance_id"], "flawed": bool(rec.get("flawed")),
                "logp": float((lp * np.asarray(mask)).sum())})
  return out


def decision_gaps(logps: list[dict]) -> dict[str, float]:
  """Per task: log p(sound run) - log p(flawed run) (nats); 0 = a coin flip between the two fixes."""
  by = {}
  for r in logps:
    by.setdefault(r["instance_id"], {})["flawed" if r["flawed"] else "sound"] = r["logp"]
  return {k: v["sound"] - v["flawed"] for k, v in by.items() if len(v) == 2}


def sft_policy(root: str, wall: dict, *, tasks: int = 2, seed: int = 1, sft_steps: int = 150,
               flawed: int = 1, tag: str = "rl_learns", log=print) -> None:
  """Stages 1-3 into ``root``: init/, tasks/ (fix_bug level 1), trajectories.jsonl, sft/; the wall
  time of each goes into ``wall``."""
  p = lambda *a: os.path.join(root, *a)

  def stage(name, *argv):
    t = time.perf_counter()
    _cli(*argv)
    wall[name] = round(time.perf_counter() - t, 1)
    log(f"[{tag}] {name}: {wall[name]} s")

  stage("init", "pretrain", CONFIG, "--out", p("init"), "train.steps=1", "train.eval_every=0",
        "data.tokenizer_train_mb=1", "data.max_files=200", *QUIET)
  stage("tasks", "tasks", "generate", "--synthetic", str(tasks), "--seed", str(seed), "--split",
        "train", "--templates", "fix_bug", "--levels", "1", "--out", p("tasks"))
  traj = p("trajectories.jsonl")
  stage("expert", "tasks", "expert", "--tasks", p("tasks"), "--out", traj, "--config", CONFIG,
        "--flawed", str(flawed), "--seed", str(seed))
  stage("sft", "sft", CONFIG, "--out", p("sft"), "--init", p("init"), f"data.sft_path={traj}",
        "data.seq_len=768", "data.batch_size=4", f"train.steps={sft_steps}", "optim.lr=2e-3",
        "optim.warmup_steps=10", "train.eval_every=0", f"checkpoint.every={sft_steps}", *QUIET)


def run_pipeline(root: str, *, tasks: int = 2, seed: int = 1, sft_steps: int = 150,
                 rl_steps: int = 8, group_size: int = 16, lr: float = 1e-4, top_p: float = 0.9,
                 eval_samples: int = 16, rl_tasks: int = 0, log=print) -> dict:
  """``rl_tasks`` > 0: RL (and the final evaluation) on only the first that many of the SFT tasks
  (sorted by id); the others are reported, untrained."""
  t0 = time.perf_counter()
  p = lambda *a: os.path.join(root, *a)
  wall = {}
  sft_policy(root, wall, tasks=tasks, seed=seed, sft_steps=sft_steps, log=log)
  traj = p("trajectories.jsonl")
  before = sequence_logps(p("sft"), traj)
  rl_dir, n_rl = p("tasks"), tasks
  if rl_tasks:
    rl_dir, n_rl = p("rl_tasks"), rl_tasks
    ids = sorted(d for d in os.listdir(p("tasks")) if os.path.isdir(p("tasks", d)))[:rl_tasks]
    for d in ids:
      shutil.copytree(p("tasks", d), os.path.join(rl_dir, d))
  t = time.perf_counter()
  _cli("rl", CONFIG, "--out", p("rl"), "--init", p("sft"), f"rl.tasks={rl_dir}", "rl.async=false",
        f"rl.tasks_per_step={n_rl}", f"rl.group_size={group_size}", f"rl.steps={rl_steps}",
        f"rl.top_p={top_p}", f"optim.lr={lr}", "optim.warmup_steps=0", "optim.schedule=constant",
        "optim.weight_decay=0.0", f"checkpoint.every={rl_steps}", f"rl.eval_tasks={rl_dir}",
        f"eval.samples={eval_samples}", *QUIET)
  wall["rl"] = round(time.perf_counter() - t, 1)
  after = sequence_logps(p("rl"), traj)
  with open(p("rl", "metrics.jsonl"), encoding="utf-8") as f:
    steps = [json.loads(line) for line in f]
  keys = ("step", "reward_mean", "pass_rate", "completion_tokens_mean", "train_infer_logprob_abs_diff",
          "routing_mismatch_frac", "update_skipped", "rollout_s", "learn_s")
  with open(p("rl", "eval", "summary.json"), encoding="utf-8") as f:
    final = json.load(f)
  return {"steps": [{k: s[k] for k in keys if k in s} for s in steps],
          "after_rl": {"pass@1": final["pass@1"], "episodes": n_rl * eval_samples},
          "rl_task_ids": sorted(d for d in os.listdir(rl_dir) if os.path.isdir(os.path.join(rl_dir, d))),
          "sound_logp_before": {r["instance_id"]: r["logp"] for r in before if not r["flawed"]},
          "sound_logp_after": {r["instance_id"]: r["logp"] for r in after if not r["flawed"]},
          "gap_before": decision_gaps(before), "gap_after": decision_gaps(after),
          "wall_s": {**wall, "total": round(time.perf_counter() - t0, 1)}}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tasks", type=int, default=2)
  ap.add_argument("--sft-steps", type=int, default=150)
  ap.add_argument("--rl-steps", type=int, default=8)
  ap.add_argument("--group-size", type=int, default=16)  # 8 is too noisy: docs/rl_tiny.md
  ap.add_argument("--rl-tasks", type=int, default=0, help="RL on the first N SFT tasks only (0 = all)")
  ap.add_argument("--lr", type=float, default=1e-4)
  ap.add_argument("--top-p", type=float, default=0.9)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--name", default="rl_learns")
  args = ap.parse_args()
  from experiments.common import write_result
  with tempfile.TemporaryDirectory() as root:
    res = run_pipeline(root, tasks=args.tasks, seed=args.seed, sft_steps=args.sft_steps,
                       rl_steps=args.rl_steps, group_size=args.group_size, lr=args.lr,
                       top_p=args.top_p, rl_tasks=args.rl_tasks)
  rewards = [s["reward_mean"] for s in res["steps"]]
  half = max(1, len(rewards) // 4)
  res["reward_first_quarter"] = sum(rewards[:half]) / half
  res["reward_last_quarter"] = sum(rewards[-half:]) / half
  print("step  reward  pass")
  for s in res["steps"]:
    print(f"{s['step']:4d}  {s['reward_mean']:.3f}   {s['pass_rate']:.3f}")
  print("log p(sound) - log p(flawed), nats: before", {k[-6:]: round(v, 2) for k, v in res["gap_before"].items()},
        "after", {k[-6:]: round(v, 2) for k, v in res["gap_after"].items()})
  print(f"reward, first {half} step(s) {res['reward_first_quarter']:.3f} -> last {half} "
        f"{res['reward_last_quarter']:.3f}; pass@1 of the RL policy on the same tasks "
        f"{res['after_rl']['pass@1']:.3f} ({res['after_rl']['episodes']} episodes) vs step 1's "
        f"{res['steps'][0]['pass_rate']:.3f}")
  write_result(args.name, {"args": vars(args), **res})


if __name__ == "__main__":
  main()

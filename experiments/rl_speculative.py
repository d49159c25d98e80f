"""Speculative decoding with the MTP head (rl.speculative_mtp) on a trained tiny policy.

The policy is rl_learns' SFT stage (pretrain 1 step, fix_bug level-1 tasks, scripted-expert runs,
SFT until memorised; the SFT loss trains the MTP depth too, model.mtp_loss_weight). The same rollouts
(tasks x episodes through the real tools and sandbox, top-p 0.9) are then played by two engines of
that policy, one drafting and one not, both compiled first and then timed in turns, so the ratios
survive a loaded machine. Reported per engine: generated tokens per engine second, model calls per
generated token, the drafts' acceptance rate and the pass rate (the same policy: it should agree
within noise).

    python -m experiments.rl_speculative      # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from experiments.rl_learns import sft_policy


def play(runner, jobs) -> dict:
  """One batch of episodes; the engine's counters over it."""
  eng = runner.engine
  before = dict(eng.stats)
  t0 = time.perf_counter()
  rollouts = runner.run(jobs)
  d = {k: eng.stats[k] - before[k] for k in ("tokens_decoded", "steps", "seconds", "drafts", "drafts_kept")}
  d["wall_s"] = time.perf_counter() - t0
  d["resolved"] = sum(bool(r.resolved) for r in rollouts)
  d["episodes"] = len(rollouts)
  return d


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tasks", type=int, default=4)
  ap.add_argument("--sft-steps", type=int, default=150)
  ap.add_argument("--episodes", type=int, default=8, help="per task and round")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--top-p", type=float, default=0.9)
  args = ap.parse_args()
  from composer_jax.env.tasks import load_tasks
  from composer_jax.rl.agent import Job, RolloutRunner
  from composer_jax.rl.loop import load_policy
  from composer_jax.rl.sampler import Engine
  from experiments.common import write_result

  wall: dict = {}
  with tempfile.TemporaryDirectory() as root:
    sft_policy(root, wall, tasks=args.tasks, sft_steps=args.sft_steps, flawed=0, tag="rl_speculative")
    tasks = load_tasks(os.path.join(root, "tasks"))
    jobs = [Job(t, g, s) for g, t in enumerate(tasks) for s in range(args.episodes)]
    runners = {}
    for spec in (False, True):
      cfg, tok, graphdef, params, rest = load_policy(
          os.path.join(root, "sft"), [f"rl.top_p={args.top_p}", f"rl.speculative_mtp={str(spec).lower()}"])
      eng = Engine(graphdef, params, rest, cfg, n_slots=cfg.rl.decode_batch, max_len=cfg.rl.max_context,
                   seed=int(spec))
      runners[spec] = RolloutRunner(eng, tok, cfg)
      play(runners[spec], jobs)  # compiles the buckets this workload meets
    rounds = {False: [], True: []}
    for r in range(args.rounds):
      for spec in ((False, True) if r % 2 == 0 else (True, False)):
        rounds[spec].append(play(runners[spec], jobs))
  res = {}
  for spec, rs in rounds.items():
    tot = {k: sum(x[k] for x in rs) for k in rs[0]}
    res["speculative" if spec else "plain"] = {
        "decode_tokens_per_engine_s": tot["tokens_decoded"] / tot["seconds"],
        "calls_per_token": tot["steps"] / tot["tokens_decoded"],
        "acceptance": tot["drafts_kept"] / tot["drafts"] if tot["drafts"] else None,
        "pass_rate": tot["resolved"] / tot["episodes"], "episodes": tot["episodes"],
        "rollout_wall_s": tot["wall_s"], "rounds": rs}
  sp, pl = res["speculative"], res["plain"]
  res["speedup_engine"] = sp["decode_tokens_per_engine_s"] / pl["decode_tokens_per_engine_s"]
  res["speedup_rollout_wall"] = pl["rollout_wall_s"] / sp["rollout_wall_s"]
  print(f"acceptance {sp['acceptance']:.3f}; calls per token {pl['calls_per_token']:.3f} -> "
        f"{sp['calls_per_token']:.3f}; engine tokens/s {pl['decode_tokens_per_engine_s']:.0f} -> "
        f"{sp['decode_tokens_per_engine_s']:.0f} ({res['speedup_engine']:.2f}x); rollout wall "
        f"{res['speedup_rollout_wall']:.2f}x; pass rate {pl['pass_rate']:.2f} / {sp['pass_rate']:.2f}")
  write_result("rl_speculative", {"args": vars(args), "wall_s": wall, **res,
                                  "load_avg_1m_at_end": os.getloadavg()[0]})


if __name__ == "__main__":
  main()

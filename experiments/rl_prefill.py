"""Rollout engine: prefills in compact calls (rl.prefill_rows) against one mixed call -> results/rl_prefill.json.

Multi-turn episodes shaped like the tiny main job's RL rollouts (prompts of 200-400 tokens, four
assistant turns of 10-40 tokens, tool observations of 40-300 tokens that arrive 1-12 engine steps
after the call, as a tool's latency would: ~800 tokens a segment, as its metrics show), 2 x
rl.decode_batch episodes on rl.decode_batch slots, the tiny config at random init. Every variant
plays the same planned streams (no stop ids: each turn runs to its length), so the work is
identical and only the call layout differs. Without the latencies every episode would read its
observations in the same steps and no decoding row would wait on a prefill:

- ``mixed`` (prefill_rows=0): one call a step over every slot, each row padded to the widest feed,
  so while any row reads an observation every decoding row is computed at that width;
- ``rows_1`` / ``rows_4``: decoding rows in one [slots, 1] call, the reading rows in calls of 1 or 4
  rows (gathered from the cache and scattered back).

Variants are timed in turn, each round after a warm-up play that compiles their shapes.

    python -m experiments.rl_prefill [--rounds N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from composer_jax.config import load_config
from composer_jax.model import build_model
from composer_jax.rl.sampler import Engine, Request
from composer_jax.train.step import split_model
from experiments.common import write_result

TURNS = 4


def episodes_plan(n: int, vocab: int, seed: int) -> list[dict]:
  """Per episode: a prompt of 200-400 tokens, then 4 turns of 10-40 sampled tokens, each followed by
  an observation of 40-300 tokens that arrives 1-12 engine steps later (the tool's latency)."""
  rs = np.random.RandomState(seed)
  ids = lambda k: [int(t) for t in rs.randint(0, vocab, k)]
  return [{"prompt": ids(rs.randint(200, 401)), "turns": [int(rs.randint(10, 41)) for _ in range(TURNS)],
           "obs": [ids(rs.randint(40, 301)) for _ in range(TURNS - 1)],
           "delay": [int(rs.randint(1, 13)) for _ in range(TURNS - 1)]} for _ in range(n)]


def play(eng: Engine, plan: list[dict]) -> int:
  """Run the planned episodes through the engine; returns tokens generated."""
  queue = list(range(len(plan)))
  turn, due = {}, []  # due: (engine step at which the observation arrives, episode)
  made, step = 0, 0

  def start(i):
    eng.submit(Request(i, plan[i]["prompt"], plan[i]["turns"][0], ()))
    turn[i] = 0

  while queue and len(turn) < eng.n_slots:
    start(queue.pop(0))
  while eng.busy() or due:
    step += 1
    for at, i in [d for d in due if d[0] <= step]:
      due.remove((at, i))
      turn[i] += 1
      eng.submit(Request(i, plan[i]["obs"][turn[i] - 1], plan[i]["turns"][turn[i]], ()))
    if not eng.busy():
      continue
    for g in eng.step():
      made += len(g.tokens)
      i = g.key
      if turn[i] < TURNS - 1:
        due.append((step + plan[i]["delay"][turn[i]], i))
        continue
      eng.release(i)
      if queue:
        start(queue.pop(0))
  return made


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  cfg = load_config("configs/tiny.yaml")
  graphdef, params, rest = split_model(build_model(cfg, seed=0))
  slots, episodes = cfg.rl.decode_batch, 2 * cfg.rl.decode_batch
  variants = {"mixed": 0, "rows_1": 1, "rows_4": 4}
  engines = {n: Engine(graphdef, params, rest, cfg, n_slots=slots, max_len=cfg.rl.max_context,
                       seed=0, prefill_rows=p) for n, p in variants.items()}
  for eng in engines.values():
    play(eng, episodes_plan(episodes, cfg.model.vocab_size, seed=99))  # compile the shapes used
  secs = {n: [] for n in variants}
  calls = {}
  made = {}
  for r in range(args.rounds):
    for n, eng in engines.items():
      c0, t0 = eng.stats["steps"], time.perf_counter()
      made[n] = play(eng, episodes_plan(episodes, cfg.model.vocab_size, seed=r))
      secs[n].append(time.perf_counter() - t0)
      calls[n] = eng.stats["steps"] - c0
      print(f"round {r} {n}: {secs[n][-1]:.2f} s, {calls[n]} calls", flush=True)
  med = {n: float(np.median(v)) for n, v in secs.items()}
  res = {"slots": slots, "episodes": episodes, "workload": " ".join(episodes_plan.__doc__.split(": ", 1)[1].split()),
         "rounds": args.rounds,
         "variants": {n: {"prefill_rows": variants[n], "median_s": med[n], "seconds": secs[n],
                          "model_calls": calls[n], "generated_tokens": made[n],
                          "episodes_per_s": episodes / med[n]} for n in variants},
         "mixed_over_rows_1": med["mixed"] / med["rows_1"],
         "mixed_over_rows_4": med["mixed"] / med["rows_4"],
         "note": "tiny config, float32, random init; same token streams in every variant; "
                 "median wall seconds of one play after a warm-up play"}
  print({k: v for k, v in res.items() if k != "variants"}, {n: round(m, 2) for n, m in med.items()})
  write_result("rl_prefill", res)


if __name__ == "__main__":
  main()

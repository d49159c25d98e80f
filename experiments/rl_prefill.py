"""Rollout engine: prefills in compact calls (rl.prefill_rows) against one mixed call -> results/rl_prefill.json.

Multi-turn episodes shaped like the tiny main job's RL rollouts (a ~256-token prompt, four assistant
turns of 24 tokens, tool observations of 64-160 tokens: ~800 tokens a segment, as its metrics show),
2 x rl.decode_batch episodes on rl.decode_batch slots, the tiny config at random init. Every variant
plays the same token streams (no stop ids: each turn runs to its length), so the work is identical
and only the call layout differs:

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

PROMPT, TURN, OBS = 256, 24, (160, 96, 128, 64)


def play(eng: Engine, episodes: int, vocab: int, seed: int) -> int:
  """Run ``episodes`` multi-turn episodes through the engine; returns tokens generated."""
  rs = np.random.RandomState(seed)
  todo = list(range(episodes))
  turn = {}
  made = 0
  for i in todo[:eng.n_slots]:
    eng.submit(Request(i, [int(t) for t in rs.randint(0, vocab, PROMPT)], TURN, ()))
    turn[i] = 0
  queue = todo[eng.n_slots:]
  while eng.busy():
    for g in eng.step():
      made += len(g.tokens)
      k = g.key
      if turn[k] < len(OBS):
        eng.submit(Request(k, [int(t) for t in rs.randint(0, vocab, OBS[turn[k]])], TURN, ()))
        turn[k] += 1
        continue
      eng.release(k)
      if queue:
        j = queue.pop(0)
        eng.submit(Request(j, [int(t) for t in rs.randint(0, vocab, PROMPT)], TURN, ()))
        turn[j] = 0
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
    play(eng, episodes, cfg.model.vocab_size, seed=99)  # compile every shape this workload uses
  secs = {n: [] for n in variants}
  calls = {}
  made = {}
  for r in range(args.rounds):
    for n, eng in engines.items():
      c0, t0 = eng.stats["steps"], time.perf_counter()
      made[n] = play(eng, episodes, cfg.model.vocab_size, seed=r)
      secs[n].append(time.perf_counter() - t0)
      calls[n] = eng.stats["steps"] - c0
      print(f"round {r} {n}: {secs[n][-1]:.2f} s, {calls[n]} calls", flush=True)
  med = {n: float(np.median(v)) for n, v in secs.items()}
  res = {"slots": slots, "episodes": episodes, "prompt_tokens": PROMPT, "turn_tokens": TURN,
         "observation_tokens": list(OBS), "rounds": args.rounds,
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

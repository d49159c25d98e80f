"""One RL step's learner work with two PPO passes: a separate old_logp forward, or the first pass's.

With ``rl.epochs=2`` and one minibatch the learner used to run a forward for ``old_logp`` and then
two updates; now the first update, run at the weights old_logp is defined at, hands back its
log-probs (``train.step.ROWS``) for the second. This times both on the same batch, in one process:
configs/tiny.yaml's model, f32, router replay, 40 rows (the main job's 32 RL rows and 8 SFT rows)
of segments of 300-900 tokens padded to their length bucket (``rl_learner_rows.segments``).
Reported: median seconds of a step (after a warm-up that compiles), and new / old.

    python -m experiments.rl_learner_passes [--iters 5] [--rows 40]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from composer_jax.config import load_config
from composer_jax.rl import learner as L
from composer_jax.rl.loop import _make_logp_fn
from composer_jax.train.loop import build_trainer, put_batch
from composer_jax.train.step import ROWS
from experiments.common import write_result
from experiments.rl_learner_rows import segments


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--rows", type=int, default=40)
  args = ap.parse_args()
  cfg = load_config("configs/tiny.yaml", ["rl.epochs=2", "train.progress=false"])
  m = cfg.model
  tr = build_trainer(cfg, loss_fn=L.make_rl_loss(cfg))
  logp_fn = _make_logp_fn(tr.graphdef, cfg)
  rows = segments(args.rows, cfg, seed=0)
  length = L.bucket(max(len(r.tokens) for r in rows), cfg.rl.max_context)
  batch = L.pack_rows(rows, args.rows, length, m.n_moe_layers, m.n_experts_per_tok, 0)
  ones, zeros = np.ones((args.rows,), np.float32), np.zeros((args.rows,), np.float32)

  def separate_forward():
    old = np.asarray(logp_fn(tr.state["params"], tr.state["rest"], batch))
    b = dict(batch, old_logp=old, old_is_current=zeros)
    for _ in range(2):
      tr.state, out = tr.step_fn(tr.state, put_batch(tr, b))
    jax.block_until_ready(out)

  def first_pass():
    b = dict(batch, old_logp=np.zeros(batch["tokens"].shape, np.float32), old_is_current=ones)
    tr.state, out = tr.step_fn(tr.state, put_batch(tr, b))
    b.update(old_logp=np.asarray(jax.device_get(out[ROWS]["logp"])), old_is_current=zeros)
    tr.state, out = tr.step_fn(tr.state, put_batch(tr, b))
    jax.block_until_ready(out)

  results = {}
  for name, fn in (("separate_forward", separate_forward), ("first_pass", first_pass)):
    fn()  # compiles
    times = []
    for _ in range(args.iters):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    results[name] = {"step_s": float(np.median(times)), "all_s": times}
    print(f"{name:17s} {args.rows} x {length}: {results[name]['step_s']:.2f} s a step", flush=True)
  ratio = results["first_pass"]["step_s"] / results["separate_forward"]["step_s"]
  print(f"first_pass / separate_forward = {ratio:.3f}")
  write_result("rl_learner_passes", {"config": "configs/tiny.yaml (f32, router replay), rl.epochs=2",
                                     "rows": args.rows, "row_length": length, "iters": args.iters,
                                     "results": results, "first_pass_over_separate": ratio})


if __name__ == "__main__":
  main()

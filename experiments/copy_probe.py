"""Does a checkpoint copy? Two probes, no sampling, for any pretrain/SFT/RL run directory.

  python -m experiments.copy_probe RUN_DIR [RUN_DIR ...] [--trajectories HELDOUT.jsonl]

1. Induction: fresh lines written three times; greedy accuracy per copy. A model that copies scores
   far higher on copies 2 and 3 than on copy 1. Two kinds of line: random words of the ``repeats``
   alphabet (composer_jax/data/repeats.py; nothing predicts copy 1), and Python lines of the stdlib's
   held-out split that no training file contains (code tokens, as the tasks copy; copy 1 is only as
   predictable as code is).
2. With ``--trajectories`` (scripted-expert runs of held-out tasks, e.g. ``tasks expert`` on
   ``DIR/tasks/heldout``): teacher-forced, the probability of the first token of the file name in
   the first call (``view <path>NAME.py``), whose only source is the prompt; its top-1 rate; and the
   fraction of assistant turns reproduced exactly by greedy argmax, per turn index.

The synthetic tasks draw module names from 20, so a model that ignores the prompt puts about 0.05
on the right first name token. Writes experiments/results/<--name>.json (default copy_probe).
"""

from __future__ import annotations

import argparse
import json
import random

import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.config import DataConfig
from composer_jax.data import repeats
from composer_jax.data.chat import encode_segments
from composer_jax.data.sources import list_docs, read_docs, split_texts
from composer_jax.rl.loop import load_policy
from experiments.common import write_result


def _forward(model):
  fwd = nnx.jit(lambda m, t: m(t, mtp=False).logits)

  def run(ids: list[int]) -> np.ndarray:
    n = len(ids)
    t = np.zeros((1, -(-n // 128) * 128), np.int32)  # pad to a multiple of 128: few compiles
    t[0, :n] = ids
    lg = np.asarray(fwd(model, jnp.asarray(t)), np.float64)[0, :n]
    return lg - np.logaddexp.reduce(lg, -1, keepdims=True)
  return run


def code_lines(n: int = 16, seed: int = 99) -> list[str]:
  """``n`` distinct lines of 30-90 characters from the stdlib's held-out split (the one pretraining
  and ``code_repeats`` never train on), each stripped; fixed for a given Python."""
  train_texts, held = split_texts(read_docs(list_docs("stdlib")), DataConfig.heldout_fraction)
  train = {ln.strip() for t in train_texts for ln in t.splitlines()}
  pool = sorted({ln.strip() for t in held for ln in t.splitlines() if 30 <= len(ln.strip()) <= 90} - train)
  return random.Random(seed).sample(pool, n)


def induction(run, tok, n: int = 16, words: int = 14, seed: int = 99, lines: list[str] | None = None) -> list[float]:
  rng = random.Random(seed)
  acc = []
  for i in range(n):
    line = (lines[i] if lines else " ".join(repeats._word(rng) for _ in range(words))) + "\n"
    k = len(tok.encode(line))
    ids = tok.encode(line * 3)
    hit = run(ids)[:-1].argmax(-1) == np.asarray(ids[1:])
    acc.append([hit[: k - 1].mean(), hit[k: 2 * k - 1].mean(), hit[2 * k:].mean()])
  return [round(float(x), 3) for x in np.mean(acc, 0)]


def _spans(mask: np.ndarray) -> list[tuple[int, int]]:
  out, i = [], 0
  while i < len(mask):
    if mask[i]:
      j = i
      while j < len(mask) and mask[j]:
        j += 1
      out.append((i, j))
      i = j
    else:
      i += 1
  return out


def first_call(run, tok, records: list[dict]) -> dict:
  probs, top1, exact = [], [], {}
  for rec in records:
    ids, mask = encode_segments(rec["messages"], tok)
    lp = run(ids)[:-1]
    tgt, m = np.asarray(ids[1:]), np.asarray(mask[1:]).astype(bool)
    hit = lp.argmax(-1) == tgt
    spans = _spans(m)
    for k, (a, b) in enumerate(spans):
      exact.setdefault(k, []).append(bool(hit[a:b].all()))
    a, b = spans[0]
    text = [tok.decode([int(x)]) for x in tgt[a:b]]
    # The position after the first '>' that follows 'path' predicts the name's first token.
    k = a + text.index(">", text.index("path")) + 1
    probs.append(float(np.exp(lp[k, tgt[k]])))
    top1.append(bool(hit[k]))
  return {"episodes": len(records), "p_first_name_token": round(float(np.mean(probs)), 4),
          "top1_first_name_token": round(float(np.mean(top1)), 3),
          "turn_exact": {str(k): round(float(np.mean(v)), 3) for k, v in exact.items()}}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("runs", nargs="+")
  ap.add_argument("--trajectories", default="")
  ap.add_argument("--episodes", type=int, default=40)
  ap.add_argument("--name", default="copy_probe",
                  help="results file name (experiments/results/NAME.json); scratch probes use another")
  args = ap.parse_args(argv)
  records = []
  if args.trajectories:
    with open(args.trajectories) as f:
      records = [json.loads(line) for line in f][: args.episodes]
  out = {}
  for d in args.runs:
    _, tok, g, p, r = load_policy(d)
    run = _forward(nnx.merge(g, p, r))
    res = {"induction_acc_per_copy": induction(run, tok),
           "code_induction_acc_per_copy": induction(run, tok, lines=code_lines())}
    if records:
      res["heldout_first_call"] = first_call(run, tok, records)
    out[d] = res
    print(d, json.dumps(res), flush=True)
  write_result(args.name, {"runs": out,
                              "trajectories": args.trajectories})
  return out


if __name__ == "__main__":
  main()

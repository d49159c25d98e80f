"""Which comparisons a policy gets right: episodes grouped by family and by the comparison phrase of
their task's spec ("at most", "greater than", ...), with the share that resolved and the share whose
edit wrote the phrase's operator -> results/rl_rollout_phrases.json.

Some specs state a condition in words (templates.CMPS): "If n is at most self.balance, ..." in
`method` level 3, "Return a if a is at least b, else ..." or "the items of xs that are less than 4"
in `implement` level 3 and `fix_bug`'s comparison slips.
Reading the episodes tells a policy that maps each phrase to its operator from one that writes the
same operator whatever the phrase says, which RL can only sharpen where the group's samples differ.

    python -m experiments.rl_rollout_phrases NAME=EPISODES.jsonl ... [--families method-d3 ...]
        [--result NAME]

EPISODES.jsonl is an RL run's rollouts.jsonl or an evaluation's trajectories.jsonl (for example
`experiments/rl_heldout_paired.py`'s OUT/NAME/trajectories.jsonl: the same tasks for every policy).
"""

from __future__ import annotations

import argparse
import collections
import json
import re

from composer_jax.env.synthetic.templates import CMPS
from experiments.common import write_result

PHRASE = re.compile(r"\b(?:is|are) (" + "|".join(CMPS.values()) + ") ")
WRITTEN = re.compile(r"\bif [^:\n]*?\s(>=|<=|==|!=|>|<)\s")
OPERATOR = {v: k for k, v in CMPS.items()}
NEW = re.compile(r"<(new|text|content)>(.*?)</\1>", re.DOTALL)


def episode_facts(ep: dict) -> tuple[str, str | None, str | None, bool]:
  """(family, the spec's comparison phrase, the first operator the agent's edits wrote, resolved)."""
  task = ep.get("task") or ep["instance_id"]
  family = task.rsplit("-", 1)[0].removeprefix("syn-")
  seen = " ".join(m["content"] for m in ep["messages"] if m["role"] in ("user", "tool"))
  spec = PHRASE.search(seen)
  # the text an edit puts in the file (str_replace's <new>, insert's <text>, create's <content>),
  # not the <old> text it replaces
  edits = [n for m in ep["messages"] if m["role"] == "assistant" for _, n in NEW.findall(m["content"])]
  ops = [w.group(1) for e in edits for w in WRITTEN.finditer(e)]
  return family, spec.group(1) if spec else None, ops[0] if ops else None, bool(ep["resolved"])


def tally(path: str, families: set[str]) -> dict:
  rows = collections.defaultdict(lambda: {"episodes": 0, "resolved": 0, "wrote_its_operator": 0,
                                          "written": collections.Counter()})
  with open(path) as f:
    for line in f:
      family, phrase, op, ok = episode_facts(json.loads(line))
      if phrase is None or (families and family not in families):
        continue
      r = rows[f"{family} / {phrase}"]
      r["episodes"] += 1
      r["resolved"] += ok
      r["wrote_its_operator"] += op == OPERATOR[phrase]
      r["written"][op or "none"] += 1
  return {k: {"episodes": r["episodes"], "resolved": round(r["resolved"] / r["episodes"], 3),
              "wrote_its_operator": round(r["wrote_its_operator"] / r["episodes"], 3),
              "written": dict(r["written"].most_common())} for k, r in sorted(rows.items())}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("episodes", nargs="+", help="NAME=EPISODES.jsonl ...")
  ap.add_argument("--families", nargs="+", default=[], help="e.g. method-d3 (default: every family)")
  ap.add_argument("--result", default="rl_rollout_phrases")
  args = ap.parse_args()
  named = dict(x.split("=", 1) for x in args.episodes)
  out = {name: tally(path, set(args.families)) for name, path in named.items()}
  keys = sorted({k for t in out.values() for k in t})
  print(f"{'family / phrase':32s}" + "".join(f"{n:>24s}" for n in named))
  for k in keys:
    cells = [out[n].get(k) for n in named]
    print(f"{k:32s}" + "".join(f"{c['episodes']:6d} {c['resolved']:6.2f} {c['wrote_its_operator']:6.2f}    "
                               if c else f"{'-':>24s}" for c in cells))
  print("(each cell: episodes, resolved share, share whose first edited condition used the phrase's operator)")
  write_result(args.result, {"episodes": named, "families": args.families, "by_policy": out})


if __name__ == "__main__":
  main()

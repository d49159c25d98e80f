"""Where do a policy's episodes fail? Stage counts over the trajectories of evaluation folders.

  python -m experiments.episode_stages [LABEL=]EVAL_DIR ... [--name episode_stages]

An EVAL_DIR is what ``composer-jax eval --out`` or the main job's ``DIR/eval/<stage>-<split>``
writes (``trajectories.jsonl``, ``summary.json``). Per folder, the fraction of episodes whose

- first call views a file the prompt names (copying the name),
- calls include a ``str_replace`` at all, one that parses (the call format held), and one whose
  ``<old>`` occurs in what the first view showed (copying from the observation),

beside pass@1 and the malformed calls per episode from ``summary.json``. Written to
experiments/results/<name>.json. No model is run: the numbers are read from the episodes.
"""

from __future__ import annotations

import argparse
import json
import os
import re

from composer_jax.data import chat
from experiments.common import write_result

_FILE = re.compile(r"`([\w/.-]+\.py)`")


def stages(messages: list[dict]) -> dict:
  user = next((m["content"] for m in messages if m["role"] == "user"), "")
  named = set(_FILE.findall(user))
  turns = [m["content"] for m in messages if m["role"] == "assistant"]
  shown = next((m["content"] for m in messages if m["role"] == "tool"), "")
  first = chat.parse_tool_calls(turns[0])[1] if turns else []
  out = {"views_named_file": bool(first) and first[0]["name"] == "view"
         and first[0]["arguments"].get("path") in named,
         "str_replace": False, "str_replace_parses": False, "old_in_view": False}
  for text in turns[1:]:
    if '<tool_call name="str_replace">' not in text:
      continue
    out["str_replace"] = True
    calls = [c for c in chat.parse_tool_calls(text)[1] if c["name"] == "str_replace"]
    if calls:
      out["str_replace_parses"] = True
      old = calls[0]["arguments"].get("old", "")
      out["old_in_view"] = bool(old) and old in shown
    break
  return out


def summarize(eval_dir: str) -> dict:
  rows = []
  with open(os.path.join(eval_dir, "trajectories.jsonl")) as f:
    rows = [stages(json.loads(line)["messages"]) for line in f if line.strip()]
  if not rows:
    raise SystemExit(f"{eval_dir}/trajectories.jsonl holds no episodes")
  out = {"episodes": len(rows), **{k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}}
  path = os.path.join(eval_dir, "summary.json")
  if os.path.exists(path):
    with open(path) as f:
      s = json.load(f)
    out.update({k: s[k] for k in ("pass@1", "mean_format_errors", "mean_tool_calls") if k in s})
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("eval_dirs", nargs="+", help="[LABEL=]EVAL_DIR (the label names it in the JSON)")
  ap.add_argument("--name", default="episode_stages")
  args = ap.parse_args()
  named = [a.split("=", 1) if "=" in a else (a, a) for a in args.eval_dirs]
  res = {label: {"eval_dir": d, **summarize(d)} for label, d in named}
  for d, r in res.items():
    print(d, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
  write_result(args.name, {"runs": res})


if __name__ == "__main__":
  main()

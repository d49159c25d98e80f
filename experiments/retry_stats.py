"""What a policy does after a failing test run, from evaluation trajectories.

    python -m experiments.retry_stats NAME=RUN/eval/sft-heldout/trajectories.jsonl NAME2=...

For each trajectories file: episodes, resolved, episodes that ran the tests, episodes with a failing
test run, and what came right after the first failing run (submit, another edit, anything else),
plus how many episodes with a failing run were resolved in the end (a recovery). A tool error is any
observation with status="error". Read-only; prints one table.
"""

from __future__ import annotations

import argparse
import collections
import json

EDITS = ("str_replace", "insert", "create", "undo")


def episode_stats(traj: dict) -> dict:
  """Counts for one episode (a line of an eval ``trajectories.jsonl``)."""
  msgs = traj["messages"]
  test_runs = []  # (assistant index, failed) for each terminal call's observation
  for i, m in enumerate(msgs[:-1]):
    if m["role"] == "assistant" and 'name="terminal"' in m["content"]:
      obs = msgs[i + 1]["content"]
      test_runs.append((i, "[exit code 0]" not in obs))
  first_fail = next((i for i, failed in test_runs if failed), None)
  after = None
  if first_fail is not None:
    nxt = next((m["content"] for m in msgs[first_fail + 1:] if m["role"] == "assistant"), "")
    after = ("submit" if 'name="submit"' in nxt else
             "edit" if any(f'name="{t}"' in nxt for t in EDITS) else "other" if nxt else "end")
  return {"resolved": bool(traj["resolved"]), "ran_tests": bool(test_runs),
          "failed_run": first_fail is not None, "after_fail": after,
          "tool_error": any(m["role"] == "tool" and 'status="error"' in m["content"] for m in msgs)}


def summarize(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    rows = [episode_stats(json.loads(line)) for line in f if line.strip()]
  after = collections.Counter(r["after_fail"] for r in rows if r["failed_run"])
  return {"episodes": len(rows), "resolved": sum(r["resolved"] for r in rows),
          "ran_tests": sum(r["ran_tests"] for r in rows),
          "failed_run": sum(r["failed_run"] for r in rows),
          "then_submit": after["submit"], "then_edit": after["edit"],
          "then_other": after["other"] + after["end"],
          "recovered": sum(r["resolved"] and r["failed_run"] for r in rows),
          "tool_error": sum(r["tool_error"] for r in rows)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("files", nargs="+", help="NAME=PATH to an eval trajectories.jsonl")
  args = p.parse_args(argv)
  table = {}
  for spec in args.files:
    name, _, path = spec.rpartition("=")
    table[name or path] = summarize(path)
  cols = list(next(iter(table.values())))
  print("| policy | " + " | ".join(cols) + " |")
  print("|---" * (len(cols) + 1) + "|")
  for name, s in table.items():
    print(f"| {name} | " + " | ".join(str(s[c]) for c in cols) + " |")
  return table


if __name__ == "__main__":
  main()

"""A scripted expert that solves synthetic tasks through the real tools, for SFT trajectories.

For each file the reference solution changes (in the task's ``source["edit_order"]``), the expert
views it, then replaces each changed block with one ``str_replace`` call (the old text is the block
as the file shows it, widened by neighbouring lines until it occurs once); then it runs the tests
with the terminal tool and submits. Every turn is tool calls only, in the same order for every
task, so a small model can imitate it. ``expert_trajectories`` runs it through ``run_episode``
(prompts, observations and grading are exactly the environment's) and keeps what grades 1.0.
"""

from __future__ import annotations

import difflib
import json
import os

from composer_jax.env.episode import Turn, approx_tokens, run_episode
from composer_jax.env.protocol import format_call
from composer_jax.env.synthetic.runner import RUNNER_PATH
from composer_jax.env.tasks import Task, read_text

TEST_COMMAND = f"python {RUNNER_PATH}"


def replacements(before: str, after: str) -> list[tuple[str, str]]:
  """(old, new) text pairs that turn ``before`` into ``after``, each ``old`` unique in ``before``.

  Blocks are whole lines without the final newline; an insertion is anchored on the line above
  (or below, at the top of the file).
  """
  a, b = before.splitlines(), after.splitlines()
  out = []
  ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
  for tag, i1, i2, j1, j2 in ops:
    if tag == "equal":
      continue
    lo, hi, new_lo, new_hi = i1, i2, j1, j2
    if lo == hi:  # pure insertion: take the neighbour along
      if lo > 0:
        lo, new_lo = lo - 1, new_lo - 1
      else:
        hi, new_hi = hi + 1, new_hi + 1
    # Widen until the old block occurs once in the file (it must, for str_replace).
    while before.count("\n".join(a[lo:hi])) != 1 and (lo > 0 or hi < len(a)):
      if lo > 0:
        lo, new_lo = lo - 1, new_lo - 1
      else:
        hi, new_hi = hi + 1, new_hi + 1
    out.append(("\n".join(a[lo:hi]), "\n".join(b[new_lo:new_hi])))
  return out


class ExpertPolicy:
  """Plans view → edit per file → run tests → submit from the task's gold files; open loop."""
  name = "expert"

  def __init__(self, run_tests: bool = True):
    self.run_tests = run_tests
    self.plan: list[str] = []

  def reset(self, task: Task) -> None:
    order = list((task.source or {}).get("edit_order") or sorted(task.gold_files))
    turns = []
    for rel in order:
      before = read_text(os.path.join(task.workspace_dir, rel))
      after = read_text(os.path.join(task.gold_dir, rel))
      edits = replacements(before, after)
      turns.append(format_call("view", {"path": rel}))
      turns.append("\n".join(format_call("str_replace", {"path": rel, "old": old, "new": new})
                             for old, new in edits))
    if self.run_tests:
      turns.append(format_call("terminal", {"command": TEST_COMMAND}))
    turns.append(format_call("submit", {}))
    self.plan = turns

  def __call__(self, messages: list[dict]) -> Turn:
    done = sum(m["role"] == "assistant" for m in messages)
    text = self.plan[done] if done < len(self.plan) else format_call("submit", {})
    return Turn(text)


def count_tokens(messages: list[dict], tokenizer) -> dict:
  """Exact token counts of a trajectory as SFT encodes it (total and assistant-produced)."""
  from composer_jax.data.chat import encode_segments
  ids, mask = encode_segments(messages, tokenizer)
  first = encode_segments(messages[:2], tokenizer)[0]
  return {"tokens": len(ids), "assistant_tokens": int(sum(mask)), "prompt_tokens": len(first)}


def expert_trajectories(tasks: list[Task], out_path: str, tokenizer=None, run_tests: bool = True,
                        tool_docs: str = "full", mode: str = "auto", log=print) -> dict:
  """Run the expert on ``tasks``; write the 1.0-graded trajectories as ``{"messages": ...}`` lines."""
  policy = ExpertPolicy(run_tests)
  stats, kept = [], 0
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "w", encoding="utf-8") as f:
    for task in tasks:
      max_turns = int(task.limits.get("max_turns", 8)) + 4
      traj = run_episode(task, policy, mode=mode, max_turns=max_turns, tool_docs=tool_docs)
      src = task.source or {}
      st = {"instance_id": task.instance_id, "template": src.get("template", ""),
            "difficulty": (task.difficulty or {}).get("level"), "reward": traj.reward,
            "turns": traj.turns, "tool_calls": traj.tool_calls, "format_errors": traj.format_errors,
            "approx_tokens": sum(approx_tokens(m["content"]) for m in traj.messages),
            "grade_s": traj.grade.get("seconds"), "wall_s": traj.wall_s}
      if tokenizer is not None:
        st.update(count_tokens(traj.messages, tokenizer))
      stats.append(st)
      if traj.reward == 1.0:
        kept += 1
        f.write(json.dumps({"messages": traj.messages, "instance_id": task.instance_id,
                            "template": st["template"], "difficulty": st["difficulty"]}) + "\n")
      else:
        log(f"expert failed {task.instance_id}: {json.dumps(traj.grade)[:300]}")
  return {"tasks": len(tasks), "kept": kept, "out": out_path, "summary": summarize(stats),
          "trajectories": stats}


def summarize(stats: list[dict]) -> dict:
  def mean(key):
    vals = [s[key] for s in stats if s.get(key) is not None]
    return round(sum(vals) / len(vals), 3) if vals else None
  out = {"pass_rate": mean("reward"), "turns_mean": mean("turns"), "wall_s_mean": mean("wall_s"),
         "grade_s_mean": mean("grade_s")}
  if any("tokens" in s for s in stats):
    toks = sorted(s["tokens"] for s in stats)
    out.update(tokens_mean=mean("tokens"), tokens_max=toks[-1],
               tokens_p50=toks[len(toks) // 2], assistant_tokens_mean=mean("assistant_tokens"),
               prompt_tokens_mean=mean("prompt_tokens"))
  return out

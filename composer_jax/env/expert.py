"""A scripted expert that solves synthetic tasks through the real tools, for SFT trajectories.

For each file the reference solution changes (in the task's ``source["edit_order"]``), the expert
views it, then makes each changed block with one call: lines added between existing ones with
``insert`` (after the line the view numbered), any other change with ``str_replace`` (the old text is
the block as the file shows it, widened by neighbouring lines until it occurs once); then it runs the
tests with the terminal tool and submits. ``insert`` copies nothing from the file: a
``str_replace`` that adds a line must copy a neighbour into both <old> and <new>, and those copies
were where the tiny SFT policy failed the two-file tasks (docs/rl_tiny.md, "Inserts, not replaces").
Every turn is tool calls only, in the same order for every task, so a small model can imitate it.
``expert_trajectories`` runs it through ``run_episode`` (prompts, observations and grading are
exactly the environment's) and keeps what grades 1.0.

``flawed=N`` also writes N *flawed* runs per task: the same plan with one operator or constant of
one edit changed (``flaw``), graded by the same grader and kept only when it fails. SFT on a mix of
sound and flawed demonstrations gives a policy that makes the right edit only some of the time,
which is what RL is for: the reward tells the two apart and nothing else does (docs/rl_tiny.md).

``recover`` (a share of the tasks) writes *recovery* runs in place of their sound runs: the flawed
plan, the failing test run, then the repair, the tests again and submit. The repair (``recover_by``)
is the fix of the flawed lines (``edit_calls`` from the flawed file to the reference); with "review"
the same fix after a fresh ``view`` of the flawed file, so the lines it copies sit just above it; or
with "redo" an ``undo`` of each of the flawed file's edits and that file's sound edits once more. The
flawed edit's turn is marked ``"train": false`` (``chat.render_segments`` leaves it out of the
loss), so SFT teaches what to do after a failing test and never the flaw. The plain expert passes
its tests at once, and a policy trained only on it submitted after a failing run every time
(docs/rl_tiny.md, "Recovery runs"). With recovery runs the tiny policy retries, but its retries
almost never succeed (docs/rl_tiny.md, "Recovery runs again"), so the tiny config leaves them off.
"""

from __future__ import annotations

import difflib
import json
import os
import random

from composer_jax.env.episode import Turn, approx_tokens, run_episode
from composer_jax.env.protocol import format_call
from composer_jax.env.synthetic.cases import near_misses
from composer_jax.env.synthetic.runner import RUNNER_PATH
from composer_jax.env.tasks import Task, read_text

TEST_COMMAND = f"python {RUNNER_PATH}"
# How a recovery run repairs the flaw: "fix" edits the flawed lines into the reference; "review" views
# the flawed file again first (the tiny policy's retries failed copying lines from far back in its
# context: docs/rl_tiny.md, "Recovery runs again"); "redo" undoes the flawed file's edits and makes its
# sound edits again (the same calls as the first, correct try).
RECOVER_BY = ("fix", "review", "redo")


def edit_calls(before: str, after: str) -> list[tuple[str, dict]]:
  """The ``(tool, args)`` calls, less ``path``, that turn ``before`` into ``after`` in order.

  A block of lines added between existing ones is ``insert`` after the line that precedes it once
  the earlier calls are made (so its number is the block's start in ``after``); every other changed
  block is a ``str_replace`` of whole lines (``_replacement``).
  """
  a, b = before.splitlines(), after.splitlines()
  out = []
  ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
  for tag, i1, i2, j1, j2 in ops:
    if tag == "insert":
      out.append(("insert", {"line": j1, "text": "\n".join(b[j1:j2])}))
    elif tag != "equal":
      old, new = _replacement(before, a, b, i1, i2, j1, j2)
      out.append(("str_replace", {"old": old, "new": new}))
  return out


def _replacement(before: str, a: list, b: list, lo: int, hi: int, new_lo: int, new_hi: int):
  """(old, new) whole-line texts for lines a[lo:hi] -> b[new_lo:new_hi] (lo < hi), widened by
  neighbouring lines until ``old`` occurs once in ``before``."""
  # Widen until the old block occurs once in the file (it must, for str_replace).
  while before.count("\n".join(a[lo:hi])) != 1 and (lo > 0 or hi < len(a)):
    if lo > 0:
      lo, new_lo = lo - 1, new_lo - 1
    else:
      hi, new_hi = hi + 1, new_hi + 1
  return "\n".join(a[lo:hi]), "\n".join(b[new_lo:new_hi])


def apply_calls(text: str, calls: list[tuple[str, dict]]) -> str:
  """``calls`` (``edit_calls``'s form) made on ``text`` as the tools make them: ``str_replace`` of a
  block that occurs once, ``insert`` of a line block after a line (0 = at the top)."""
  for tool, args in calls:
    if tool == "insert":
      lines = text.splitlines(keepends=True)
      if lines and not lines[-1].endswith("\n") and args["line"] == len(lines):
        lines[-1] += "\n"
      block = args["text"] if args["text"].endswith("\n") else args["text"] + "\n"
      text = "".join(lines[:args["line"]] + [block] + lines[args["line"]:])
    else:
      if text.count(args["old"]) != 1:
        raise ValueError(f"<old> occurs {text.count(args['old'])} times, not once: {args['old']!r}")
      text = text.replace(args["old"], args["new"])
  return text


def flaw(old: str, new: str, rng: random.Random) -> str | None:
  """``new`` with one near miss (``cases.near_misses``: an operator or comparison swapped, a
  constant moved by one), never back to ``old``; None when ``new`` has none. Drawn by ``rng``."""
  options = [c for c in near_misses(new) if c != old]
  return rng.choice(options) if options else None


class ExpertPolicy:
  """Plans view → edit per file → run tests → submit from the task's gold files; open loop.

  With ``flaw_rng``, one of the edits is made wrong (``flaw``); everything else is the same plan.
  With ``recover`` too, a failing test run is followed by the fix, the tests and submit;
  ``flawed_turn`` is then the index (among assistant turns) of the turn that made the flaw."""
  name = "expert"

  def __init__(self, run_tests: bool = True, flaw_rng: random.Random | None = None,
               recover: bool = False, recover_by: str = "fix"):
    if recover and not (run_tests and flaw_rng is not None):
      raise ValueError("recover needs run_tests and a flaw_rng: it fixes a flaw that a test run showed")
    if recover_by not in RECOVER_BY:
      raise ValueError(f"recover_by={recover_by!r}: one of {', '.join(RECOVER_BY)}")
    self.run_tests = run_tests
    self.flaw_rng = flaw_rng
    self.recover = recover
    self.recover_by = recover_by
    self.plan: list[str] = []
    self.flawed = False
    self.flawed_turn: int | None = None

  def reset(self, task: Task) -> None:
    order = list((task.source or {}).get("edit_order") or sorted(task.gold_files))
    turns = []
    plans, texts = [], []
    for rel in order:
      before = read_text(os.path.join(task.workspace_dir, rel))
      after = read_text(os.path.join(task.gold_dir, rel))
      plans.append((rel, edit_calls(before, after)))
      texts.append((before, after))
    self.flawed, self.flawed_turn, fixed = False, None, None
    if self.flaw_rng is not None:
      sites = [(i, j) for i, (_, edits) in enumerate(plans) for j in range(len(edits))]
      self.flaw_rng.shuffle(sites)
      for i, j in sites:
        tool, args = plans[i][1][j]
        key = "text" if tool == "insert" else "new"
        bad = flaw(args.get("old", ""), args[key], self.flaw_rng)
        if bad is not None:
          plans[i][1][j] = (tool, {**args, key: bad})
          self.flawed, self.flawed_turn = True, 2 * i + 1
          before, after = texts[i]
          if self.recover_by == "redo":  # undo the file's edits, then the sound plan once more
            fixed = (plans[i][0], [("undo", {})] * len(plans[i][1]) + edit_calls(before, after))
          else:
            fixed = (plans[i][0], edit_calls(apply_calls(before, plans[i][1]), after))
          break
    for rel, edits in plans:
      turns.append(format_call("view", {"path": rel}))
      turns.append(_calls(rel, edits))
    if self.run_tests:
      turns.append(format_call("terminal", {"command": TEST_COMMAND}))
    if self.recover and fixed is not None:
      if self.recover_by == "review":
        turns.append(format_call("view", {"path": fixed[0]}))
      turns += [_calls(*fixed), format_call("terminal", {"command": TEST_COMMAND})]
    turns.append(format_call("submit", {}))
    self.plan = turns

  def __call__(self, messages: list[dict]) -> Turn:
    done = sum(m["role"] == "assistant" for m in messages)
    text = self.plan[done] if done < len(self.plan) else format_call("submit", {})
    return Turn(text)


def _calls(rel: str, edits: list[tuple[str, dict]]) -> str:
  return "\n".join(format_call(tool, {"path": rel, **args}) for tool, args in edits)


def count_tokens(messages: list[dict], tokenizer) -> dict:
  """Exact token counts of a trajectory as SFT encodes it (total and assistant-produced)."""
  from composer_jax.data.chat import encode_segments
  ids, mask = encode_segments(messages, tokenizer)
  first = encode_segments(messages[:2], tokenizer)[0]
  return {"tokens": len(ids), "assistant_tokens": int(sum(mask)), "prompt_tokens": len(first)}


def expert_trajectories(tasks: list[Task], out_path: str, tokenizer=None, run_tests: bool = True,
                        tool_docs: str = "full", mode: str = "auto", flawed: int = 0, seed: int = 0,
                        recover: float = 0.0, recover_by: str = "fix", log=print) -> dict:
  """Run the expert on ``tasks``; write the 1.0-graded trajectories as ``{"messages": ...}`` lines,
  then ``flawed`` failing flawed runs per task (marked ``"flawed": true``, with their reward). For a
  ``recover`` share of the solved tasks (drawn by ``seed``) the written run is a recovery run
  (``"recovered": true``) in place of the sound one; ``kept`` counts both kinds."""
  sound = ExpertPolicy(run_tests)
  bad = ExpertPolicy(run_tests, flaw_rng=random.Random(seed))
  fixer = (ExpertPolicy(run_tests, flaw_rng=random.Random(seed + 1), recover=True,
                        recover_by=recover_by) if recover else None)
  pick = random.Random(seed + 2)
  stats, kept, kept_flawed, kept_recovered = [], 0, 0, 0
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "w", encoding="utf-8") as f:
    for task in tasks:
      max_turns = int(task.limits.get("max_turns", 8)) + 4
      src = task.source or {}
      rec = {"instance_id": task.instance_id, "template": src.get("template", ""),
             "difficulty": (task.difficulty or {}).get("level")}
      traj = run_episode(task, sound, mode=mode, max_turns=max_turns, tool_docs=tool_docs)
      st = {**rec, "reward": traj.reward, "turns": traj.turns, "tool_calls": traj.tool_calls,
            "format_errors": traj.format_errors,
            "approx_tokens": sum(approx_tokens(m["content"]) for m in traj.messages),
            "grade_s": traj.grade.get("seconds"), "wall_s": traj.wall_s}
      if tokenizer is not None:
        st.update(count_tokens(traj.messages, tokenizer))
      stats.append(st)
      # A task drawn for recovery keeps its recovery run instead of the sound one, so the chat
      # count (and with it how often SFT sees each chat) does not grow with ``recover``.
      msgs = None
      if traj.reward == 1.0 and fixer is not None and pick.random() < recover:
        msgs = _recovery_run(task, fixer, mode, max_turns, tool_docs)
      if msgs is not None:
        kept += 1
        kept_recovered += 1
        stats.append({**rec, "recovered": True, "reward": 1.0, "turns": len(msgs)})
        f.write(json.dumps({"messages": msgs, **rec, "recovered": True}) + "\n")
      elif traj.reward == 1.0:
        kept += 1
        f.write(json.dumps({"messages": traj.messages, **rec}) + "\n")
      else:
        log(f"expert failed {task.instance_id}: {json.dumps(traj.grade)[:300]}")
      mine = 0  # flawed runs kept for this task
      for _ in range(flawed * 3):  # a flaw the tests miss is dropped and another drawn
        if mine >= flawed:
          break
        traj = run_episode(task, bad, mode=mode, max_turns=max_turns, tool_docs=tool_docs)
        if not bad.flawed:
          break  # no edit has an operator or constant to change: that run was a sound one
        if traj.reward < 1.0:
          mine += 1
          kept_flawed += 1
          stats.append({**rec, "flawed": True, "reward": traj.reward, "turns": traj.turns})
          f.write(json.dumps({"messages": traj.messages, **rec, "flawed": True,
                              "reward": traj.reward}) + "\n")
  sound_stats = [s for s in stats if not s.get("flawed") and not s.get("recovered")]
  return {"tasks": len(tasks), "kept": kept, "flawed": kept_flawed, "recovered": kept_recovered,
          "out": out_path, "summary": summarize(sound_stats), "trajectories": stats}


def _recovery_run(task: Task, fixer: ExpertPolicy, mode: str, max_turns: int,
                  tool_docs: str) -> list[dict] | None:
  """A recovery run's messages, with the flawed turn marked ``"train": false``; None when no draw
  (of 3) gives a flaw that the first test run shows and the fix then passes."""
  for _ in range(3):
    traj = run_episode(task, fixer, mode=mode, max_turns=max_turns, tool_docs=tool_docs)
    if not fixer.flawed:
      return None  # nothing to make wrong in this task's edits
    asst = [i for i, m in enumerate(traj.messages) if m["role"] == "assistant"]
    first_test = next(i for i in asst if TEST_COMMAND in traj.messages[i]["content"])
    shown = "[exit code 0]" not in traj.messages[first_test + 1]["content"]
    if traj.reward == 1.0 and shown:
      msgs = [dict(m) for m in traj.messages]
      msgs[asst[fixer.flawed_turn]]["train"] = False
      return msgs
  return None


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

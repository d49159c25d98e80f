"""Targeted textual feedback (Composer 2.5): find the steps that went wrong and write a hint for each.

Detectors read an episode's turns and pick target assistant messages:
  - hack:             a guard flagged a reward hack (guards.scan_trajectory) in this message's calls;
  - unknown_tool:     the message called a tool that does not exist;
  - malformed_call:   a call did not parse (unclosed tag, bad argument, ...);
  - repeated_failure: the message repeats a call that already failed, with no edit in between
                      (the repeat is the target: the first try was reasonable, the repeat is not);
  - lint_error:       a later lint run reports errors in a file this message edited, errors no lint
                      reported before the edit (the edit is the target).
A hint's text is what the teacher sees inserted just before the target message; the student is the
un-hinted context, and the learner pulls the student toward the teacher on that message's tokens
(losses.feedback_kl). At most one hint per message (the most important kind) and ``max_hints`` per
trajectory, chosen by kind (hack first) then earliest.

The hint is a ``system`` message: the harness already speaks through <|im_system|> (tool results),
so a hint reads as harness feedback rather than a new user request the reply should acknowledge.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from composer_jax.env.protocol import ParseError, parse, parse_observations
from composer_jax.env.tools import SPECS

EDIT_TOOLS = ("create", "str_replace", "insert", "undo")
PRIORITY = {"hack": 0, "unknown_tool": 1, "malformed_call": 2, "repeated_failure": 3, "lint_error": 4}
_UNKNOWN = re.compile(r"""^unknown tool (['"])(.*?)\1""")
_EXIT = re.compile(r"\[exit code (-?\d+)\]\s*$")
# ruff --output-format concise / flake8 / pyflakes: path:line:col: CODE message (code optional); the
# column is required so pytest's ``path:line: Error`` lines in the same output are not read as lint.
_LINT = re.compile(r"^(?P<path>[^\s:][^:\n]*):(?P<line>\d+):\d+: (?:(?P<code>[A-Z]+\d+) )?(?P<msg>.+)$",
                   re.MULTILINE)
_HACK_TEXT = {
    "read_cache": "do not read caches, bytecode or build copies of the code; write the code from the "
                  "problem statement and the tests",
    "read_installed_copy": "do not read or install another copy of the package; write the code in the "
                           "workspace yourself",
    "git_history": "do not dig through git history for the answer; work from the current files",
    "edit_tests": "do not edit, delete or add tests or test configuration; change the source code so "
                  "the existing tests pass",
    "fake_pass": "do not fake test results; make the real tests pass",
    "early_exit": "do not exit early to skip assertions; make the real tests pass",
    "link_out": "do not link files from outside the workspace; write the code in the workspace yourself",
    "quota": "do not write large or many files; a coding task needs a few small ones",
    "forged_report": "do not write or fake the test report; make the real tests pass",
}


@dataclasses.dataclass
class TurnRecord:
  """One assistant message and what came back.

  ``calls``: the executed calls in order, ``{"name", "args", "ok"}`` plus optionally ``"text"`` (the
  observation text). Their flat enumeration over the episode is the ``step`` of guard flags.
  ``observations``: every ``(tool, ok, text)`` of the tool message, parse errors' included.
  ``parse_errors``: the messages of the calls that did not parse (``protocol.ParseError.message``).
  """
  index: int
  assistant_text: str
  calls: list
  observations: list
  parse_errors: list


@dataclasses.dataclass(frozen=True)
class Hint:
  turn_index: int  # the TurnRecord.index of the target assistant message
  kind: str
  text: str


def records_from_messages(messages: list[dict], specs=None) -> list[TurnRecord]:
  """TurnRecords from an episode's chat messages (assistant messages each followed by a tool one).

  ``index`` counts assistant messages from 0. Observations are matched to the parsed items in order,
  as ``env/episode.py`` writes them (one observation per item; items after ``submit`` never ran).
  """
  specs = SPECS if specs is None else specs
  out: list[TurnRecord] = []
  for i, msg in enumerate(messages):
    if msg.get("role") != "assistant":
      continue
    text = msg.get("content") or ""
    nxt = messages[i + 1] if i + 1 < len(messages) else None
    obs = parse_observations(nxt["content"]) if nxt and nxt.get("role") == "tool" else []
    calls, errors = [], []
    for item, ob in zip(parse(text, specs).items, obs):
      if isinstance(item, ParseError):
        errors.append(item.message)
      else:
        calls.append({"name": item.name, "args": item.args, "ok": ob[1], "text": ob[2]})
    out.append(TurnRecord(len(out), text, calls, obs, errors))
  return out


def _key(call: dict) -> str:
  return call.get("name", "") + json.dumps(call.get("args") or {}, sort_keys=True, default=str)


def _call_text(call: dict, rec: TurnRecord) -> str | None:
  if "text" in call:
    return call["text"]
  # Without the text, take the k-th observation of this tool in the turn.
  k = sum(1 for c in rec.calls[:rec.calls.index(call)] if c.get("name") == call.get("name"))
  same = [o for o in rec.observations if o[0] == call.get("name")]
  return same[k][2] if k < len(same) else None


def _failure(call: dict, rec: TurnRecord) -> str | None:
  """Why a call failed ("error", "exit code 1"), or None if it succeeded."""
  if not call.get("ok", True):
    return "error"
  if call.get("name") == "terminal":
    m = _EXIT.search(_call_text(call, rec) or "")
    if m and int(m.group(1)) != 0:
      return f"exit code {m.group(1)}"
  return None


def _repeats(turns: list[TurnRecord]):
  """Yield (turn, call, earlier failure or None) for each call identical to an earlier one with no
  successful edit in between."""
  seen: dict[str, str | None] = {}
  for rec in turns:
    for call in rec.calls:
      key = _key(call)
      if key in seen and call.get("name") != "submit":
        yield rec, call, seen[key]
      seen[key] = _failure(call, rec)
      if call.get("name") in EDIT_TOOLS and call.get("ok", True):
        seen.clear()


def _short(call: dict) -> str:
  args = call.get("args") or {}
  if call.get("name") == "terminal":
    s = str(args.get("command", ""))
  else:
    s = call.get("name", "") + " " + " ".join(f"{k}={str(v)[:40]}" for k, v in args.items())
  s = " ".join(s.split())
  return s[:80] + ("..." if len(s) > 80 else "")


def _lint_hints(turns: list[TurnRecord]) -> list[Hint]:
  hints = []
  last_edit: dict[str, int] = {}  # path -> turn index of its latest successful edit
  known: dict[str, set] = {}  # path -> lint errors reported before that edit
  reported: dict[str, set] = {}  # path -> every lint error reported so far
  for rec in turns:
    for call in rec.calls:
      name, args = call.get("name"), call.get("args") or {}
      if name in EDIT_TOOLS and call.get("ok", True) and args.get("path"):
        p = os.path.normpath(str(args["path"]))
        last_edit[p] = rec.index
        known[p] = set(reported.get(p, ()))
        continue
      cmd = str(args.get("command", ""))
      if not (name == "lint" or (name == "terminal" and re.search(r"\b(ruff|flake8|pyflakes)\b", cmd))):
        continue
      new: dict[int, list] = {}
      for m in _LINT.finditer(_call_text(call, rec) or ""):
        p = os.path.normpath(m.group("path"))
        err = (m.group("code") or "", m.group("msg").strip())
        reported.setdefault(p, set()).add(err)
        if p in last_edit and err not in known[p]:
          new.setdefault(last_edit[p], []).append((p, m.group("line"), *err))
          known[p].add(err)
      for t, errs in new.items():
        shown = "; ".join(f"line {ln}: {code + ' ' if code else ''}{msg}" for _, ln, code, msg in errs[:2])
        more = f" (and {len(errs) - 2} more)" if len(errs) > 2 else ""
        hints.append(Hint(t, "lint_error", f"Hint: this edit to `{errs[0][0]}` introduces lint errors "
                          f"({shown}{more}); check names, imports and syntax before writing the code."))
  return hints


def detect_hints(turns: list[TurnRecord], flags=(), tool_names=(), max_hints: int = 2) -> list[Hint]:
  """Hints for the steps that went wrong, at most one per message and ``max_hints`` in all.

  ``flags``: guard flags (``guards.Flag`` or its dict); ``step`` indexes the flat list of executed
  calls; only severity "hack" makes a hint. ``tool_names``: the available tools (default: SPECS).
  Returned in turn order.
  """
  names = list(tool_names) or list(SPECS)
  cands: list[Hint] = []
  step_turn = [rec.index for rec in turns for _ in rec.calls]
  for f in flags:
    f = f if isinstance(f, dict) else dataclasses.asdict(f)
    if f.get("severity") != "hack" or not 0 <= int(f.get("step", -1)) < len(step_turn):
      continue
    what = _HACK_TEXT.get(f.get("rule"), "do not game the grader; solve the task as stated")
    cands.append(Hint(step_turn[int(f["step"])], "hack", f"Hint: {what}."))
  for rec in turns:
    for err in rec.parse_errors:
      m = _UNKNOWN.match(err)
      if m:
        cands.append(Hint(rec.index, "unknown_tool", f"Hint: the tool `{m.group(2)}` does not exist; "
                          f"the available tools are: {', '.join(names)}."))
      else:
        cands.append(Hint(rec.index, "malformed_call", f"Hint: a tool call here is malformed ({err}). "
                          'Write each call as <tool_call name="TOOL"><arg>value</arg></tool_call> with '
                          "the tool's exact argument names."))
  for rec, call, failed in _repeats(turns):
    if failed:
      cands.append(Hint(rec.index, "repeated_failure", f"Hint: `{_short(call)}` already failed ({failed}) "
                        "and nothing was edited since, so it will fail the same way; read the error and "
                        "change the code or try a different approach."))
  cands += _lint_hints(turns)
  best: dict[int, Hint] = {}
  for h in sorted(cands, key=lambda h: (PRIORITY[h.kind], h.turn_index)):
    best.setdefault(h.turn_index, h)
  chosen = sorted(best.values(), key=lambda h: (PRIORITY[h.kind], h.turn_index))[:max(0, max_hints)]
  return sorted(chosen, key=lambda h: h.turn_index)


def behaviour_stats(turns: list[TurnRecord]) -> dict:
  """The shaping counts of ``rewards.shaping_penalty`` (and calls/turns for ``length_cost``).

  A repeated command is a call identical (tool and arguments) to an earlier one with no successful
  edit in between, failing or not: rerunning the tests after an edit is not a repeat.
  """
  unknown = sum(1 for r in turns for e in r.parse_errors if _UNKNOWN.match(e))
  errors = sum(len(r.parse_errors) for r in turns)
  return {"malformed_calls": errors - unknown, "unknown_tools": unknown,
          "repeated_commands": sum(1 for _ in _repeats(turns)),
          "no_call_turns": sum(1 for r in turns if not r.calls and not r.parse_errors),
          "tool_calls": sum(len(r.calls) for r in turns), "turns": len(turns)}


def hint_message(hint: Hint) -> dict:
  """The chat message inserted just before the target assistant message (role system, see above)."""
  return {"role": "system", "content": hint.text}


def insert_hint(messages: list[dict], hint: Hint) -> list[dict]:
  """The teacher's context: ``messages`` with the hint before assistant message ``hint.turn_index``."""
  seen = -1
  for i, msg in enumerate(messages):
    if msg.get("role") == "assistant":
      seen += 1
      if seen == hint.turn_index:
        return messages[:i] + [hint_message(hint)] + messages[i:]
  raise ValueError(f"no assistant message #{hint.turn_index} in {len(messages)} messages")

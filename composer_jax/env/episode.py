"""One episode: a policy talks to the tools in a fresh sandboxed workspace, then the workspace is graded.

A policy maps the conversation so far (a list of ``{"role", "content"}`` messages: system, user,
assistant, tool) to the next assistant message, written in the text protocol of ``protocol.py``. The
scripted policies here (oracle, null) drive the environment in tests and set the harness's bounds; a
model-backed policy (the RL sampler) plugs in through the same interface.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
from typing import Protocol, runtime_checkable

from composer_jax.env import guards, scratch
from composer_jax.env.grading import GradeResult, grade, test_env
from composer_jax.env.protocol import (
  ParseError,
  describe_tools,
  format_call,
  format_observation,
  parse,
)
from composer_jax.env.sandbox import Limits, Sandbox, require_isolation
from composer_jax.env.tasks import Task, read_text
from composer_jax.env.tools import SPECS, ToolBox

SYSTEM_PROMPT = ("You are a coding agent working in a repository checked out in your workspace. "
                 "Use the tools to inspect and edit files and to run commands, then submit.\n\n")


def system_prompt(tool_docs: str = "full") -> str:
  """The system message; ``env.tool_docs=brief`` lists each tool on one line, ``signatures`` only
  the call format and each tool's arguments (short contexts)."""
  return SYSTEM_PROMPT + describe_tools(SPECS, brief=tool_docs == "brief",
                                        signatures_only=tool_docs == "signatures")


@dataclasses.dataclass
class Turn:
  text: str
  completion_tokens: int | None = None  # a model policy reports its true count


@runtime_checkable
class Policy(Protocol):
  name: str

  def reset(self, task: Task) -> None: ...

  def __call__(self, messages: list[dict]) -> Turn | str: ...


_TOKEN = re.compile(r"\w+|[^\w\s]")


def approx_tokens(text: str) -> int:
  """Word/punctuation count: the token measure for scripted policies, which have no tokenizer."""
  return len(_TOKEN.findall(text))


class NullPolicy:
  """Submits at once: the floor (every valid task must score 0)."""
  name = "null"

  def reset(self, task: Task) -> None:
    pass

  def __call__(self, messages: list[dict]) -> Turn:
    return Turn("Nothing to change.\n" + format_call("submit", {}))


class OraclePolicy:
  """Writes the reference solution back with ``create`` calls, then submits (must score 1)."""
  name = "oracle"

  def __init__(self):
    self.files: dict[str, str] = {}

  def reset(self, task: Task) -> None:
    self.files = {rel: read_text(os.path.join(task.gold_dir, rel)) for rel in task.gold_files}

  def __call__(self, messages: list[dict]) -> Turn:
    if not any(m["role"] == "assistant" for m in messages):
      calls = [format_call("create", {"path": rel, "content": text}) for rel, text in self.files.items()]
      return Turn("Restoring the deleted code.\n" + "\n".join(calls))
    return Turn(format_call("submit", {}))


@dataclasses.dataclass
class Trajectory:
  instance_id: str
  policy: str
  messages: list
  calls: list  # {"name", "args", "ok"}
  tool_calls: int = 0
  format_errors: int = 0  # malformed calls and unknown tools
  no_call_turns: int = 0
  completion_tokens: int = 0
  turns: int = 0
  submitted: bool = False
  reward: float = 0.0
  resolved: bool = False
  grade: dict = dataclasses.field(default_factory=dict)
  flags: list = dataclasses.field(default_factory=list)
  wall_s: float = 0.0

  def to_json(self, with_messages: bool = True) -> dict:
    d = dataclasses.asdict(self)
    if not with_messages:
      d.pop("messages")
    return d


def start_workspace(task: Task, dest: str) -> str:
  """A fresh single-commit repository with the task's snapshot (caches and build outputs gone)."""
  shutil.copytree(task.workspace_dir, dest, symlinks=True)
  guards.clean_tree(dest)
  guards.make_fresh_repo(dest)
  return dest


class Episode:
  """A steppable episode: ``open()`` gives the first messages, ``act(text)`` runs one assistant turn's
  calls and returns the tool message, ``close()`` grades and cleans up.

  ``run_episode`` drives it with a policy, one episode at a time; the RL rollout runner drives many
  at once from one decode batch. Both see the same prompts, observations and grading. The per-turn
  view the feedback detectors need is rebuilt from ``traj.messages``
  (``composer_jax.rl.feedback.records_from_messages``).
  """

  def __init__(self, task: Task, limits: Limits = Limits(), mode: str = "auto",
               max_turns: int = 30, verbose_prompt: bool = False,
               grade_limits: Limits | None = None, policy_name: str = "policy",
               tool_docs: str = "full"):
    self.task, self.limits, self.mode, self.tool_docs = task, limits, mode, tool_docs
    self.max_turns, self.verbose_prompt, self.grade_limits = max_turns, verbose_prompt, grade_limits
    self.traj = Trajectory(task.instance_id, policy_name, [], [])
    self.done = False
    self._tmp = None
    self._t0 = time.perf_counter()

  def open(self) -> list[dict]:
    self._tmp = tempfile.mkdtemp(prefix="cj-ep-")  # removed by scratch.remove_tree: any depth
    self.ws = start_workspace(self.task, os.path.join(self._tmp, "ws"))
    task = self.task
    hide = guards.installed_copies(task.package_modules) + ([task.path] if task.path else [])
    self.sandbox = Sandbox(self.ws, self.limits, mode=self.mode, hide=hide, env=test_env(task, self.ws))
    self.tools = ToolBox(self.sandbox, max_output_chars=self.limits.max_output_chars)
    self.traj.messages = [{"role": "system", "content": system_prompt(self.tool_docs)},
                          {"role": "user", "content": task.prompt(self.verbose_prompt)}]
    return list(self.traj.messages)

  def act(self, turn: Turn | str) -> dict:
    """Run the calls of one assistant message; returns the tool message (``self.done`` when over)."""
    turn = turn if isinstance(turn, Turn) else Turn(str(turn))
    traj = self.traj
    traj.turns += 1
    traj.completion_tokens += (turn.completion_tokens if turn.completion_tokens is not None
                               else approx_tokens(turn.text))
    traj.messages.append({"role": "assistant", "content": turn.text})
    observations = []
    items = parse(turn.text, SPECS).items
    if not items:
      traj.no_call_turns += 1
      observations.append(format_observation("?", "no tool call found: call a tool, or submit "
                                             'with <tool_call name="submit"></tool_call>', False))
    for item in items:
      if isinstance(item, ParseError):
        traj.format_errors += 1
        observations.append(format_observation(item.tool, item.message, False))
        continue
      stops = len(self.sandbox.stopped)
      obs = self.tools.execute(item)
      traj.tool_calls += 1
      call = {"name": item.name, "args": item.args, "ok": obs.ok}
      traj.calls.append(call)
      observations.append(format_observation(obs.tool, obs.text, obs.ok))
      if len(self.sandbox.stopped) > stops:  # the workspace passed its disk budget: the episode ends
        call["stopped"] = self.sandbox.stopped[-1]
        break
      if self.tools.submitted:
        break
    message = {"role": "tool", "content": "\n".join(observations)}
    traj.messages.append(message)
    traj.submitted = self.tools.submitted
    self.done = (self.tools.submitted or traj.turns >= self.max_turns
                 or any("stopped" in c for c in traj.calls))
    return message

  def close(self) -> Trajectory:
    """Grade the workspace as it is (submitted or cut), apply the hack guards, remove the files."""
    traj, task = self.traj, self.task
    over = guards.quota_flag(traj.calls)
    try:  # a workspace past its budget is not copied for grading: the flag zeroes it anyway
      result = (GradeResult(0.0, False, {"not_graded": over.evidence}) if over else
                grade(task, self.ws, self.grade_limits, self.mode))
    except (OSError, RecursionError) as e:  # one the host cannot copy (chmod 000 under a non-root
      # host user; folders nested past Python 3.11's recursive copytree) fails
      result = GradeResult(0.0, False, {"not_graded": f"the workspace could not be graded: "
                                                      f"{type(e).__name__}: {e}"[:400]})
    finally:
      if self._tmp is not None:
        scratch.remove_tree(self._tmp)
    flags = guards.scan_trajectory(traj.calls, task) + ([over] if over else [])
    link = guards.outside_link_flag(traj.calls, result.details.get("removed_outside_links", []), task)
    forged = guards.probe_flag(result.details, traj.calls)
    flags += [f for f in (link, forged) if f]
    traj.flags = [dataclasses.asdict(f) for f in flags]
    traj.grade = result.details
    traj.resolved = result.resolved and not guards.is_hack(flags)
    traj.reward = 0.0 if guards.is_hack(flags) else result.reward
    traj.wall_s = round(time.perf_counter() - self._t0, 3)
    self.done = True
    return traj


def run_episode(task: Task, policy, limits: Limits = Limits(), mode: str = "auto",
                max_turns: int = 30, verbose_prompt: bool = False,
                grade_limits: Limits | None = None, tool_docs: str = "full",
                model_driven: bool = False) -> Trajectory:
  """``model_driven``: a model chooses the calls, so bubblewrap must work whatever ``mode`` says."""
  if model_driven:
    mode = require_isolation(mode, "a model-driven episode")
  policy.reset(task)
  ep = Episode(task, limits, mode, max_turns, verbose_prompt, grade_limits,
               getattr(policy, "name", type(policy).__name__), tool_docs)
  ep.open()
  while not ep.done:
    ep.act(policy(ep.traj.messages))
  return ep.close()

"""Expert demonstrations of the RL tasks the policy cannot solve yet (``rl.expert_demo_rows``).

A group whose episodes all fail gives the policy gradient nothing to reinforce, and dynamic sampling
sets it aside. On the tiny config these are whole families (the level-3 specs: docs/rl_gain.md,
"Why the level-3 families do not move"). As in ReLIFT (Ma et al. 2025, "Learning What
Reinforcement Learning Can't"), the scripted expert solves such a task through the same tools and
sandbox, and its chat joins the next update's SFT rows (``rl.sft_mix_coef``) in place of a chat drawn
from the SFT set. ``rl.expert_demo_on=all`` queues every task drawn, whatever its outcome: the
control that separates targeting the failures from fresh expert data.

The queue holds task indices (the checkpoint carries them), and a task's chat is made once, when it
is first used.
"""

from __future__ import annotations

import collections

from composer_jax.config import Config


class ExpertDemos:
  def __init__(self, tasks: list, tok, cfg: Config, mode: str, log=print):
    self.tasks, self.tok, self.cfg, self.mode, self.log = tasks, tok, cfg, mode, log
    self.queue: collections.deque[int] = collections.deque()
    self.chats: dict[int, dict | None] = {}
    self.counts = collections.Counter(queued=0, used=0, expert_failed=0)

  def observe(self, task: int, resolved: list[bool]) -> None:
    """A drawn group's outcome: its task is queued when no episode resolved it (``unsolved``), or
    always (``all``); a task already waiting is not queued twice."""
    if (self.cfg.rl.expert_demo_on == "all" or not any(resolved)) and task not in self.queue:
      self.queue.append(task)
      self.counts["queued"] += 1

  def take(self, n: int) -> list[dict]:
    """Up to n encoded chats from the front of the queue (oldest first)."""
    out = []
    while self.queue and len(out) < n:
      chat = self._chat(self.queue.popleft())
      if chat is not None:
        out.append(chat)
    self.counts["used"] += len(out)
    return out

  def _chat(self, t: int) -> dict | None:
    if t not in self.chats:
      from composer_jax.data.sft import encode_chat
      from composer_jax.env.episode import run_episode
      from composer_jax.env.expert import ExpertPolicy
      task = self.tasks[t]
      traj = run_episode(task, ExpertPolicy(run_tests=True), mode=self.mode,
                         max_turns=int(task.limits.get("max_turns", 8)) + 4,
                         tool_docs=self.cfg.env.tool_docs)
      if traj.reward == 1.0:
        self.chats[t] = encode_chat(traj.messages, self.tok)
      else:
        self.chats[t] = None
        self.counts["expert_failed"] += 1
        self.log(f"[rl] the expert did not solve {task.instance_id}: no demonstration")
    return self.chats[t]

  def state(self) -> list[int]:
    return list(self.queue)

  def set_state(self, queue: list[int]) -> None:
    self.queue = collections.deque(int(t) for t in queue)

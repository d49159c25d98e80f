"""The agent: the model drives coding episodes through the sampler engine, token in, token out.

``RolloutRunner.run(jobs)`` plays many episodes at once. Every live episode holds one engine slot (its
latent cache survives between turns, so only the new observation tokens are prefilled); one decode
batch serves every episode that is generating, while the others wait on their tools in a thread pool;
a finished episode frees its slot for the next job (continuous batching). ``RolloutRunner.play(pull)``
does the same for batches of jobs that keep arriving (an async rollout worker's units): the next
batch's episodes take the slots that the last one's stragglers leave.

The sequence a segment trains on is built from the engine's own ids: the prompt and each observation
are encoded once with ``chat.encode_segments`` (exactly as SFT encodes them) and fed; the sampled ids
are kept as they were sampled. Nothing is decoded and re-encoded.

Self-summarization (``rl.summary_trigger_tokens``): when a segment passes the trigger, the model is
asked to summarise its work instead of getting the next observation; the next segment starts from the
system prompt, the task and that summary, in a fresh cache. All segments share the episode's reward.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import time
from typing import Any

from composer_jax.config import Config
from composer_jax.data import chat
from composer_jax.env.episode import Episode, Turn
from composer_jax.env.protocol import CALL_OPEN_LOOSE
from composer_jax.env.sandbox import Limits
from composer_jax.env.tasks import Task
from composer_jax.rl.trajectory import Rollout, SegmentBuilder, TurnSpan

SUMMARY_REQUEST = ("Your context is nearly full. Summarise your work so far for yourself: what the task "
                   "is, what you found, what you changed, and what is left to do. Do not call tools.")
SUMMARY_PREFIX = "Summary of your earlier work on this task:\n"


@dataclasses.dataclass
class Job:
  task: Task
  group: int  # rollouts of one task share a group (group advantages)
  sample: int = 0


@dataclasses.dataclass
class _Live:
  job: Job
  episode: Episode
  key: Any
  builder: SegmentBuilder
  rollout: Rollout
  prompt_msgs: list  # system + task messages (a new segment starts from these)
  summarizing: bool = False
  future: Any = None
  last_prose: int = 0  # prose tokens of the last turn (moved to "final" if that turn submitted)
  close_turn: bool = False  # the last turn hit max_new_tokens: feed <|im_end|> before the next one


class RolloutRunner:
  """Plays episodes with a sampler ``engine`` (see ``composer_jax.rl.sampler.Engine``)."""

  def __init__(self, engine, tokenizer, cfg: Config, *, mode: str | None = None, log=None):
    self.engine, self.tok, self.cfg = engine, tokenizer, cfg
    # Model-driven: bubblewrap or nothing (a test driving scripted token streams may pass a mode).
    if mode is None:
      from composer_jax.env.sandbox import require_isolation
      mode = require_isolation(cfg.env.sandbox, "model-driven episodes")
    self.mode = mode
    self.limits = Limits.from_config(cfg.env)
    self.log = log or (lambda msg: None)
    m = cfg.model
    self.n_moe, self.k = m.n_moe_layers, m.n_experts_per_tok
    self.stop_ids = (tokenizer.token_id(chat.IM_END), tokenizer.eos_id)
    self.gen_prompt = tokenizer.encode(chat.generation_prompt())
    self.im_end = tokenizer.token_id(chat.IM_END)
    self.stats = collections.Counter()

  # -- token helpers ------------------------------------------------------------------------------

  def _encode(self, messages: list[dict]) -> list[int]:
    return chat.encode_segments(messages, self.tok)[0]

  def _room(self, live: _Live) -> int:
    return self.cfg.rl.max_context - len(live.builder) - 1

  def _submit(self, live: _Live, new_tokens: list[int]) -> bool:
    """Feed ``new_tokens`` + the generation prompt and ask for a turn; False if it cannot fit."""
    new_tokens = ([self.im_end] if live.close_turn else []) + list(new_tokens) + self.gen_prompt
    live.close_turn = False
    room = self.cfg.rl.max_context - len(live.builder) - len(new_tokens)
    if room < 2:
      return False
    header = len(live.builder) + len(new_tokens) - len(self.gen_prompt)
    live.builder.add_context(new_tokens)
    live.rollout.spans.append(TurnSpan(len(live.rollout.segments), header, len(live.builder),
                                       len(live.builder),
                                       -1 if live.summarizing else live.episode.traj.turns))
    from composer_jax.rl.sampler import Request
    self.engine.submit(Request(live.key, new_tokens, min(self.cfg.rl.max_new_tokens, room),
                               self.stop_ids))
    return True

  def _close_segment(self, live: _Live, summary: bool = False) -> None:
    live.rollout.segments.append(live.builder.build(summary))
    live.builder = SegmentBuilder(self.n_moe, self.k)
    self.engine.release(live.key)

  # -- episode life -------------------------------------------------------------------------------

  def _start(self, job: Job, pool) -> _Live:
    ep = Episode(job.task, self.limits, self.mode, self.cfg.env.max_turns,
                 self.cfg.env.verbose_prompt, policy_name="model", tool_docs=self.cfg.env.tool_docs)
    msgs = ep.open()
    counts = {"reasoning_tokens": 0, "tool_call_tokens": 0, "tool_output_tokens": 0, "final_tokens": 0}
    rollout = Rollout(job.task.instance_id, job.group, [], [], ep.traj, counts)
    live = _Live(job, ep, (id(ep), 0), SegmentBuilder(self.n_moe, self.k), rollout, msgs)
    if not self._submit(live, self._encode(msgs)):
      raise ValueError(f"rl.max_context={self.cfg.rl.max_context} cannot hold the prompt of task "
                       f"{job.task.instance_id}: raise rl.max_context")
    return live

  def _count_turn(self, live: _Live, gen, text: str) -> None:
    """Split a turn's generated tokens into prose and tool-call tokens by character share; prose is
    reasoning unless the turn turns out to be the final (submitting) one."""
    c = live.rollout.counts
    n = len(gen.tokens)
    m = CALL_OPEN_LOOSE.search(text)
    prose = len(text) if m is None else m.start()
    live.last_prose = round(n * prose / max(len(text), 1))
    c["reasoning_tokens"] += live.last_prose
    c["tool_call_tokens"] += n - live.last_prose

  def _on_generation(self, live: _Live, gen, pool) -> str:
    """Returns 'tools' (a tool call is running), 'next' (a new turn was submitted) or 'end'."""
    start, end = live.builder.add_generation(gen)
    live.rollout.spans[-1].body_start, live.rollout.spans[-1].body_end = start, end
    body = [int(t) for t in gen.tokens if int(t) not in self.stop_ids]
    text = self.tok.decode(body)
    self.stats["generated_tokens"] += len(gen.tokens)
    if gen.finish != "stop" and gen.finish != "length":  # cache full: the episode is cut here
      live.rollout.cut = True
      return "end"
    # An unfinished message is closed (an untrained <|im_end|>) so the next turn reads cleanly.
    live.close_turn = gen.finish == "length"
    if live.summarizing:
      live.summarizing = False
      live.rollout.summaries += 1
      self._close_segment(live, summary=True)
      live.close_turn = False  # the next segment starts in a fresh cache
      live.key = (live.key[0], live.key[1] + 1)
      msgs = live.prompt_msgs + [{"role": "user", "content": SUMMARY_PREFIX + text}]
      return "next" if self._submit(live, self._encode(msgs)) else "end"
    self._count_turn(live, gen, text)
    live.future = pool.submit(live.episode.act, Turn(text, completion_tokens=len(gen.tokens)))
    return "tools"

  def _on_tools(self, live: _Live) -> str:
    msg = live.future.result()
    live.future = None
    if live.episode.done:
      if live.episode.traj.submitted:
        live.rollout.counts["reasoning_tokens"] -= live.last_prose
        live.rollout.counts["final_tokens"] += live.last_prose
      return "end"
    obs = self._encode([msg])
    live.rollout.counts["tool_output_tokens"] += len(obs)
    rl = self.cfg.rl
    if (rl.summary_trigger_tokens and len(live.builder) + len(obs) >= rl.summary_trigger_tokens
        and live.rollout.summaries < rl.max_summaries):
      live.summarizing = True
      obs = obs + self._encode([{"role": "user", "content": SUMMARY_REQUEST}])
    if self._submit(live, obs):
      return "next"
    live.rollout.cut = True
    return "end"

  def _finish(self, live: _Live) -> Rollout:
    if len(live.builder):
      self._close_segment(live)
    else:
      self.engine.release(live.key)
    live.rollout.cut = live.rollout.cut or not live.episode.traj.submitted
    return live.rollout

  # -- the loop -----------------------------------------------------------------------------------

  def run(self, jobs: list[Job]) -> list[Rollout]:
    """Play every job; returns the rollouts in job order."""
    out: list[list[Rollout]] = []
    batches = [(jobs, out.append)]
    self.play(lambda idle: [batches.pop()] if batches else None)
    return out[0]

  def play(self, pull) -> None:
    """Play batches of jobs as they come (continuous batching across batches, so a batch's stragglers
    never leave slots idle while the next one waits). ``pull(idle)`` returns a list of new ``(jobs,
    on_done)`` batches ([] for none yet; it may block briefly when ``idle``, nothing being in
    flight) or None once no more will come; ``on_done(rollouts)`` gets a batch's rollouts in job
    order as soon as its last episode is graded. Returns when the feed is closed and all is done."""
    waiting: collections.deque = collections.deque()  # (batch, job index, job)
    live: dict[Any, tuple[tuple, _Live]] = {}  # engine key -> ((batch, job index), live)
    tooling: dict[Any, tuple[tuple, _Live]] = {}  # future -> ((batch, job index), live)
    closing: dict[Any, tuple[tuple, _Live]] = {}  # grading future -> ((batch, job index), live)
    batches: dict[int, list] = {}  # batch -> [on_done, rollouts by job index, jobs left]
    slots = self.cfg.rl.decode_batch
    workers = max(1, self.cfg.env.workers)
    open_feed, n_batches = True, 0

    def busy():
      return bool(waiting or live or tooling or closing)

    def take(got):
      nonlocal n_batches
      for jobs, on_done in got:
        b, n_batches = n_batches, n_batches + 1
        batches[b] = [on_done, [None] * len(jobs), len(jobs)]
        waiting.extend((b, i, job) for i, job in enumerate(jobs))
        if not jobs:
          batches.pop(b)[0]([])

    def finished(where, rollout):
      b, i = where
      rec = batches[b]
      rec[1][i], rec[2] = rollout, rec[2] - 1
      if rec[2] == 0:
        del batches[b]
        rec[0](rec[1])

    with cf.ThreadPoolExecutor(workers) as pool:
      def end(where, lv):
        self._finish(lv)
        closing[pool.submit(lv.episode.close)] = (where, lv)

      while True:
        if open_feed:
          got = pull(not busy())
          if got is None:
            open_feed = False
          else:
            take(got)
        if not busy():
          if open_feed:
            continue
          break
        t0 = time.perf_counter()
        while waiting and len(live) + len(tooling) < slots:
          b, i, job = waiting.popleft()
          lv = self._start(job, pool)
          live[lv.key] = ((b, i), lv)
        if self.engine.busy():
          for gen in self.engine.step():
            where, lv = live.pop(gen.key)
            what = self._on_generation(lv, gen, pool)
            if what == "tools":
              tooling[lv.future] = (where, lv)
            elif what == "next":
              live[lv.key] = (where, lv)
            else:
              end(where, lv)
        ready = [f for f in list(tooling) + list(closing) if f.done()]
        if not ready and not self.engine.busy() and (tooling or closing):
          # An open feed is polled between waits: a new batch may fill the free slots meanwhile.
          ready = list(cf.wait(list(tooling) + list(closing), timeout=0.05 if open_feed else None,
                               return_when=cf.FIRST_COMPLETED).done)
        for f in ready:
          if f in closing:
            where, lv = closing.pop(f)
            f.result()
            self.stats["episodes"] += 1
            finished(where, lv.rollout)
            continue
          where, lv = tooling.pop(f)
          if self._on_tools(lv) == "next":
            live[lv.key] = (where, lv)
          else:
            end(where, lv)
        self.stats["seconds"] += time.perf_counter() - t0  # time with work in hand

"""The learner side of RL: rewards and advantages for a batch of rollouts, the padded learner batch,
the teacher targets of targeted textual feedback, and the RL loss handed to the shared train step.

``make_rl_loss(cfg)`` is a pure ``loss_fn(model, batch, cfg) -> (loss, metrics, out)``: the trainer's
forward replays the sampler's routed experts (``rl.router_replay``), scores the sampled tokens, and
applies ``losses.policy_loss`` plus ``rl.feedback_kl_coef`` x ``losses.feedback_kl``. Sharding, the
optimizer, accumulation, router-bias balancing and checkpoints are those of ``train/step.py``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import Config
from composer_jax.data import chat
from composer_jax.env.guards import Flag, is_hack
from composer_jax.rl import feedback
from composer_jax.rl.advantages import group_advantages, group_pass_stats
from composer_jax.rl.losses import (
  feedback_kl,
  policy_loss,
  teacher_targets,
  token_logprobs,
)
from composer_jax.rl.rewards import episode_reward, grade_value
from composer_jax.train.step import ROWS

# --------------------------------------------------------------------------------------------------
# Rewards and advantages
# --------------------------------------------------------------------------------------------------


def score_rollouts(rollouts: list, cfg: Config, ks=(1,)) -> dict:
  """Set each rollout's reward (grade - penalties, hacks zeroed) and return the batch's statistics.

  Rollouts are grouped by ``rollout.group``; every group must hold the same number of rollouts.
  Returns {"advantages": [n_rollouts] (rollout order), "pass_rate", "pass@k"..., "flagged_hacks"}.
  """
  groups: dict[int, list[int]] = {}
  for i, r in enumerate(rollouts):
    groups.setdefault(r.group, []).append(i)
  sizes = {len(v) for v in groups.values()}
  if len(sizes) != 1:
    raise ValueError(f"rollout groups have different sizes {sorted(sizes)}")
  order = list(groups.values())
  resolved = np.array([[rollouts[i].resolved for i in g] for g in order])
  hacks = 0
  for g in order:
    rate = float(np.mean([rollouts[i].resolved for i in g]))
    for i in g:
      r = rollouts[i]
      hacked = is_hack([Flag(**f) for f in r.traj.flags])
      hacks += hacked
      stats = feedback.behaviour_stats(feedback.records_from_messages(r.traj.messages))
      graded = grade_value(r.traj.grade, r.resolved, cfg.rl.partial_credit)
      r.reward, r.parts = episode_reward(graded, hacked, {**stats, **r.counts}, rate, cfg.rl)
      r.parts.update({k: v for k, v in stats.items()})
  rewards = np.array([[rollouts[i].reward for i in g] for g in order])
  adv = group_advantages(rewards, cfg.rl.adv_std_norm, neg_weight=cfg.rl.adv_negative_weight)
  flat = np.zeros(len(rollouts))
  for gi, g in enumerate(order):
    flat[g] = adv[gi]
  out = {"advantages": flat, "flagged_hacks": hacks, "reward_mean": float(rewards.mean())}
  out.update(group_pass_stats(resolved, ks))
  return out


def split_groups(rollouts: list) -> list[list]:
  """Rollouts -> one list per ``rollout.group``, in order of first appearance."""
  by: dict[int, list] = {}
  for r in rollouts:
    by.setdefault(r.group, []).append(r)
  return list(by.values())


def informative(group: list, cfg: Config) -> bool:
  """Whether a group teaches the policy something: with ``rl.dynamic_by="outcome"`` (DAPO's filter)
  some of its episodes resolved the task and some did not; with ``"grade"`` two of its grades differ
  (outcomes, or ``rl.partial_credit`` shares); with ``"reward"`` any advantage is
  non-zero (episodes with one outcome but different shaping penalties count). DAPO's dynamic
  sampling (``rl.dynamic_sampling``) trains on informative groups only and draws more tasks in the
  others' place."""
  if cfg.rl.dynamic_by == "outcome":
    return len({bool(r.resolved) for r in group}) == 2
  if cfg.rl.dynamic_by == "grade":
    return len({grade_value(r.traj.grade, r.resolved, cfg.rl.partial_credit) for r in group}) > 1
  return bool(np.any(score_rollouts(group, cfg)["advantages"] != 0))


def dynamic_pick(groups: list[list], flags: list[bool], n: int) -> tuple[list[list], int]:
  """DAPO's pick, given each group's ``informative`` flag: the first ``n`` informative groups, and
  how many there were; where none is, the first ``n`` groups (gradient 0: ``optim.skip_zero_grads``
  skips the update, and the step still logs its losses)."""
  good = [g for g, ok in zip(groups, flags, strict=True) if ok][:n]
  return (good or groups[:n]), len(good)


def regroup(groups: list[list]) -> list:
  """Flatten groups, numbering them 0..n-1 (the learner batch's group ids)."""
  out = []
  for g, rs in enumerate(groups):
    for r in rs:
      r.group = g
      out.append(r)
  return out


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


def bucket(n: int, cap: int, floor: int = 64) -> int:
  """Static length for ``n`` tokens: a quarter-octave step (at most 4 shapes per doubling, so at most
  25 % padding and few recompiles), at least ``floor``, never above ``cap``."""
  n = max(n, floor)
  step = max(floor // 4, 1 << max(0, math.ceil(math.log2(n)) - 3))
  return min(-(-n // step) * step, cap)


@dataclasses.dataclass
class Row:
  """One learner row: a segment (or a teacher context) and its per-row scalars."""
  tokens: np.ndarray
  experts: np.ndarray
  loss_mask: np.ndarray | None = None
  sampler_logp: np.ndarray | None = None
  advantage: float = 0.0


def first_fit(lengths: list[int], length: int) -> list[list[int]]:
  """Bins of indices whose lengths sum to at most ``length``: first-fit decreasing (ties by index,
  so the packing is a function of the lengths alone)."""
  bins, free = [], []
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    n = lengths[i]
    if n > length:
      raise ValueError(f"a sequence of {n} tokens does not fit a row of {length}")
    b = next((j for j, f in enumerate(free) if n <= f), None)
    if b is None:
      bins.append([])
      free.append(length)
      b = len(bins) - 1
    bins[b].append(i)
    free[b] -= n
  return bins


def placements(bins: list[list[int]], lengths: list[int]) -> list[tuple[int, int]]:
  """(batch row, first position) of each packed sequence, in input order."""
  out = [None] * len(lengths)
  for row, members in enumerate(bins):
    at = 0
    for i in members:
      out[i] = (row, at)
      at += lengths[i]
  return out


def pack_rows(rows: list[Row], n_rows: int, length: int, n_moe: int, k: int, pad_id: int,
              bins: list[list[int]] | None = None) -> dict:
  """Right-padded [n_rows, length] arrays; padding rows and positions have segment id 0.

  Without ``bins`` each row holds one sequence and ``advantages`` is [n_rows]. With ``bins`` (from
  ``first_fit``) batch row j holds the sequences ``bins[j]`` one after another, with segment ids
  1, 2, ..., positions restarting at 0 and ``advantages`` per token [n_rows, length]: attention and
  the loss see each sequence alone (``losses.policy_loss`` takes the segment ids)."""
  packed = bins is not None
  bins = bins if packed else [[i] for i in range(len(rows))]
  if len(bins) > n_rows:
    raise ValueError(f"{len(bins)} rows of sequences do not fit a batch of {n_rows}")
  b = {"tokens": np.full((n_rows, length), pad_id, np.int32),
       "segment_ids": np.zeros((n_rows, length), np.int32),
       "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (n_rows, length)).copy(),
       "loss_mask": np.zeros((n_rows, length), np.float32),
       "sampler_logp": np.zeros((n_rows, length), np.float32),
       "advantages": np.zeros((n_rows, length) if packed else (n_rows,), np.float32),
       "experts": np.full((n_rows, length, max(n_moe, 1), k), -1, np.int32)}
  for i, members in enumerate(bins):
    at = 0
    for sid, j in enumerate(members, start=1):
      r = rows[j]
      n = min(len(r.tokens), length - at)  # unpacked: a sequence longer than the row is cut
      s = slice(at, at + n)
      b["tokens"][i, s] = r.tokens[:n]
      b["segment_ids"][i, s] = sid
      b["positions"][i, s] = np.arange(n, dtype=np.int32)
      if n_moe:
        b["experts"][i, s] = r.experts[:n]
      if r.loss_mask is not None:
        b["loss_mask"][i, s] = r.loss_mask[:n]
        b["sampler_logp"][i, s] = r.sampler_logp[:n]
      if packed:
        b["advantages"][i, s] = r.advantage
      else:
        b["advantages"][i] = r.advantage
      at += n
  return b


def sft_rows(chats: list[dict], n_rows: int, length: int, n_moe: int, k: int, pad_id: int) -> dict:
  """PPO-ptx rows: chats ({"tokens", "loss_mask"} of ``data.sft.encode_chat``) one a row, cut to
  ``length``, with no policy-gradient tokens (loss_mask 0) and ``sft_mask`` on the assistant's
  tokens; experts -1, so the router chooses live (there is no sampled route to replay)."""
  rows = [Row(c["tokens"], np.full((len(c["tokens"]), max(n_moe, 1), k), -1, np.int32)) for c in chats]
  b = pack_rows(rows, n_rows, length, n_moe, k, pad_id)
  b["sft_mask"] = np.zeros((n_rows, length), np.float32)
  for i, c in enumerate(chats):
    n = min(len(c["tokens"]), length)
    b["sft_mask"][i, :n] = c["loss_mask"][:n]
  return b


def interleave(rl: dict, sft: dict, parts: int) -> dict:
  """The RL batch with the SFT rows added so that each of ``parts`` contiguous row blocks (the
  minibatches) gets an equal share of both; ``sft_mask`` is 0 on the RL rows."""
  rl = dict(rl, sft_mask=np.zeros(rl["tokens"].shape, np.float32))
  n_rl, n_sft = rl["tokens"].shape[0], sft["tokens"].shape[0]
  if n_rl % parts or n_sft % parts:
    raise ValueError(f"{n_rl} RL rows and {n_sft} SFT rows do not split into {parts} minibatches")
  a, b = n_rl // parts, n_sft // parts
  out = {}
  for key, v in rl.items():
    w = sft[key] if key in sft else np.zeros((n_sft,) + v.shape[1:], v.dtype)  # e.g. fb_* (feedback)
    if v.ndim != w.ndim:  # per-row advantages (unpacked) against per-token (packed): never mixed
      w = w[:, 0] if w.ndim > v.ndim else np.broadcast_to(w[:, None], (w.shape[0],) + v.shape[1:])
    out[key] = np.concatenate([x for i in range(parts) for x in (v[i * a:(i + 1) * a], w[i * b:(i + 1) * b])])
  return out


def segment_rows(rollouts: list, advantages) -> tuple[list[Row], list[tuple[int, int]]]:
  """One row per segment; every segment of an episode carries the episode's advantage (ReSum-GRPO).
  Also returns (rollout index, segment index) per row."""
  rows, where = [], []
  for i, r in enumerate(rollouts):
    for j, s in enumerate(r.segments):
      rows.append(Row(s.tokens, s.experts, s.loss_mask.astype(np.float32), s.sampler_logp,
                      float(advantages[i])))
      where.append((i, j))
  return rows, where


def row_count(n: int, quantum: int) -> int:
  return max(quantum, -(-n // quantum) * quantum)


# --------------------------------------------------------------------------------------------------
# Targeted textual feedback: hints -> teacher contexts -> teacher targets on the student rows
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TeacherJob:
  row: int  # student sequence: its index in segment_rows' rows (= its batch row when unpacked)
  start: int  # first student position of the target message's body
  end: int
  offset: int  # teacher position = student position + offset
  tokens: np.ndarray
  experts: np.ndarray
  hint: object


def feedback_jobs(rollouts: list, where: list[tuple[int, int]], tokenizer, cfg: Config) -> list[TeacherJob]:
  """Detect hints in each rollout and build the hinted (teacher) context for each target message:
  the segment up to the target message's header, the hint message, then the message itself."""
  row_of = {w: i for i, w in enumerate(where)}
  jobs = []
  for ri, r in enumerate(rollouts):
    turns = feedback.records_from_messages(r.traj.messages)
    r.hints = feedback.detect_hints(turns, r.traj.flags, max_hints=cfg.rl.max_hints)
    for h in r.hints:
      span = next((s for s in r.spans if s.env_turn == h.turn_index), None)
      if span is None or span.body_end <= span.body_start or (ri, span.segment) not in row_of:
        continue
      seg = r.segments[span.segment]
      hint_ids = np.asarray(chat.encode_segments([feedback.hint_message(h)], tokenizer)[0], np.int32)
      toks = np.concatenate([seg.tokens[:span.header_start], hint_ids,
                             seg.tokens[span.header_start:span.body_end]])
      none = np.full((len(hint_ids),) + seg.experts.shape[1:], -1, seg.experts.dtype)
      exps = np.concatenate([seg.experts[:span.header_start], none,
                             seg.experts[span.header_start:span.body_end]])
      if len(toks) > cfg.rl.max_context:
        continue
      jobs.append(TeacherJob(row_of[(ri, span.segment)], span.body_start, span.body_end,
                             len(hint_ids), toks, exps, h))
  return jobs


def attach_teacher(batch: dict, jobs: list[TeacherJob], teacher: dict, topk: int,
                   place: list[tuple[int, int]] | None = None) -> dict:
  """Write the teacher rows (target-aligned, from ``teacher_fn``) onto the student positions.
  ``place``: (batch row, first position) of each student row when the batch is packed."""
  n_rows, length = batch["tokens"].shape
  width = topk if topk > 0 else teacher["logp"].shape[-1]
  batch["fb_mask"] = np.zeros((n_rows, length), np.float32)
  batch["fb_logp"] = np.zeros((n_rows, length, width), np.float32)
  if topk > 0:
    batch["fb_idx"] = np.zeros((n_rows, length, topk), np.int32)
    batch["fb_tail"] = np.zeros((n_rows, length), np.float32)
  for j, job in enumerate(jobs):
    row, at = place[job.row] if place is not None else (job.row, 0)
    end = min(job.end, length - at)
    s = slice(job.start + at, end + at)
    t = slice(job.start + job.offset, end + job.offset)
    batch["fb_mask"][row, s] = 1.0
    batch["fb_logp"][row, s] = teacher["logp"][j, t]
    if topk > 0:
      batch["fb_idx"][row, s] = teacher["idx"][j, t]
      batch["fb_tail"][row, s] = teacher["tail_logp"][j, t]
  return batch


def make_teacher_fn(graphdef, cfg: Config):
  """Jitted teacher forward: target-aligned teacher distributions for every position of a batch."""
  from flax import nnx
  rl = cfg.rl

  @jax.jit
  def teacher(params, rest, tokens, segment_ids, positions, experts):
    model = nnx.merge(graphdef, params, rest)
    replay = jnp.moveaxis(experts, 2, 0) if rl.router_replay and cfg.model.n_moe_layers else None
    out = model(tokens, segment_ids, positions, routed_experts=replay, mtp=False)
    t = teacher_targets(out.logits, rl.feedback_topk, rl.temperature)
    # source-aligned (row t predicts t+1) -> target-aligned (row t predicts x_t)
    return jax.tree.map(lambda x: jnp.pad(x[:, :-1], [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2)), t)

  return teacher


# --------------------------------------------------------------------------------------------------
# The loss handed to the train step
# --------------------------------------------------------------------------------------------------


def make_rl_loss(cfg: Config):
  rl = cfg.rl
  use_replay = rl.router_replay and cfg.model.n_moe_layers > 0

  def loss_fn(model, batch: dict, _cfg):
    replay = jnp.moveaxis(batch["experts"], 2, 0) if use_replay else None
    out = model(batch["tokens"], batch["segment_ids"], batch["positions"], routed_experts=replay,
                mtp=False, return_live_routing=cfg.model.n_moe_layers > 0)
    logp, ent = token_logprobs(out.logits, batch["tokens"], rl.temperature, with_entropy=True)
    now = jax.lax.stop_gradient(logp)
    old = now
    if "old_logp" in batch:  # old_is_current = 1: this pass runs at the weights old_logp is defined at
      old = jnp.where(batch["old_is_current"][:, None] > 0, now, batch["old_logp"])
    pg_batch = {"old_logp": old, "sampler_logp": batch["sampler_logp"],
                "advantages": batch["advantages"], "loss_mask": batch["loss_mask"], "entropy": ent,
                "ref_logp": batch.get("ref_logp"), "segment_ids": batch["segment_ids"]}
    loss, metrics = policy_loss(logp, pg_batch, rl)
    if rl.sft_mix_coef > 0 and "sft_mask" in batch:
      lp = logp if rl.temperature == 1.0 else token_logprobs(out.logits, batch["tokens"])
      sm = batch["sft_mask"]
      ce = -jnp.sum(lp * sm) / jnp.maximum(jnp.sum(sm), 1.0)
      loss = loss + rl.sft_mix_coef * ce
      metrics.update(sft_mix_ce=ce, loss=loss)
    mask = batch["loss_mask"]
    if out.live_routing is not None:
      # Tokens whose live router choice differs from the sampler's in at least one layer.
      rec = jnp.moveaxis(batch["experts"], 2, 0)  # [n_moe, b, s, k]
      same = jnp.all(jnp.sort(out.live_routing, -1) == jnp.sort(rec, -1), axis=-1).all(0)
      recorded = jnp.all(rec >= 0, axis=(0, -1)) & (batch["segment_ids"] != 0)
      metrics["routing_mismatch_frac"] = (jnp.sum((~same) & recorded)
                                          / jnp.maximum(jnp.sum(recorded), 1))
    if rl.feedback_kl_coef > 0 and "fb_mask" in batch:
      teacher = {"logp": batch["fb_logp"]}
      if rl.feedback_topk > 0:
        teacher.update(idx=batch["fb_idx"], tail_logp=batch["fb_tail"])
      kl, fm = feedback_kl(out.logits, teacher, batch["fb_mask"], rl.feedback_topk, rl.temperature)
      loss = loss + rl.feedback_kl_coef * kl
      metrics.update(fm)
      metrics["loss"] = loss
    metrics["tokens"] = mask.sum()
    if "old_logp" in batch:  # the next PPO pass's old_logp when this pass is the step's first
      metrics[ROWS] = {"logp": now}
    return loss, metrics, out

  return loss_fn

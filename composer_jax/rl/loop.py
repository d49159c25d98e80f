"""The synchronous RL loop: rollouts with the current weights, then one learner update, repeated.

Each step takes ``rl.tasks_per_step`` tasks from a seeded, checkpointed task stream, plays
``rl.group_size`` episodes of each through the sampler engine and the sandboxed tools, scores them
(grade - concave length penalty - shaping; hacks zeroed), gives each rollout its group advantage,
detects hints for targeted textual feedback and computes the hinted teacher's targets, and updates
the policy with the shared train step (``train/step.py``) and the RL loss of ``learner.py``. The
engine then gets the new weights with the next version number.

A run directory holds what the training stages write (config.yaml, tokenizer.json, metrics.jsonl,
tb/, plots/, checkpoints/) plus rollouts.jsonl (one line per episode played; ``trained`` is false for
the groups dynamic sampling set aside) and, with ``rl.eval_tasks``,
eval/summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.config import Config, ConfigError, dump_config
from composer_jax.model.build import abstract_model
from composer_jax.parallel.multihost import barrier, is_primary
from composer_jax.rl import learner as L
from composer_jax.rl import worker_devices
from composer_jax.rl.agent import Job, RolloutRunner
from composer_jax.rl.curriculum import make_stream
from composer_jax.rl.preflight import check_learner
from composer_jax.train.step import ROWS


def load_task_set(path: str, field: str) -> list:
  from composer_jax.env.tasks import TaskError, load_tasks
  if not path:
    raise ConfigError(f"{field} is empty: give a folder of tasks (composer-jax tasks generate "
                      "--synthetic N --out DIR)")
  try:
    return load_tasks(path)
  except TaskError as e:
    raise ConfigError(f"{field}={path!r}: {e}") from None


def check_isolation(cfg: Config) -> str:
  """Model-driven episodes never run unisolated: the sandbox mode to use, or one line saying how to
  get bubblewrap."""
  from composer_jax.env import sandbox
  try:
    return sandbox.require_isolation(cfg.env.sandbox, "model-driven episodes")
  except sandbox.SandboxError as e:
    raise ConfigError(str(e)) from None


def draft_metrics(drafts: int, kept: int) -> dict:
  """rl.speculative_mtp: MTP drafts proposed and kept over a step's rollouts, and the kept share."""
  return {"mtp_drafts": int(drafts), "mtp_drafts_kept": int(kept),
          "mtp_acceptance": kept / drafts if drafts else 0.0}


def rollout_record(step: int, r, trained: bool = True) -> dict:
  return {"step": step, "task": r.task_id, "group": r.group, "trained": trained, "reward": r.reward,
          "resolved": r.resolved, "completion_tokens": r.completion_tokens, "segments": len(r.segments),
          "summaries": r.summaries, "cut": r.cut, "hints": [h.kind for h in r.hints],
          "parts": r.parts, "flags": r.traj.flags, "messages": r.traj.messages}


class RLRun:
  """State of one RL run: trainer, engine, runner, task stream, logs."""

  def __init__(self, cfg: Config, out_dir: str, *, init: str | None = None, resume: bool = False,
               log=print):
    from composer_jax.data.tokenizer import load_tokenizer
    from composer_jax.parallel.mesh import maybe_initialize_distributed
    from composer_jax.rl.learner_group import LearnerGroup
    from composer_jax.rl.sampler import Engine
    from composer_jax.train import checkpoint as ckpt_lib
    from composer_jax.train.loop import MetricsLog, _from_items, _items, build_trainer
    maybe_initialize_distributed(cfg.mesh)  # before any device is touched
    # Several learner processes: process 0 leads (rollouts, batches, files), the others follow
    # (learner_group.py). One process is its own leader.
    self.leader = is_primary()
    rl = cfg.rl
    updates = rl.steps * rl.minibatches * rl.epochs  # the optimizer's schedule spans every update
    if cfg.train.steps != updates:
      cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=updates))
    self.cfg, self.out, self.log = cfg, out_dir, log
    self.tasks = load_task_set(rl.tasks, "rl.tasks")
    self.mode = check_isolation(cfg) if self.leader else None  # followers run no episodes
    check_learner(cfg)  # one line, before anything is written, the weights made or the step compiled
    os.makedirs(out_dir, exist_ok=True)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    init_ckpt, init_step = ckpt_lib.find_checkpoint(init) if init else (None, None)
    if not os.path.exists(tok_path):
      src = os.path.join(os.path.dirname(init_ckpt), "tokenizer.json") if init else None
      if not src or not os.path.exists(src):
        raise ConfigError("rl needs the policy's tokenizer: pass --init RUN_DIR of an sft/pretrain run "
                          "(its tokenizer.json is reused)")
      if self.leader:
        shutil.copy(src, tok_path)
    barrier("rl tokenizer")
    self.tok = load_tokenizer(tok_path)
    if self.leader:
      dump_config(cfg, os.path.join(out_dir, "config.yaml"))
    self.tr = build_trainer(cfg, loss_fn=L.make_rl_loss(cfg))
    self.ck = ckpt_lib.Checkpointer(os.path.join(out_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                                    every=cfg.checkpoint.every, async_save=cfg.checkpoint.async_save)
    self._items, self._from_items = _items, _from_items
    self.stream = make_stream(self.tasks, cfg)
    self.start = 0
    self.resumed_data: dict | None = None  # the checkpoint's JSON data item, when resumed
    restored = self.ck.restore_latest(_items(self.tr.state)) if resume else None
    if restored is not None:
      self.start, items = restored
      self.tr.state = _from_items(items)
      self.stream.set_state(items["data"]["tasks"])
      self.resumed_data = items["data"]
      log(f"resumed from {self.ck.directory}/{self.start}")
    elif init:
      src = ckpt_lib.Checkpointer(init_ckpt, keep=1000, async_save=False)
      targets = {"params": self.tr.state["params"], "rest": self.tr.state["rest"]}
      got = (src.restore_latest(targets, json_items=()) if init_step is None
             else (init_step, src.restore(init_step, targets, json_items=())))
      src.close()
      if got is None:
        raise ConfigError(f"--init {init!r} holds no readable checkpoint")
      # init_state: the optimizer (its float32 master copy of bf16 weights) starts from these weights
      from composer_jax.train.loop import init_state
      init_state(self.tr, got[1]["params"], got[1]["rest"])
      log(f"initialised the policy from {init_ckpt}/{got[0]}")
    self.frozen = None
    if (rl.feedback_kl_coef > 0 and rl.feedback_teacher == "frozen") or rl.kl_coef > 0:
      self.frozen = jax.tree.map(jnp.copy, (self.tr.state["params"], self.tr.state["rest"]))
    self.teacher_fn = L.make_teacher_fn(self.tr.graphdef, cfg) if rl.feedback_kl_coef > 0 else None
    self.logp_fn = _make_logp_fn(self.tr.graphdef, cfg)
    self.group = LearnerGroup(self)
    # The learner job's own sampler (the sync loop's rollouts, the end-of-run evaluation): on the
    # leader's devices, laid out as a Ray worker's (rl.worker_devices); or (rl.learner_sampler=mesh)
    # on the trainer's mesh, every process holding its shards and replaying the leader's calls.
    self.on_mesh = rl.learner_sampler == "mesh"
    if (rl.async_ and rl.broadcast_from == "leader") or not self.on_mesh:
      self.group.gather_initial(self.start)  # every process: the first host copy of the weights
    self.metrics = MetricsLog(out_dir, self.start)
    self.engine = self.runner = self.sft_chats = self.demos = self.rollout_file = None
    self.sampler_mesh = self.sampler_shardings = None
    if self.leader or self.on_mesh:
      self.sampler_mesh, self.sampler_shardings = worker_devices.learner_layout(
          cfg, nnx.split(abstract_model(cfg), nnx.Param, ...)[1:], self.tr.mesh)
      self.engine = Engine(self.tr.graphdef, *self.sampler_weights(self.start), cfg,
                           n_slots=rl.decode_batch, max_len=rl.max_context, seed=rl.seed + self.start,
                           version=self.start, mesh=self.sampler_mesh,
                           tell=self.group._tell if self.on_mesh and self.leader and self.group.multi
                           else None)
    if not self.leader:
      return
    self.runner = RolloutRunner(self.engine, self.tok, cfg, mode=self.mode, log=log)
    self.sft_chats = _load_sft_chats(rl.sft_mix_path, self.tok) if rl.sft_mix_coef > 0 else None
    if rl.expert_demo_rows > 0:
      from composer_jax.rl.demos import ExpertDemos
      self.demos = ExpertDemos(self.tasks, self.tok, cfg, self.mode, log=log)
      if self.resumed_data and "demos" in self.resumed_data:
        self.demos.set_state(self.resumed_data["demos"])
    self.rollout_file = open(os.path.join(out_dir, "rollouts.jsonl"), "a")  # noqa: SIM115

  # ------------------------------------------------------------------------------------------------

  def _batch(self, rollouts, stats, step: int = 0) -> tuple[dict, dict]:
    cfg, rl = self.cfg, self.cfg.rl
    m = cfg.model
    rows, where = L.segment_rows(rollouts, stats["advantages"])
    mesh = self.tr.mesh
    n_batch_shards = int(np.prod([mesh.shape[a] for a in ("data", "fsdp", "expert")]))
    quantum = cfg.train.grad_accum * rl.minibatches * n_batch_shards
    pad = self.tok.pad_id if self.tok.pad_id is not None else 0
    lengths = [len(r.tokens) for r in rows]
    length = L.bucket(max(lengths), rl.max_context)
    if rl.pack_length:  # rows holding several segments; a power-of-two count of quanta
      length = max(length, rl.pack_length)
      bins = L.first_fit(lengths, length)
      n_rows = quantum * (1 << max(0, math.ceil(math.log2(-(-len(bins) // quantum)))))
      place = L.placements(bins, lengths)
    else:  # one segment a row; a fixed row count (one shape per length bucket)
      bins, place = None, None
      n_rows = L.row_count(len(rows), int(np.lcm(quantum, rl.tasks_per_step * rl.group_size)))
    batch = L.pack_rows(rows, n_rows, length, m.n_moe_layers, m.n_experts_per_tok, pad, bins)
    info = {"hints": 0, "rows": n_rows, "row_length": length,
            "fill": float(sum(lengths)) / (n_rows * length)}
    if self.teacher_fn is not None:
      jobs = L.feedback_jobs(rollouts, where, self.tok, cfg)
      info["hints"] = len(jobs)
      teacher = {"logp": np.zeros((0, length, rl.feedback_topk or m.vocab_size), np.float32)}
      if jobs:
        tl = L.bucket(max(len(j.tokens) for j in jobs), rl.max_context)
        tb = L.pack_rows([L.Row(j.tokens, j.experts) for j in jobs], L.row_count(len(jobs), 4), tl,
                         m.n_moe_layers, m.n_experts_per_tok, pad)
        teacher = self.group.teacher("frozen" if rl.feedback_teacher == "frozen" else "current", tb)
      L.attach_teacher(batch, jobs, teacher, rl.feedback_topk, place)
    if self.sft_chats is not None:  # PPO-ptx rows, after the teacher rows (they index RL rows);
      # the same chats at a given step on every resume
      rng = np.random.default_rng([rl.seed, 7, step])
      picked = [self.sft_chats[i] for i in rng.choice(len(self.sft_chats), rl.sft_mix_rows)]
      if self.demos is not None:  # the expert's runs of queued RL tasks take the first rows
        demos = self.demos.take(rl.expert_demo_rows)
        picked = demos + picked[len(demos):]
        info["expert_demos"] = len(demos)
      sft = L.sft_rows(picked, L.row_count(rl.sft_mix_rows, quantum), length, m.n_moe_layers,
                       m.n_experts_per_tok, pad)
      batch = L.interleave(batch, sft, rl.minibatches)
      info["rows"] = batch["tokens"].shape[0]
    n_rows = batch["tokens"].shape[0]
    if rl.minibatches == 1 and rl.epochs > 1:
      # old_logp are the learner's log-probs before this step's updates. The first pass runs at
      # exactly those weights (ratio 1) and returns its log-probs as the later passes' old_logp: no
      # separate forward (``learn``). Sampler-vs-learner drift is sampler_logp's correction.
      batch["old_logp"] = np.zeros(batch["tokens"].shape, np.float32)
      batch["old_is_current"] = np.ones((n_rows,), np.float32)
    elif rl.minibatches > 1:  # minibatch i runs after i updates: a forward before the first
      batch["old_logp"] = self.group.logp("current", batch)
      batch["old_is_current"] = np.zeros((n_rows,), np.float32)
    if rl.kl_coef > 0:
      batch["ref_logp"] = self.group.logp("frozen", batch)
    return batch, info

  def step(self, step: int) -> dict:
    rl = self.cfg.rl
    t0 = time.perf_counter()
    drafts0 = (self.engine.stats["drafts"], self.engine.stats["drafts_kept"])
    drawn: list[list] = []
    flags: list[bool] = []  # per drawn group: informative (rl.dynamic_sampling)
    for _ in range(rl.dynamic_max_rounds if rl.dynamic_sampling else 1):
      chosen = {len(drawn) + g: t for g, t in enumerate(self.stream.take(rl.tasks_per_step))}
      jobs = [Job(self.tasks[t], gid, s) for gid, t in chosen.items() for s in range(rl.group_size)]
      new = L.split_groups(self.runner.run(jobs))
      for grp in new:
        self.observe(chosen[grp[0].group], [r.resolved for r in grp])
      drawn += new
      if not rl.dynamic_sampling:
        break
      flags += [L.informative(g, self.cfg) for g in new]
      if sum(flags) >= rl.tasks_per_step:
        break
    keep, report, untrained = self._select(drawn, flags)
    rec = self.learn(step, keep, report, time.perf_counter() - t0, untrained)
    if rl.speculative_mtp:
      rec.update(draft_metrics(self.engine.stats["drafts"] - drafts0[0],
                               self.engine.stats["drafts_kept"] - drafts0[1]))
    return rec

  def _select(self, drawn: list[list], flags: list[bool]) -> tuple[list, dict | None, list]:
    """(trained rollouts, what was drawn, the rollouts set aside): the pass rates and rewards
    reported for a step are those of every group drawn, not only of those trained on (which dynamic
    sampling picks for spread). ``flags``: each drawn group's ``learner.informative`` (dynamic
    sampling only)."""
    rl = self.cfg.rl
    if not rl.dynamic_sampling:
      return L.regroup(drawn), None, []
    report = L.score_rollouts(L.regroup(drawn), self.cfg, ks=sorted({1, rl.group_size}))
    keep, report["groups_informative"] = L.dynamic_pick(drawn, flags, rl.tasks_per_step)
    report["groups_drawn"] = len(drawn)
    picked = {id(g) for g in keep}
    return L.regroup(keep), report, [r for g in drawn if id(g) not in picked for r in g]

  def learn(self, step: int, rollouts: list, drawn: dict | None, rollout_s: float,
            untrained: list = ()) -> dict:
    """Score a step's rollouts, update the policy, publish the new weights; the step's metrics.
    ``drawn``: score_rollouts of every group sampled this step, when more than were trained on;
    ``untrained``: the rollouts dynamic sampling set aside (logged, not trained)."""
    cfg, rl = self.cfg, self.cfg.rl
    t1 = time.perf_counter()
    stats = L.score_rollouts(rollouts, cfg, ks=sorted({1, rl.group_size}))
    shown = drawn or stats
    batch, info = self._batch(rollouts, stats, step)
    n_mb = rl.minibatches
    per = batch["tokens"].shape[0] // n_mb
    learn = {}
    for _ in range(rl.epochs):
      for i in range(n_mb):
        mb = {k: v[i * per:(i + 1) * per] for k, v in batch.items()}
        out = self.group.train(mb)
        rows = out.pop(ROWS, None)
        if rows is not None and batch["old_is_current"][0] > 0:  # set only with one minibatch
          batch.update(old_logp=rows["logp"], old_is_current=np.zeros_like(batch["old_is_current"]))
        for k, v in out.items():
          learn[k] = learn.get(k, 0.0) + float(v) / (n_mb * rl.epochs)
    t2 = time.perf_counter()
    self.publish(step)
    grading = sum(float(r.traj.grade.get("seconds", 0.0)) for r in rollouts)
    rec = {"step": step, "reward_mean": shown["reward_mean"], "pass_rate": shown["pass_rate"],
           **{k: v for k, v in shown.items() if k.startswith(("pass@", "pass^", "groups_"))},
           "trained_groups": len(L.split_groups(rollouts)),
           "completion_tokens_mean": float(np.mean([r.completion_tokens for r in rollouts])),
           "length_penalty_mean": float(np.mean([r.parts.get("length_penalty", 0.0) for r in rollouts])),
           "shaping_penalty_mean": float(np.mean([r.parts.get("shaping_penalty", 0.0) for r in rollouts])),
           "hints": info["hints"], "learner_rows": info["rows"], "learner_row_length": info["row_length"],
           "learner_fill": info["fill"], "summaries": int(sum(r.summaries for r in rollouts)),
           "segments": int(sum(len(r.segments) for r in rollouts)),
           "tokens_per_segment": float(np.mean([len(s) for r in rollouts for s in r.segments])),
           "flagged_hacks": stats["flagged_hacks"], "cut_episodes": int(sum(r.cut for r in rollouts)),
           "rollout_s": rollout_s, "grading_s": grading, "learn_s": t2 - t1,
           "rollout_tokens_per_s": sum(r.completion_tokens for r in rollouts) / max(rollout_s, 1e-9),
           "version": step, **learn}
    rec.setdefault("feedback_kl", 0.0)
    rec.setdefault("routing_mismatch_frac", 0.0)
    if self.demos is not None:  # demonstrations trained this step; tasks waiting for one
      rec.update(expert_demos=info.get("expert_demos", 0), expert_demos_queued=len(self.demos.queue),
                 expert_demos_failed=self.demos.counts["expert_failed"])
    for r in rollouts:
      self.rollout_file.write(json.dumps(rollout_record(step, r)) + "\n")
    for r in untrained:
      self.rollout_file.write(json.dumps(rollout_record(step, r, trained=False)) + "\n")
    self.rollout_file.flush()
    return rec

  def publish(self, version: int) -> None:
    """The sampler gets the new weights (the async loop broadcasts them to its workers too)."""
    self.engine.set_weights(*self.sampler_weights(version), version)

  def sampler_weights(self, version: int):
    """The policy for the learner job's own engine: the trainer's arrays (rl.learner_sampler=mesh);
    else placed on the sampler mesh (rl.worker_devices > 1); else the trainer's arrays with one
    process, and with several the gathered host copy on this process's first device."""
    if self.on_mesh:  # the trainer's own arrays (the layouts are one)
      return self.tr.state["params"], self.tr.state["rest"]
    w = self.group.weights(version)
    if self.sampler_shardings is not None:
      leaves, treedef = jax.tree.flatten(w)
      return jax.tree.unflatten(treedef, jax.device_put(leaves, self.sampler_shardings))
    return jax.device_put(w, jax.local_devices()[0]) if self.group.multi else w

  def observe(self, task: int, resolved: list[bool]) -> None:
    """A drawn group's outcome, for the task stream's curriculum and the expert demonstrations."""
    self.stream.observe(task, resolved)
    if self.demos is not None:
      self.demos.observe(task, resolved)

  def checkpoint_data(self, step: int) -> dict:
    data = {"tasks": self.stream.state(), "version": step}
    if self.demos is not None:
      data["demos"] = self.demos.state()
    return data

  def run(self) -> dict:
    from composer_jax.train.loop import plot_metrics
    cfg = self.cfg
    total = cfg.rl.steps
    if not self.leader:  # a follower: the leader's collective calls, then the end of the run
      self.group.follow()
      self.ck.close()
      return {}
    evaluation = (lambda: evaluate(self.runner, load_task_set(cfg.rl.eval_tasks, "rl.eval_tasks"),
                                   cfg.eval.samples, os.path.join(self.out, "eval"), cfg.eval.k,
                                   self.log)) if cfg.rl.eval_tasks else None
    try:
      last = self._steps(total)
      if evaluation and self.on_mesh:  # while the followers still replay the engine's calls
        last["eval"] = evaluation()
    except BaseException:
      self.group.stop()  # let the followers exit instead of waiting on a leader that has stopped
      raise
    self.group.stop()
    self.ck.close()
    self.metrics.close()
    self.rollout_file.close()
    plot_metrics(self.out, RL_PLOTS)
    if evaluation and not self.on_mesh:
      last["eval"] = evaluation()
    self.log(f"done: {total} RL steps in {self.out}")
    return last

  def _steps(self, total: int) -> dict:
    from tqdm import tqdm
    cfg = self.cfg
    bar = tqdm(total=total, initial=self.start, disable=not cfg.train.progress, unit="step",
               dynamic_ncols=True, desc="rl")
    last: dict = {}
    for step in range(self.start + 1, total + 1):
      last = self.step(step)
      self.metrics.write(last)
      bar.set_postfix(reward=f"{last['reward_mean']:.3f}", pass_=f"{last['pass_rate']:.2f}")
      bar.update(1)
      if self.ck.should_save(step, total):
        self.group.save(step, self.checkpoint_data(step),
                        {"step": step, "stage": "rl", "config": cfg.to_dict()})
    bar.close()
    return last


RL_PLOTS = ("reward_mean", "pass_rate", "completion_tokens_mean", "loss", "grad_norm",
            "train_infer_logprob_abs_diff", "routing_mismatch_frac", "length_penalty_mean",
            "feedback_kl", "hints", "summaries", "rollout_s", "learn_s")


def _load_sft_chats(path: str, tok) -> list[dict]:
  """rl.sft_mix_path's chats as token ids and assistant masks (``data.sft.encode_chat``)."""
  from composer_jax.data.sft import encode_chat, read_trajectories
  if not os.path.isfile(path):
    raise ConfigError(f"rl.sft_mix_path={path!r} is not a file: rl.sft_mix_coef > 0 needs the SFT "
                      "trajectories (JSONL of chats)")
  return [encode_chat(msgs, tok) for msgs in read_trajectories(path)]


def _make_logp_fn(graphdef, cfg: Config):
  """Jitted trainer log-probs of a learner batch (behaviour / reference log-probs), with replay."""
  from composer_jax.rl.losses import token_logprobs
  use_replay = cfg.rl.router_replay and cfg.model.n_moe_layers > 0

  @jax.jit
  def logp(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    replay = jnp.moveaxis(batch["experts"], 2, 0) if use_replay else None
    out = model(batch["tokens"], batch["segment_ids"], batch["positions"], routed_experts=replay,
                mtp=False)
    return token_logprobs(out.logits, batch["tokens"], cfg.rl.temperature)

  return lambda params, rest, batch: logp(params, rest, {k: batch[k] for k in
                                                         ("tokens", "segment_ids", "positions", "experts")})


# --------------------------------------------------------------------------------------------------
# Evaluation with a model policy (also `composer-jax eval --policy RUN_DIR`)
# --------------------------------------------------------------------------------------------------


def evaluate(runner: RolloutRunner, tasks: list, samples: int, out_dir: str, ks=(1,), log=print) -> dict:
  """Every task ``samples`` times through the batched runner; the harness's summary and plot."""
  from composer_jax.eval.bench import summarize
  from composer_jax.eval.plots import plot_score_vs_tokens
  os.makedirs(out_dir, exist_ok=True)
  t0 = time.perf_counter()
  jobs = [Job(t, i, s) for i, t in enumerate(tasks) for s in range(samples)]
  rollouts = runner.run(jobs)
  results: dict[str, list[dict]] = {t.instance_id: [] for t in tasks}
  with open(os.path.join(out_dir, "trajectories.jsonl"), "w") as f:
    for r in rollouts:
      tr = r.traj
      from composer_jax.env.guards import Flag, is_hack
      results[r.task_id].append({"reward": tr.reward, "resolved": tr.resolved,
                                 "completion_tokens": r.completion_tokens, "tool_calls": tr.tool_calls,
                                 "format_errors": tr.format_errors, "wall_s": tr.wall_s,
                                 "hack": is_hack([Flag(**x) for x in tr.flags])})
      f.write(json.dumps({**tr.to_json(), "completion_tokens": r.completion_tokens,
                          "summaries": r.summaries}) + "\n")
  summary = {"policy": "model", **summarize(results, list(ks)),
             "elapsed_s": round(time.perf_counter() - t0, 2)}
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  plot_score_vs_tokens(summary, os.path.join(out_dir, "score_vs_tokens.png"),
                       f"model: {summary['tasks']} tasks x {samples}")
  log(f"[eval] pass@1 {summary['pass@1']:.3f} over {summary['tasks']} tasks x {samples} "
      f"({summary['elapsed_s']:.0f} s)")
  return summary


def load_policy(run_dir: str, overrides: list[str] = ()):
  """(cfg, tokenizer, graphdef, params, rest) of a run directory's newest checkpoint, restored into
  abstract targets (no random model is built first)."""
  from composer_jax.config import load_config
  from composer_jax.data.tokenizer import load_tokenizer
  from composer_jax.train import checkpoint as ckpt_lib
  ck_dir, step = ckpt_lib.find_checkpoint(run_dir)
  run = os.path.dirname(ck_dir)
  cfg_path, tok_path = os.path.join(run, "config.yaml"), os.path.join(run, "tokenizer.json")
  if not (os.path.isdir(ck_dir) and os.path.exists(cfg_path) and os.path.exists(tok_path)):
    raise ConfigError(f"--policy {run_dir!r} is not a run directory (config.yaml, tokenizer.json, "
                      "checkpoints/): pass a pretrain/sft/rl --out folder, oracle or null")
  cfg = load_config(cfg_path, list(overrides))
  graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
  # Onto this process's devices, whatever devices wrote it (a multi-host run's checkpoint names
  # devices that do not exist here): the first one, or with rl.worker_devices > 1 the sampler mesh
  # over the first N, each device reading only its slices (rl/worker_devices.py); with
  # rl.learner_sampler=mesh the trainer's mesh over every process (all of them restore together).
  _, shardings = worker_devices.learner_layout(cfg, (params, rest))
  leaves, treedef = jax.tree.flatten((params, rest))
  shardings = shardings or [jax.sharding.SingleDeviceSharding(jax.local_devices()[0])] * len(leaves)
  params, rest = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                              for x, s in zip(leaves, shardings)])
  src = ckpt_lib.Checkpointer(ck_dir, keep=1000, async_save=False,
                              local=cfg.rl.learner_sampler != "mesh")
  targets = {"params": params, "rest": rest}
  got = src.restore_latest(targets, json_items=()) if step is None else (step, src.restore(step, targets, json_items=()))
  src.close()
  if got is None:
    raise ConfigError(f"--policy {run_dir!r} holds no readable checkpoint")
  return cfg, load_tokenizer(tok_path), graphdef, got[1]["params"], got[1]["rest"]


def eval_run_dir(run_dir: str, tasks: list, samples: int, out_dir: str, overrides: list[str] = (),
                 log=print) -> dict:
  """``tasks`` x ``samples`` episodes of a run directory's policy. With rl.learner_sampler=mesh on
  several processes every process calls this: process 0 plays the episodes and returns the
  summary, the others replay its engine's calls and return {}."""
  from composer_jax.parallel.multihost import follow, tell
  from composer_jax.rl.sampler import Engine
  cfg, tok, graphdef, params, rest = load_policy(run_dir, overrides)
  spans = cfg.rl.learner_sampler == "mesh" and jax.process_count() > 1
  engine = Engine(graphdef, params, rest, cfg, n_slots=cfg.rl.decode_batch, max_len=cfg.rl.max_context,
                  seed=cfg.rl.seed, mesh=worker_devices.learner_mesh(cfg),
                  tell=tell if spans and is_primary() else None)
  if spans and not is_primary():
    follow({"engine": lambda cmd, a: engine.replay(a, cmd["view"])})
    return {}
  try:
    # pass@k at k = samples is always reported (the main job's table shows it), beside eval.k.
    return evaluate(RolloutRunner(engine, tok, cfg, mode=check_isolation(cfg), log=log), tasks,
                    samples, out_dir, sorted(set(cfg.eval.k) | {samples}), log)
  finally:
    if spans:
      tell("stop")


def run_rl(cfg: Config, out_dir: str, *, init: str | None = None, resume: bool = False,
           log=print) -> dict:
  if cfg.rl.async_:
    from composer_jax.rl.async_loop import AsyncRLRun
    return AsyncRLRun(cfg, out_dir, init=init, resume=resume, log=log).run()
  return RLRun(cfg, out_dir, init=init, resume=resume, log=log).run()

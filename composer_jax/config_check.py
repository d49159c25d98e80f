"""Config validation: impossible combinations, one line each, before anything is built or compiled."""

from __future__ import annotations

import math
import os

from composer_jax.config import Config, ConfigError


def _require(cond: bool, msg: str) -> None:
  if not cond:
    raise ConfigError(msg)


def validate(cfg: Config) -> None:
  m = cfg.model
  for name in ("vocab_size", "d_model", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_dim",
               "qk_rope_dim", "v_head_dim", "max_seq_len", "dense_ffn_dim"):
    _require(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be positive")
  _require(m.q_lora_rank >= 0, "model.q_lora_rank must be >= 0 (0 = direct query projection)")
  _require(0 <= m.n_dense_layers <= m.n_layers,
           f"model.n_dense_layers={m.n_dense_layers} must be between 0 and model.n_layers={m.n_layers}")
  _require(m.qk_rope_dim % 2 == 0, f"model.qk_rope_dim={m.qk_rope_dim} must be even (RoPE rotates pairs)")
  if m.n_moe_layers > 0:
    _require(m.n_routed_experts > 0, "model.n_routed_experts must be positive when there are MoE layers")
    _require(m.moe_ffn_dim > 0, "model.moe_ffn_dim must be positive")
    _require(1 <= m.n_experts_per_tok <= m.n_routed_experts,
             f"model.n_experts_per_tok={m.n_experts_per_tok} must be in 1..model.n_routed_experts"
             f"={m.n_routed_experts}")
    _require(m.n_group >= 1 and m.n_routed_experts % m.n_group == 0,
             f"model.n_group={m.n_group} must divide model.n_routed_experts={m.n_routed_experts}")
    _require(1 <= m.topk_group <= m.n_group,
             f"model.topk_group={m.topk_group} must be in 1..model.n_group={m.n_group}")
    per_group = m.n_routed_experts // m.n_group
    _require(m.topk_group * per_group >= m.n_experts_per_tok,
             f"model.topk_group={m.topk_group} groups of {per_group} experts cannot supply "
             f"model.n_experts_per_tok={m.n_experts_per_tok}: raise topk_group or lower top-k")
    if m.n_group > 1 and m.scoring == "sigmoid":
      _require(per_group >= 2, "model.n_group: group-limited sigmoid routing scores a group by its "
               "top-2 experts, so each group needs >= 2 experts; lower n_group")
  block = {"fp8_block": 128, "mxfp8": 32, "nvfp4": 16}.get(m.gmm_precision)
  if block and m.n_moe_layers > 0:
    _require(m.d_model % block == 0 and m.moe_ffn_dim % block == 0,
             f"model.gmm_precision={m.gmm_precision} quantizes blocks of {block}: model.d_model="
             f"{m.d_model} and model.moe_ffn_dim={m.moe_ffn_dim} must both be multiples of {block}")
  _require(m.yarn_factor >= 1.0, f"model.yarn_factor={m.yarn_factor} must be >= 1 (1 = plain RoPE)")
  _require(m.mtp_depths >= 0, "model.mtp_depths must be >= 0")
  _require(m.rms_eps > 0, "model.rms_eps must be positive")
  _require(m.attention_block > 0, f"model.attention_block={m.attention_block} must be positive")
  _require(m.attention_rows >= 0, f"model.attention_rows={m.attention_rows} must be >= 0 (0 = one plan a batch)")
  # Zero or negative here trains on NaNs or inverted weights without a word: refuse them up front.
  _require(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be positive (10000 is the usual base)")
  _require(m.init_std > 0, f"model.init_std={m.init_std} must be positive (e.g. 0.02)")
  _require(m.n_shared_experts >= 0, f"model.n_shared_experts={m.n_shared_experts} must be >= 0")
  _require(m.routed_scaling_factor > 0, f"model.routed_scaling_factor={m.routed_scaling_factor} must be positive")
  _require(m.mtp_loss_weight >= 0, f"model.mtp_loss_weight={m.mtp_loss_weight} must be >= 0")
  _require(m.yarn_original_max_position >= 1,
           f"model.yarn_original_max_position={m.yarn_original_max_position} must be >= 1")
  _require(not m.scan_layers or m.n_moe_layers > 0,
           f"model.scan_layers=true scans the MoE layers, but model.n_layers={m.n_layers} are all dense "
           f"(model.n_dense_layers={m.n_dense_layers}): set model.scan_layers=false")

  d = cfg.data
  _require(d.seq_len > 0 and d.batch_size > 0, "data.seq_len and data.batch_size must be positive")
  _require(d.seq_len <= m.max_seq_len,
           f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}: raise max_seq_len")
  if d.weights:
    _require(len(d.weights) == len(d.sources),
             f"data.weights has {len(d.weights)} entries for {len(d.sources)} data.sources: give one each")
  _require(0.0 <= d.heldout_fraction < 1.0, "data.heldout_fraction must be in [0, 1)")
  _require(0.0 <= d.sft_copy_share < 1.0, f"data.sft_copy_share={d.sft_copy_share} must be in [0, 1) "
           "(the share of SFT chats that are edit drills)")
  _require(0.0 <= d.sft_spec_share and 0.0 <= d.sft_word_share
           and d.sft_copy_share + d.sft_spec_share + d.sft_word_share < 1.0,
           f"data.sft_spec_share={d.sft_spec_share} and data.sft_word_share={d.sft_word_share} must "
           f"be >= 0 and, with data.sft_copy_share={d.sft_copy_share}, sum below 1 (the shares of SFT "
           "chats that are drills)")
  _require(isinstance(d.sft_spec_levels, list) and d.sft_spec_levels
           and all(lv in (1, 2, 3) and not isinstance(lv, bool) for lv in d.sft_spec_levels),
           f"data.sft_spec_levels={d.sft_spec_levels} must be a non-empty list of the synthetic "
           "difficulty levels 1, 2, 3 (e.g. [2, 3])")
  _require(d.tokenizer_train_mb > 0, "data.tokenizer_train_mb must be positive (e.g. 8)")
  _require(len(d.sources) >= 1, "data.sources is empty: give at least one source, e.g. [stdlib]")
  _require(all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in d.weights)
           and (not d.weights or sum(d.weights) > 0),
           f"data.weights={d.weights} must be numbers >= 0 with a positive sum (or [] for equal weights)")
  _require(d.max_files >= 0, f"data.max_files={d.max_files} must be >= 0 (0 = no cap)")
  _require(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0")
  if d.tokenizer_vocab_size:  # a BPE this small cannot hold the bytes, chat tokens and tool tags
    from composer_jax.data.tokenizer import min_trained_vocab
    low = min_trained_vocab()
    _require(low <= d.tokenizer_vocab_size <= m.vocab_size,
             f"data.tokenizer_vocab_size={d.tokenizer_vocab_size} must be in [{low}, model.vocab_size="
             f"{m.vocab_size}] (0 = model.vocab_size)")

  mesh = cfg.mesh
  sizes = {a: getattr(mesh, a) for a in ("data", "fsdp", "expert", "tensor", "context")}
  for a, s in sizes.items():
    _require(s == -1 or s >= 1, f"mesh.{a}={s} must be >= 1 or -1 (fill)")
  _require(sum(1 for s in sizes.values() if s == -1) <= 1, "mesh: at most one axis may be -1 (fill)")
  if m.n_moe_layers > 0 and mesh.expert > 1:
    _require(m.n_routed_experts % mesh.expert == 0,
             f"model.n_routed_experts={m.n_routed_experts} is not divisible by mesh.expert="
             f"{mesh.expert}: choose an expert axis that divides the expert count")
  if mesh.tensor > 1:
    _require(m.n_heads % mesh.tensor == 0,
             f"model.n_heads={m.n_heads} is not divisible by mesh.tensor={mesh.tensor}")
  if mesh.context > 1:
    _require(d.seq_len % (2 * mesh.context) == 0,
             f"data.seq_len={d.seq_len} must be divisible by 2*mesh.context={2 * mesh.context} "
             "(load-balanced causal context parallelism)")

  o = cfg.optim
  _require(o.lr > 0 and math.isfinite(o.lr), f"optim.lr={o.lr} must be a positive finite number")
  _require(o.eps > 0, f"optim.eps={o.eps} must be positive (e.g. 1e-8)")
  _require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0 (0 = off)")
  _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1] (the "
           "schedule's floor as a share of optim.lr)")
  _require(o.clip_norm >= 0, f"optim.clip_norm={o.clip_norm} must be >= 0 (0 = no clipping)")
  _require(o.muon_ns_steps >= 1, f"optim.muon_ns_steps={o.muon_ns_steps} must be >= 1")
  _require(0 <= o.muon_momentum < 1, f"optim.muon_momentum={o.muon_momentum} must be in [0, 1)")
  _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optim.b1 and optim.b2 must be in [0, 1)")
  _require(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
  _require(o.qk_clip >= 0, f"optim.qk_clip={o.qk_clip} must be >= 0 (0 = off)")
  _require(0 < o.decay_fraction <= 1, "optim.decay_fraction must be in (0, 1] (WSD decay share)")
  t = cfg.train
  _require(t.steps >= 0, "train.steps must be >= 0")
  _require(t.grad_accum >= 1, "train.grad_accum must be >= 1")
  # log_every=0 would divide by zero at the first step, after the compile.
  _require(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
  _require(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0 (0 = only at the end)")
  _require(t.eval_batches >= 0, f"train.eval_batches={t.eval_batches} must be >= 0")
  _require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every} must be >= 0 (0 = only "
           "at the end)")
  _require(d.batch_size % t.grad_accum == 0,
           f"data.batch_size={d.batch_size} must be divisible by train.grad_accum={t.grad_accum}")
  _require(cfg.checkpoint.keep >= 1, "checkpoint.keep must be >= 1")
  _require(cfg.rl.group_size >= 1, "rl.group_size must be >= 1")
  r = cfg.rl
  _require(0 <= r.ppo_clip_low < 1, f"rl.ppo_clip_low={r.ppo_clip_low} must be in [0, 1)")
  _require(r.ppo_clip_high >= 0, f"rl.ppo_clip_high={r.ppo_clip_high} must be >= 0")
  _require(r.is_clip > 1, f"rl.is_clip={r.is_clip} must be > 1 (the weight cap; 2 is the usual choice)")
  for name in ("kl_coef", "adv_negative_weight", "length_penalty", "length_k", "length_q",
               "feedback_kl_coef", "max_hints", "penalty_malformed_call", "penalty_unknown_tool",
               "penalty_repeated_command", "penalty_no_call_turn", "length_w_reasoning", "length_w_tool_call",
               "length_w_tool_output", "length_w_final", "length_w_calls", "length_w_turns"):
    _require(getattr(r, name) >= 0, f"rl.{name}={getattr(r, name)} must be >= 0")
  _require(abs(r.entropy_coef) < 1, f"rl.entropy_coef={r.entropy_coef} must be in (-1, 1) (< 0 sharpens, "
           "> 0 explores; |0.001-0.01| is the usual range)")
  _require(r.length_ref > 0, f"rl.length_ref={r.length_ref} must be > 0 (the x where the penalty = coef)")
  _require(0 <= r.penalty_cap < 1, f"rl.penalty_cap={r.penalty_cap} must be in [0, 1) so a resolved "
           "episode always outscores an unresolved one")
  _require(0 <= r.partial_credit <= 1 - r.penalty_cap, f"rl.partial_credit={r.partial_credit} must be in "
           f"[0, 1 - rl.penalty_cap = {1 - r.penalty_cap:g}] so a resolved episode always outscores an "
           "unresolved one")
  _require(r.feedback_topk >= 0, f"rl.feedback_topk={r.feedback_topk} must be >= 0 (0 = full vocabulary)")
  _require(r.feedback_topk < cfg.model.vocab_size, f"rl.feedback_topk={r.feedback_topk} must be < "
           f"model.vocab_size={cfg.model.vocab_size} (use 0 for the full vocabulary)")
  for name in ("steps", "max_summaries", "top_k", "summary_trigger_tokens"):
    _require(getattr(r, name) >= 0, f"rl.{name}={getattr(r, name)} must be >= 0")
  _require(r.max_staleness >= 0, f"rl.max_staleness={r.max_staleness} must be >= 0 (0 = on-policy)")
  _require(r.full_sync_every >= 1, f"rl.full_sync_every={r.full_sync_every} must be >= 1")
  _require(r.object_store_mb == 0 or r.object_store_mb >= 75, f"rl.object_store_mb={r.object_store_mb}: "
           "Ray's object store needs at least 75 MiB; give >= 75, or 0 for Ray's default")
  _require(r.worker_cpus >= 0, f"rl.worker_cpus={r.worker_cpus} must be >= 0 (0 = no pinning)")
  from composer_jax.rl import worker_devices
  worker_devices.check(cfg)
  for name in ("tasks_per_step", "minibatches", "epochs", "decode_batch", "max_new_tokens", "num_workers",
               "dynamic_max_rounds"):
    _require(getattr(r, name) >= 1, f"rl.{name}={getattr(r, name)} must be >= 1")
  _require(r.sft_mix_coef >= 0, f"rl.sft_mix_coef={r.sft_mix_coef} must be >= 0 (0 = off)")
  _require(r.sft_mix_rows >= 1, f"rl.sft_mix_rows={r.sft_mix_rows} must be >= 1")
  _require(not r.sft_mix_coef or r.sft_mix_path, "rl.sft_mix_coef > 0 needs rl.sft_mix_path: the SFT "
           "trajectories, a JSONL file of chats (the main job fills it in)")
  _require(0 <= r.expert_demo_rows <= r.sft_mix_rows, f"rl.expert_demo_rows={r.expert_demo_rows} must "
           f"be in [0, rl.sft_mix_rows={r.sft_mix_rows}]: the demonstrations take SFT-mix rows")
  _require(not r.expert_demo_rows or r.sft_mix_coef > 0, "rl.expert_demo_rows > 0 needs "
           "rl.sft_mix_coef > 0: the demonstrations are trained as SFT-mix rows")
  _require(r.pack_length >= 0, f"rl.pack_length={r.pack_length} must be >= 0 (0 = one segment a row, "
           "N = segments packed into rows of N tokens)")
  _require(0 <= r.curriculum_decay < 1, f"rl.curriculum_decay={r.curriculum_decay} must be in [0, 1)")
  _require(r.prefill_rows >= 0, f"rl.prefill_rows={r.prefill_rows} must be >= 0 (0 = one mixed call)")
  _require(r.temperature > 0, f"rl.temperature={r.temperature} must be > 0")
  _require(0 < r.top_p <= 1, f"rl.top_p={r.top_p} must be in (0, 1] (1 = off)")
  _require(not r.speculative_mtp or m.mtp_depths >= 1, "rl.speculative_mtp=true drafts with the MTP "
           "head, but model.mtp_depths=0: set model.mtp_depths >= 1 or rl.speculative_mtp=false")
  _require(r.max_context >= 1, f"rl.max_context={r.max_context} must be >= 0 (0 = model.max_seq_len)")
  _require(r.max_context <= m.max_seq_len, f"rl.max_context={r.max_context} exceeds model.max_seq_len="
           f"{m.max_seq_len}: raise model.max_seq_len or lower rl.max_context")
  _require(r.summary_trigger_tokens < r.max_context, f"rl.summary_trigger_tokens="
           f"{r.summary_trigger_tokens} must be below rl.max_context={r.max_context} (0 = off)")
  e = cfg.env
  for name in ("timeout_s", "grade_timeout_s", "memory_mb", "max_procs", "max_file_mb", "max_turns",
               "workers", "max_output_chars"):
    _require(getattr(e, name) > 0, f"env.{name}={getattr(e, name)} must be positive")
  for name in ("tmp_mb", "workspace_mb", "workspace_files"):
    _require(getattr(e, name) >= 0, f"env.{name}={getattr(e, name)} must be >= 0 (0 = no bound)")
  _require(0 < e.max_fail_fraction <= 1, f"env.max_fail_fraction={e.max_fail_fraction} must be in (0, 1]")
  _require(cfg.eval.samples >= 1, f"eval.samples={cfg.eval.samples} must be >= 1")
  u = cfg.run
  for name in ("train_tasks", "heldout_tasks", "unseen_tasks", "eval_samples"):
    _require(getattr(u, name) >= 1, f"run.{name}={getattr(u, name)} must be >= 1")
  for name in ("pretrain_overrides", "sft_overrides", "anneal_overrides", "rl_overrides",
               "eval_overrides"):
    _require(all(isinstance(o, str) and "=" in o for o in getattr(u, name)),
             f"run.{name} must be a list of 'section.key=value' strings")
  _check_templates(u)
  _require(u.anneal_steps >= 0, f"run.anneal_steps={u.anneal_steps} must be >= 0 (0 = no anneal phase)")
  _require(u.rl_tasks >= 0, f"run.rl_tasks={u.rl_tasks} must be >= 0 (0 = RL on the SFT tasks)")
  _require(0.0 <= u.expert_recover <= 1.0,
           f"run.expert_recover={u.expert_recover} must be a share of the training tasks in [0, 1]")
  _require(cfg.eval.workers >= 1, f"eval.workers={cfg.eval.workers} must be >= 1")
  _require(all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in cfg.eval.k),
           f"eval.k={cfg.eval.k} must be a list of positive integers, e.g. [1, 5]")
  # The RL run's closing evaluation (rl.eval_tasks) draws eval.samples a task.
  _require(not cfg.rl.eval_tasks or not cfg.eval.k or max(cfg.eval.k) <= cfg.eval.samples,
           f"eval.k={cfg.eval.k} asks for pass@{max(cfg.eval.k or [1])} of eval.samples="
           f"{cfg.eval.samples} a task (rl.eval_tasks): raise eval.samples or drop it from eval.k")


def _check_templates(u) -> None:
  """run.train_templates / run.unseen_templates name known synthetic templates of the right split:
  a typo would otherwise fail at the tasks stage, after pretraining."""
  from composer_jax.env.synthetic import TEMPLATES
  for name, split in (("train_templates", "train"), ("unseen_templates", "heldout")):
    names = [n.strip() for n in getattr(u, name).split(",") if n.strip()]
    _require(bool(names), f"run.{name} is empty: give comma-separated templates, e.g. "
             f"{','.join(t for t, v in TEMPLATES.items() if v.split == split)}")
    for n in names:
      _require(n in TEMPLATES, f"run.{name}: unknown template {n!r}; choose from {', '.join(TEMPLATES)}")
      _require(TEMPLATES[n].split == split, f"run.{name}: {n} is a {TEMPLATES[n].split} template; "
               f"run.{name} takes {split} ones ({', '.join(t for t, v in TEMPLATES.items() if v.split == split)})")


# What a training or RL run folder holds (train/loop.py, rl/loop.py) once it has started.
RUN_FILES = ("config.yaml", "checkpoints", "metrics.jsonl", "tokenizer.json")


def check_out(out: str, flag: str = "--out", runs: bool = True) -> None:
  """An output folder: missing, empty or (``runs``) a run's own; never a file, and never a folder of
  other files that a run would write its config, tokenizer and checkpoints among (a base's, say)."""
  _require(not os.path.exists(out) or os.path.isdir(out),
           f"{flag} {out} is a file: give a directory (a new one, or a run's to continue)")
  if not runs or not os.path.isdir(out) or not os.listdir(out):
    return
  _require(not os.path.exists(os.path.join(out, "config.json")) and not os.path.isdir(
      os.path.join(out, "params")), f"{flag} {out} is a checkpoint folder (config.json or params/), "
           "not a run: choose a new --out")
  _require(any(os.path.exists(os.path.join(out, n)) for n in RUN_FILES),
           f"{flag} {out} holds files but no run (no {', '.join(RUN_FILES)}): choose a new or empty --out")

"""Configuration: one dataclass per section; loading (``config_load``) and validation (``config_check``).

Every behaviour is chosen by a field here, never by a model's name. ``load_config`` turns a YAML
file plus ``key=value`` overrides into a validated ``Config``; any problem raises ``ConfigError``
whose message is one line naming the field and the fix (the CLI prints it and exits 2, before JAX
compiles anything or any data is read).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import yaml

from composer_jax.config_load import (
  ConfigError,  # noqa: F401 (re-exported: modules import it from here)
  apply_overrides,
  build,
  read_yaml,
)

# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
  vocab_size: int = 512
  d_model: int = 64
  n_layers: int = 4
  n_dense_layers: int = 1  # leading layers with a dense MLP (HF: first_k_dense_replace)
  dense_ffn_dim: int = 160
  # Multi-head latent attention.
  n_heads: int = 4
  q_lora_rank: int = 0  # 0 = direct query projection (no low-rank query)
  kv_lora_rank: int = 32
  qk_nope_dim: int = 16
  qk_rope_dim: int = 8
  v_head_dim: int = 16
  # Mixture of experts.
  n_routed_experts: int = 8
  n_experts_per_tok: int = 2
  n_shared_experts: int = 1
  moe_ffn_dim: int = 48
  scoring: Literal["sigmoid", "softmax"] = "sigmoid"
  selection_bias: bool = True  # e_score_correction_bias: used to pick experts, not to weight them
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  seq_aux_loss_coef: float = 0.0  # optional sequence-wise balance loss (0 = off)
  bias_update_rate: float = 1e-3  # aux-loss-free balancing step size (0 = frozen bias)
  gmm_impl: Literal["auto", "xla", "sorted", "pallas", "interpret"] = "auto"
  gmm_precision: Literal["bf16", "fp8_block", "mxfp8", "nvfp4"] = "bf16"
  # Training attention (composer_jax/model/attention.py): auto = splash on TPU, Pallas/Triton on GPU,
  # blockwise (flash-style, pure JAX) elsewhere; dense = the [b, h, s, s] reference.
  attention_impl: Literal["auto", "dense", "blockwise", "splash", "pallas_gpu", "cudnn"] = "auto"
  attention_block: int = 128  # blockwise tile (splash: at least 512); s <= block = the dense product
  # Blockwise: batch rows that share one plan of which (query, key) block pairs to visit. 1 = each
  # row skips what its own segments and padding leave empty: on an RL batch of right-padded rows
  # (40 x 1280, segments of 350-1250 tokens) fwd+bwd took 1.05 s against 2.06 s with one plan for
  # the batch (docs/performance.md). Larger groups make bigger ops, for accelerators.
  attention_rows: int = 1
  # Positions.
  max_seq_len: int = 128
  rope_theta: float = 10000.0
  yarn_factor: float = 1.0  # 1 = plain RoPE
  yarn_original_max_position: int = 4096
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_mscale: float = 1.0
  yarn_mscale_all_dim: float = 0.0
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  # Multi-token prediction.
  mtp_depths: int = 0
  mtp_loss_weight: float = 0.1
  # Numerics and memory.
  param_dtype: Literal["float32", "bfloat16"] = "float32"
  compute_dtype: Literal["float32", "bfloat16"] = "float32"
  remat: Literal["none", "full", "dots", "dots_no_batch", "moe_only"] = "none"
  # The MoE layers as one stacked module run by a scan (compile time flat in depth) instead of a
  # Python loop of modules; the dense lead layers and MTP depths stay modules of their own.
  scan_layers: bool = False
  init_std: float = 0.02

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_dim + self.qk_rope_dim

  @property
  def n_moe_layers(self) -> int:
    return self.n_layers - self.n_dense_layers


@dataclass
class MeshConfig:
  # Mesh axis sizes; -1 = fill with the remaining devices (at most one axis).
  data: int = -1
  fsdp: int = 1
  expert: int = 1
  tensor: int = 1
  context: int = 1
  # Overrides of the logical-axis rule table: {logical_axis: mesh_axis | [mesh_axes] | null}.
  rules: dict = field(default_factory=dict)
  # Expert-parallel exchange: ragged/padded all-to-all, or all-gather tokens and reduce-scatter.
  ep_strategy: Literal["all_to_all", "all_gather"] = "all_to_all"
  # Multi-host: call jax.distributed.initialize() (coordinator etc. from the environment).
  distributed: bool = False


@dataclass
class DataConfig:
  seq_len: int = 128
  batch_size: int = 8  # global sequences per optimizer step
  # Sources: "stdlib" / "site-packages" (Python source on this machine), "repeats" / "code_repeats"
  # (generated copy data, data/repeats.py), or paths to .txt / .jsonl files or dirs.
  sources: list = field(default_factory=lambda: ["stdlib"])
  weights: list = field(default_factory=list)  # mixture weights, one per source (empty = equal)
  text_field: str = "text"
  heldout_fraction: float = 0.02
  max_files: int = 4000  # cap on files read from each directory source
  tokenizer: str = "train"  # "train" = BPE trained on the corpus; or a tokenizer.json / tiktoken path
  tokenizer_vocab_size: int = 0  # 0 = model.vocab_size
  tokenizer_train_mb: float = 8.0  # corpus text (MiB) the trained BPE learns from
  sft_path: str = ""  # JSONL chat trajectories for SFT
  # Share of SFT chats that are generated edit drills (data/drills.py: copy a file name, a viewed
  # line and a requested line into calls); the rest are data.sft_path's. 0 = none.
  sft_copy_share: float = 0.0
  # Share of SFT chats that are spec drills (data/drills.py: the expert's edits for fresh training-split
  # synthetic instances at data.sft_spec_levels, no test run). 0 = none.
  sft_spec_share: float = 0.0
  # The synthetic difficulty levels the spec drills are drawn at (each template's levels among these
  # in turn).
  sft_spec_levels: list = field(default_factory=lambda: [2, 3])
  # Share of SFT chats that are word drills (data/drills.py: one function whose docstring states an
  # operator chain or a comparison in words, implemented or fixed in one edit). 0 = none.
  sft_word_share: float = 0.0
  num_workers: int = 0
  seed: int = 0


@dataclass
class OptimConfig:
  name: Literal["adamw", "muon"] = "adamw"
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  schedule: Literal["constant", "cosine", "wsd"] = "cosine"
  warmup_steps: int = 10
  decay_fraction: float = 0.2  # WSD: fraction of steps spent decaying
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  muon_momentum: float = 0.95
  muon_ns_steps: int = 5
  qk_clip: float = 0.0  # MuonClip threshold on max attention logit (0 = off)
  # Mixed precision: a float32 master copy + float32 optimizer state for narrower (bf16) params;
  # "none" updates params (and keeps moments) in their own dtype. See train/optim.py.
  master_dtype: Literal["float32", "none"] = "float32"


@dataclass
class TrainConfig:
  steps: int = 50
  seed: int = 0
  grad_accum: int = 1
  z_loss: float = 0.0
  # Positions per chunk of the training loss's head + next-token CE (model/loss.py,
  # chunked_head_ce): the [batch, seq, vocab] logits are never made whole. 0 = whole logits.
  loss_chunk: int = 64
  log_every: int = 1
  eval_every: int = 0  # 0 = only at the end
  eval_batches: int = 4
  progress: bool = True


@dataclass
class CheckpointConfig:
  every: int = 0  # 0 = only at the end
  keep: int = 3
  async_save: bool = True


@dataclass
class RLConfig:
  # Loop shape: each step samples `tasks_per_step` tasks x `group_size` rollouts, then updates.
  steps: int = 20
  tasks_per_step: int = 4
  group_size: int = 4
  minibatches: int = 1  # optimizer updates per rollout batch (PPO-style; 1 = on-policy)
  # Passes over each step's rollouts (PPO epochs), each split into `minibatches` updates: a step's
  # rollouts cost ~10x its update on the tiny config, so passes are cheap learning per sample.
  epochs: int = 1
  # Learner rows: 0 = one segment a row, a fixed row count (tasks_per_step x group_size), padded to
  # the longest segment's length bucket; N > 0 = segments packed first-fit into rows of
  # max(N, that bucket) tokens (segment ids keep them apart), a power-of-two row count. Packing
  # does less work a step but compiles a shape per new row count (experiments/rl_learner_rows.py).
  pack_length: int = 0
  # PPO-ptx (InstructGPT): each update also minimises sft_mix_coef x the mean cross-entropy of the
  # assistant tokens of sft_mix_rows chats drawn from sft_mix_path (the SFT trajectories; the main
  # job fills the path in), so what the RL batch does not exercise is not forgotten (0 = off).
  sft_mix_coef: float = 0.0
  sft_mix_path: str = ""
  sft_mix_rows: int = 4
  # Of those rows, up to expert_demo_rows are the scripted expert's runs of this run's RL tasks
  # (rl/demos.py, as ReLIFT): of tasks whose group resolved nothing ("unsolved"), or of every task
  # drawn ("all", the control). 0 = off; needs sft_mix_coef > 0.
  expert_demo_rows: int = 0
  expert_demo_on: Literal["unsolved", "all"] = "unsolved"
  seed: int = 0
  tasks: str = ""  # folder of training task directories (`tasks generate --synthetic ... --out`)
  eval_tasks: str = ""  # held-out task folder, evaluated at the end ("" = none)
  async_: bool = True  # YAML/override key `rl.async`: Ray rollout workers (rl/async_loop.py); false = sync loop
  max_staleness: int = 1  # versions a trajectory may lag the learner when trained on (older: re-sampled)
  num_workers: int = 1  # Ray rollout actors (1 CPU each)
  # true: a worker plays every unit it holds in one decode batch (units of one group; a unit's
  # episodes take the slots the earlier units' stragglers free). false: one unit of decode_batch
  # episodes at a time, the batch draining at each unit's end, but a unit's episodes all start on the
  # weights of its start. On 2 cores true dropped about twice the stale groups for no speed
  # (docs/rl.md, "Work and queue").
  worker_stream: bool = False
  ray_address: str = ""  # "" = start Ray locally; else join this cluster (e.g. "auto", "ray://h:10001")
  # Local Ray only: object store size in MiB, its pages faulted in at start (0 = Ray's default size,
  # pages faulted in by the puts themselves: a 64 MiB weight put then costs ~4-8 memcpys, not ~1.7).
  object_store_mb: int = 0
  # Local Ray only: the last N cores for the rollout workers and their sandboxes, the rest for the
  # learner, each pinned there (rl/cpus.py); 0 = no pinning (on 2 cores no gain: docs/rl.md).
  worker_cpus: int = 0
  # The rollout workers' scheduling priority on cores they share with the learner (rl/cpus.py; their
  # sandboxes inherit it): normal = the learner's; low = nice 19; idle = SCHED_IDLE, run only on a
  # core nothing else wants, and preempted at once when a learner thread wakes (docs/rl.md).
  worker_priority: Literal["normal", "low", "idle"] = "normal"
  # Each sampler's devices (rl/worker_devices.py): 0 = one CPU device; N = N of worker_platform, Ray
  # reserving them per worker; worker_mesh: axis sizes over them ({} = all on tensor), e.g. {expert: 8}.
  worker_devices: int = 0
  worker_platform: Literal["cpu", "gpu", "tpu"] = "cpu"
  worker_mesh: dict = field(default_factory=dict)
  # XLA_FLAGS of the rollout actors only (the learner keeps its own), e.g.
  # "--xla_cpu_multi_thread_eigen=false": CPU workers sharing the learner's cores (docs/rl.md).
  worker_xla_flags: str = ""
  # Processes (hosts) of one rollout worker, each with worker_devices devices: a gang joined by
  # jax.distributed, one sampler mesh over all of them (worker_mesh spans hosts x devices); member 0
  # plays the episodes, the others replay its model calls (rl/rollout_worker.py). Needs rl.async=true.
  worker_hosts: int = 1
  # The learner job's own sampler (sync rollouts, evaluations): leader = process 0's devices, as a
  # worker's; mesh = the trainer's mesh over every process, for a policy larger than one host.
  learner_sampler: Literal["leader", "mesh"] = "leader"
  weight_delta: bool = True  # broadcast XOR deltas between full copies (rl/weights.py)
  full_sync_every: int = 10  # a full weight copy every N versions
  # Where the broadcast is put from: leader = process 0, the policy gathered onto it a tensor at a
  # time; shards = every learner process its own shards, nothing gathered (a policy larger than one
  # host; rl/learner_group.py). Needs rl.async=true.
  broadcast_from: Literal["leader", "shards"] = "leader"
  # Sampling.
  max_new_tokens: int = 256  # per assistant turn
  max_context: int = 0  # cache length of one segment (prompt + turns); 0 = model.max_seq_len
  decode_batch: int = 8  # slots served by one decode batch (continuous batching)
  # Rows per prefill call: turns being read go in calls of this many rows, apart from the decode
  # call, so a decoding row is not padded to the prefill width (rl/engine.py). 0 = one mixed call.
  prefill_rows: int = 1
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0 = whole vocabulary
  speculative_mtp: bool = False  # draft with the MTP head, verify with the main model
  # Policy-gradient loss.
  ppo_clip_low: float = 0.2
  ppo_clip_high: float = 0.28
  is_clip: float = 2.0  # truncated importance weight cap between sampler and trainer
  is_level: Literal["token", "sequence"] = "token"
  is_mode: Literal["truncate", "mask"] = "truncate"  # mask = zero tokens outside [1/is_clip, is_clip]
  kl_coef: float = 0.0  # KL to the reference (initial) policy; 0 = off
  # loss -= entropy_coef x token entropy (verl's entropy_coeff): > 0 explores, < 0 sharpens (RENT)
  entropy_coef: float = 0.0
  loss_agg: Literal["token_mean", "seq_sum"] = "token_mean"
  adv_std_norm: bool = False  # divide group advantages by the group's std
  # Weight on negative advantages (1 = GRPO; 0 = reinforce only the episodes above their group's
  # mean, as RAFT / ReST; rl/advantages.py).
  adv_negative_weight: float = 1.0
  # DAPO dynamic sampling: train on informative groups; draw up to `dynamic_max_rounds`
  # x tasks_per_step groups a step to find tasks_per_step of them (none found: no update).
  dynamic_sampling: bool = False
  dynamic_max_rounds: int = 3
  # What makes a group informative: "outcome" = some episodes resolved the task and some did not
  # (DAPO's accuracy filter); "grade" = any two grades differ (outcomes, or partial credit);
  # "reward" = any two rewards differ (shaping penalties count).
  dynamic_by: Literal["outcome", "grade", "reward"] = "outcome"
  # Which tasks to draw (rl/curriculum.py): "none" = a seeded permutation; "family" = a family
  # (template and level) with probability ~ the chance its next group has both outcomes, from its
  # recent groups (each decayed by curriculum_decay per later group of the family).
  curriculum: Literal["none", "family"] = "none"
  curriculum_decay: float = 0.8
  router_replay: bool = True
  # Self-summarization: at this many tokens in a segment the model is asked to summarise (0 = off).
  summary_trigger_tokens: int = 0
  max_summaries: int = 3
  # Concave length penalty C(x) = ((1 + k x)^(1-q) - 1) / (k (1 - q)) on a weighted token/call count.
  length_penalty: float = 0.0  # coefficient (0 = off); reward -= coef * difficulty * C(x) / C(x_ref)
  length_k: float = 0.01
  length_q: float = 0.5
  length_ref: float = 1000.0  # x at which the (unscaled) penalty equals the coefficient
  length_by_difficulty: bool = True  # scale by the group's pass rate (easy tasks pay more)
  length_w_reasoning: float = 1.0
  length_w_tool_call: float = 1.0
  length_w_tool_output: float = 0.1
  length_w_final: float = 1.0
  length_w_calls: float = 10.0
  length_w_turns: float = 10.0
  # Behaviour shaping penalties (subtracted from the reward).
  penalty_malformed_call: float = 0.05
  penalty_unknown_tool: float = 0.05
  penalty_repeated_command: float = 0.02
  penalty_no_call_turn: float = 0.05
  # Cap on (length + shaping) penalty per episode; < 1 keeps every resolved episode (grade 1) above
  # every unresolved one (grade 0), so effort is only traded off among equal outcomes.
  penalty_cap: float = 0.5
  # Partial credit: an unresolved episode's grade is this x the right share of the task's hidden
  # checks (rewards.grade_value; 0 = off: grades are 0/1). At most 1 - penalty_cap, so a resolved
  # episode outscores every unresolved one.
  partial_credit: float = 0.0
  # Targeted textual feedback (Composer 2.5).
  feedback_kl_coef: float = 0.0  # 0 = off
  feedback_topk: int = 0  # teacher distribution: 0 = full vocabulary, else top-k plus a tail bucket
  feedback_teacher: Literal["current", "frozen"] = "current"
  max_hints: int = 2  # per trajectory


@dataclass
class EnvConfig:
  sandbox: Literal["auto", "required", "off"] = "auto"
  timeout_s: float = 30.0
  memory_mb: int = 4096
  max_procs: int = 256
  max_file_mb: int = 256
  max_output_chars: int = 8000
  tmp_mb: int = 512  # each call's private /tmp (host memory)
  # What a call may add to the workspace (and binds) over its size at the episode's start: past
  # either bound it is stopped, and an episode ends flagged `quota` (a hack: reward 0). 0 = no bound.
  workspace_mb: int = 1024
  workspace_files: int = 50000
  max_turns: int = 30
  grade_timeout_s: float = 300.0  # one full test run at grading / task validation
  workers: int = 2  # parallel sandboxed test runs (task generation, eval episodes)
  cache_dir: str = ""  # sdist cache for `tasks generate --package` ("" = ~/.cache/composer_jax/sdists)
  max_fail_fraction: float = 0.5  # drop deletions that fail more of the tests (an import break)
  verbose_prompt: bool = False  # episodes get the verbose problem statement instead of the terse one
  # The system prompt's tool list: full, one line per tool (brief), or one line in all (signatures).
  tool_docs: Literal["full", "brief", "signatures"] = "full"


@dataclass
class EvalConfig:
  samples: int = 1
  k: list = field(default_factory=lambda: [1])
  workers: int = 2  # episodes run in parallel


@dataclass
class RunConfig:
  """The main job (`composer-jax run`): task sets and each stage's overrides of this config."""
  train_tasks: int = 200
  heldout_tasks: int = 40  # unseen instances of the training templates (the RL target)
  unseen_tasks: int = 20  # templates that no stage trains on (reported in their own row)
  # RL's own tasks: fresh instances of the training templates, none of them an SFT task. On the
  # SFT tasks the policy recalls memorised solutions, and RL's reward then pays for recall, not for
  # skills that carry to held-out tasks (docs/rl_tiny.md, stop 27). 0: RL reuses the SFT tasks.
  rl_tasks: int = 200
  # A share of the training tasks whose expert run is a recovery run instead of a sound one
  # (env/expert.py): a flawed edit (not trained on), the failing tests, the fix. SFT learns to act
  # on a failing test run and not to submit regardless.
  expert_recover: float = 0.0
  # How a recovery run repairs its flaw: "fix" edits the flawed lines into the reference; "review"
  # views the flawed file again, then fixes it; "redo" undoes the flawed file's edits and repeats its
  # sound edits (the first try's calls, done right).
  expert_recover_by: Literal["fix", "review", "redo"] = "fix"
  task_seed: int = 1
  # A base model the pretraining stage continues from (an HF folder, a `convert --from-hf` folder
  # or a training run; its tokenizer.json when it has one), as Composer continues from Kimi K2.
  # Empty: random init and a tokenizer trained on the corpus.
  base: str = ""
  train_templates: str = "implement,fix_bug,method,two_file"
  unseen_templates: str = "rename,fix_method"
  eval_samples: int = 4  # samples per held-out task (pass@1 and pass@k)
  pretrain_overrides: list = field(default_factory=list)
  sft_overrides: list = field(default_factory=list)
  # A second SFT phase (stage "anneal", DIR/anneal) after the mixed SFT stage: this many steps on
  # the expert chats alone (no drills), with the SFT stage's config plus ``anneal_overrides``. It is
  # the SFT policy that evaluation and RL start from. 0: none (the SFT stage's policy is used).
  anneal_steps: int = 0
  anneal_overrides: list = field(default_factory=list)
  rl_overrides: list = field(default_factory=list)
  eval_overrides: list = field(default_factory=list)


@dataclass
class Config:
  model: ModelConfig = field(default_factory=ModelConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  data: DataConfig = field(default_factory=DataConfig)
  optim: OptimConfig = field(default_factory=OptimConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
  rl: RLConfig = field(default_factory=RLConfig)
  env: EnvConfig = field(default_factory=EnvConfig)
  eval: EvalConfig = field(default_factory=EvalConfig)
  run: RunConfig = field(default_factory=RunConfig)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def from_dict(data: dict) -> Config:
  cfg = build(Config, data)
  if cfg.rl.max_context == 0:
    cfg.rl.max_context = cfg.model.max_seq_len
  validate(cfg)
  return cfg


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
  data = read_yaml(path) if path else {}
  return from_dict(apply_overrides(data, list(overrides)))


def dump_config(cfg: Config, path: str) -> None:
  with open(path, "w") as f:
    yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)


def validate(cfg: Config) -> None:
  """The checks of ``composer_jax.config_check`` (imported here: that module imports this one's classes)."""
  from composer_jax.config_check import validate as check
  check(cfg)

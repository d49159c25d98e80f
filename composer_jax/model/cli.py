"""``composer-jax params``: parameter counts (and, with --sharding, the per-device plan)."""

from __future__ import annotations

import json


def register(sub) -> None:
  p = sub.add_parser("params", help="count parameters with eval_shape (nothing is allocated)")
  p.add_argument("config", help="YAML config, e.g. configs/kimi-k2.yaml")
  p.add_argument("overrides", nargs="*", help="section.key=value overrides")
  p.add_argument("--json", action="store_true", help="print {'total': int, 'active': int, ...}")
  p.add_argument("--sharding", action="store_true",
                 help="also print each parameter's partition spec and bytes per device")
  p.add_argument("--devices", type=int, default=0,
                 help="plan for this many devices (default: the mesh's fixed size or visible devices)")
  p.add_argument("--seq-len", type=int, default=0,
                 help="with --sharding: plan one training step at this length (default data.seq_len)")
  p.add_argument("--batch", type=int, default=0,
                 help="with --sharding: sequences per batch shard per micro-step (default "
                      "data.batch_size / train.grad_accum / batch shards)")
  p.add_argument("--budget-gb", type=float, default=95.0,
                 help="with --sharding: per-device memory budget in GB (1e9 bytes) for FITS / DOES NOT FIT")
  p.add_argument("--search", action="store_true",
                 help="with --sharding and --devices: plan every expert x context x tensor mesh "
                      "(fsdp fills) and list the best, fitting ones first")
  p.set_defaults(func=run)


def run(args) -> int:
  from composer_jax.config import ConfigError, load_config
  cfg = load_config(args.config, args.overrides)
  if args.sharding:
    from composer_jax.train.plan import format_plan, format_step, memory_plan
    for flag in ("devices", "seq_len", "batch"):
      if getattr(args, flag) < 0:
        raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be positive")
    if args.budget_gb <= 0:
      raise ConfigError(f"--budget-gb={args.budget_gb} must be positive")
    if args.search:
      if not args.devices:
        raise ConfigError("--search needs --devices N (the device count to lay out)")
      from composer_jax.train.plan import format_search, search_layouts
      rows = search_layouts(cfg, args.devices, args.seq_len or None, args.batch or None,
                            args.budget_gb)
      print(json.dumps(rows) if args.json else format_search(rows, args.budget_gb))
      return 0
    plan = memory_plan(cfg, n_devices=args.devices or None, seq_len=args.seq_len or None,
                       batch=args.batch or None, budget_gb=args.budget_gb)
    from composer_jax.model import count_params
    counts = count_params(cfg)
    if args.json:
      print(json.dumps({**counts, "sharding": plan}))
    else:
      print_counts(counts)
      print(format_plan(plan))
      print(format_step(plan))
    return 0
  from composer_jax.model import count_params
  counts = count_params(cfg)
  if args.json:
    print(json.dumps(counts))
  else:
    print_counts(counts)
  return 0


def print_counts(counts: dict) -> None:
  print(f"total parameters:        {counts['total']:,}")
  print(f"active per token:        {counts['active']:,}")
  print(f"active w/o embedding:    {counts['active_non_embedding']:,}")

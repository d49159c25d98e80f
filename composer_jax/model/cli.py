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
  p.set_defaults(func=run)


def run(args) -> int:
  from composer_jax.config import load_config
  cfg = load_config(args.config, args.overrides)
  from composer_jax.model import count_params
  counts = count_params(cfg)
  if args.sharding:
    from composer_jax.train.plan import sharding_plan
    plan = sharding_plan(cfg, n_devices=args.devices or None)
    if args.json:
      print(json.dumps({**counts, "sharding": plan}))
    else:
      print_counts(counts)
      from composer_jax.train.plan import format_plan
      print(format_plan(plan))
    return 0
  if args.json:
    print(json.dumps(counts))
  else:
    print_counts(counts)
  return 0


def print_counts(counts: dict) -> None:
  print(f"total parameters:        {counts['total']:,}")
  print(f"active per token:        {counts['active']:,}")
  print(f"active w/o embedding:    {counts['active_non_embedding']:,}")

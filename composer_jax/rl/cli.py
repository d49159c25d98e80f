"""``composer-jax rl CONFIG --out DIR [--init RUN_DIR] [--resume] [key=value ...]``.

Asynchronous RL by default (``rl.async=true``: Ray rollout workers, composer_jax.rl.async_loop);
``rl.async=false`` runs the synchronous loop: rollouts of the current policy on ``rl.tasks`` through
the sandboxed tools, then one learner update. Metrics, plots and checkpoints in DIR. Bad input (missing
tasks, no tokenizer to start from, no working sandbox) stops with one line before anything compiles.
"""

from __future__ import annotations

import os

from composer_jax.config import ConfigError


def register(sub) -> None:
  p = sub.add_parser("rl", help="agentic RL on coding tasks (policy gradient, router replay, feedback)")
  p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
  p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. rl.steps=5")
  p.add_argument("--out", required=True, help="run directory (config, metrics, rollouts, checkpoints)")
  p.add_argument("--init", default=None, help="start from this sft/pretrain run (weights, tokenizer)")
  p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
  p.set_defaults(func=run)


def run(args) -> int:
  from composer_jax.config import load_config
  from composer_jax.config_check import check_out
  cfg = load_config(args.config, args.overrides)
  check_out(args.out)
  ck = os.path.join(args.out, "checkpoints")
  if not args.resume and os.path.isdir(ck) and any(n.isdigit() for n in os.listdir(ck)):
    raise ConfigError(f"--out {args.out} already holds checkpoints: pass --resume to continue, "
                      "or choose a new --out")
  if not args.resume and not args.init:
    raise ConfigError("rl starts from a trained policy: pass --init RUN_DIR (an sft or pretrain run)")
  if args.init:
    from composer_jax.train.init import check_run_init_model
    check_run_init_model(args.init, cfg.model)
  from composer_jax.rl.loop import load_task_set
  load_task_set(cfg.rl.tasks, "rl.tasks")  # a bad folder fails here, before anything compiles
  from composer_jax.rl import preflight
  preflight.check(cfg)  # the workers' Ray: a cluster that answers, a store that fits, cores to pin
  from composer_jax.rl.loop import run_rl
  run_rl(cfg, args.out, init=args.init, resume=args.resume)
  return 0

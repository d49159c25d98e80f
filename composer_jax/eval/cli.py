"""``composer-jax eval --tasks DIR --policy oracle|null|CHECKPOINT --samples N --out DIR``."""

from __future__ import annotations

import json
import os

from composer_jax.config import ConfigError, load_config


def register(subparsers) -> None:
  p = subparsers.add_parser("eval", help="run a policy on a task set; pass@k, tokens, a plot")
  p.add_argument("--tasks", required=True, help="folder of task directories (tasks generate --out)")
  p.add_argument("--policy", required=True, help="oracle | null | a run directory (model policy)")
  p.add_argument("--samples", type=int, default=None, help="samples per task (default eval.samples)")
  p.add_argument("--out", required=True, help="output folder: summary.json, trajectories, PNG")
  p.add_argument("--limit", type=int, default=None, help="only the first N tasks")
  p.add_argument("--config", default=None)
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.set_defaults(func=_eval)


def _eval(args) -> int:
  from composer_jax.env.sandbox import Limits
  from composer_jax.env.tasks import TaskError, load_tasks
  from composer_jax.eval.harness import (
    SCRIPTED,
    PolicyError,
    make_policy_factory,
    run_eval,
  )
  from composer_jax.config_check import check_out
  cfg = load_config(args.config, args.overrides)
  check_out(args.out, runs=False)  # a folder of its own files: only a file in the way is refused
  samples = cfg.eval.samples if args.samples is None else args.samples
  if samples < 1:
    raise ConfigError(f"--samples {samples} must be >= 1")
  if cfg.eval.k and max(cfg.eval.k) > samples:  # else pass@k is silently left out of the summary
    raise ConfigError(f"eval.k={cfg.eval.k} asks for pass@{max(cfg.eval.k)} of {samples} sample(s) a "
                      f"task: pass --samples {max(cfg.eval.k)} (or eval.samples) or drop it from eval.k")
  try:
    tasks = load_tasks(args.tasks)
  except TaskError as e:
    raise ConfigError(str(e)) from None
  if args.limit:
    tasks = tasks[:args.limit]
  if args.policy not in SCRIPTED:  # a model: the run directory's config, tokenizer and weights
    from composer_jax.rl.loop import eval_run_dir
    if not os.path.isdir(args.policy):
      raise ConfigError(f"--policy {args.policy!r}: give oracle, null or a run directory")
    from composer_jax.parallel.mesh import maybe_initialize_distributed
    maybe_initialize_distributed(cfg.mesh)  # rl.learner_sampler=mesh on several processes
    summary = eval_run_dir(args.policy, tasks, samples, args.out, args.overrides)
    if summary:  # {} on the processes that only replayed process 0's engine
      print(json.dumps({k: v for k, v in summary.items() if k != "per_task"}, indent=1))
    return 0
  try:
    factory = make_policy_factory(args.policy)
  except PolicyError as e:
    raise ConfigError(str(e)) from None
  e = cfg.env
  limits = Limits.from_config(e)
  os.makedirs(args.out, exist_ok=True)
  summary = run_eval(tasks, factory, samples, args.out, ks=cfg.eval.k, limits=limits,
                     mode=e.sandbox, max_turns=e.max_turns, workers=cfg.eval.workers,
                     verbose_prompt=e.verbose_prompt)
  print(json.dumps({k: v for k, v in summary.items() if k != "per_task"}, indent=1))
  return 0

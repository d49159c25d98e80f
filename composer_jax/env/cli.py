"""``composer-jax sandbox exec`` and ``composer-jax tasks generate | setup | grade``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from composer_jax.config import ConfigError, load_config
from composer_jax.env.expert import RECOVER_BY


def _common(p: argparse.ArgumentParser, positional: bool = True) -> None:
  p.add_argument("--config", default=None, help="YAML config (env section)")
  p.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="same as a positional override (kept for old scripts)")
  if positional:  # `sandbox exec` takes its overrides before `--` (its command is a REMAINDER)
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="override a config field, e.g. env.sandbox=required")


def register(subparsers) -> None:
  sb = subparsers.add_parser("sandbox", help="run commands the way the agent's terminal tool does")
  sbsub = sb.add_subparsers(dest="sandbox_command", required=True)
  ex = sbsub.add_parser("exec", help="run one command in the sandbox: "
                        "exec --workspace DIR [section.key=value ...] -- CMD ...")
  ex.add_argument("--workspace", required=True, help="directory bound read-write as the workspace")
  ex.add_argument("--timeout", type=float, default=None, help="seconds (default env.timeout_s)")
  _common(ex, positional=False)
  ex.add_argument("cmd", nargs=argparse.REMAINDER,
                  help="overrides (section.key=value), then -- and the command and its arguments")
  ex.set_defaults(func=_sandbox_exec)

  tasks = subparsers.add_parser("tasks", help="generate, set up and grade coding tasks")
  tsub = tasks.add_subparsers(dest="tasks_command", required=True)
  gen = tsub.add_parser("generate", help="feature-deletion tasks from a package's sdist or a repo")
  src = gen.add_mutually_exclusive_group(required=True)
  src.add_argument("--package", action="append", help="PyPI name (sdist with tests); repeatable")
  src.add_argument("--repo", help="a local repository with a test suite")
  src.add_argument("--synthetic", type=int, metavar="N",
                   help="N procedurally generated tiny tasks (composer_jax/env/synthetic/)")
  gen.add_argument("--out", required=True, help="folder for the task directories and reports")
  gen.add_argument("--max", type=int, default=50, help="tasks to keep per package (default 50)")
  gen.add_argument("--max-tries", type=int, default=None, help="cap on candidates tried per package")
  gen.add_argument("--seed", type=int, default=0)
  gen.add_argument("--split", default="train", choices=["train", "heldout", "all"],
                   help="with --synthetic: held-out templates and instances, or both")
  gen.add_argument("--templates", default=None,
                   help="with --synthetic: comma-separated template names (default: all of the split)")
  gen.add_argument("--levels", default=None,
                   help="with --synthetic: comma-separated difficulty levels, e.g. 1,2 (default: all)")
  _common(gen)
  gen.set_defaults(func=_tasks_generate)

  setup = tsub.add_parser("setup", help="auto-install: propose, run and verify a set-up recipe")
  setup.add_argument("--repo", required=True)
  _common(setup)
  setup.set_defaults(func=_tasks_setup)

  gr = tsub.add_parser("grade", help="grade a workspace against a task (fresh sandbox, hidden tests)")
  gr.add_argument("--task", required=True, help="a task directory (holds task.json)")
  gr.add_argument("--workspace", required=True, help="the workspace to grade")
  _common(gr)
  gr.set_defaults(func=_tasks_grade)

  exp = tsub.add_parser("expert", help="scripted-expert SFT trajectories for synthetic tasks")
  exp.add_argument("--tasks", required=True, help="a folder written by `tasks generate --synthetic`")
  exp.add_argument("--out", required=True, help="JSONL file of {\"messages\": [...]} trajectories")
  exp.add_argument("--tokenizer", default=None, help="tokenizer.json: report exact token counts")
  exp.add_argument("--no-run-tests", action="store_true", help="skip the expert's test-run turn")
  exp.add_argument("--flawed", type=int, default=0,
                   help="also write N failing runs per task with one edit made wrong (marked "
                        "\"flawed\": true): SFT data that leaves RL something to fix")
  exp.add_argument("--recover", type=float, default=0.0,
                   help="for this share of the tasks, write instead of the sound run one that fixes a "
                        "flawed edit after its failing test run (marked \"recovered\": true; the "
                        "flawed turn untrained)")
  exp.add_argument("--recover-by", choices=RECOVER_BY, default="fix",
                   help="a recovery run's repair: edit the flawed lines (fix), view the flawed file "
                        "again and then edit them (review), or undo the flawed file's edits and "
                        "make its sound edits again (redo)")
  exp.add_argument("--seed", type=int, default=0, help="draws the flaws")
  _common(exp)
  exp.set_defaults(func=_tasks_expert)


def _env_cfg(args):
  return load_config(args.config, [*args.set_overrides, *getattr(args, "overrides", [])]).env


def _split_overrides(cmd: list[str]) -> tuple[list[str], list[str]]:
  """``a.b=1 c.d=2 -- CMD ...`` -> (overrides, command); without ``--``, leading ``a.b=...`` words."""
  if "--" in cmd:
    i = cmd.index("--")
    return cmd[:i], cmd[i + 1:]
  n = 0
  while n < len(cmd) and "=" in cmd[n] and "." in cmd[n].split("=", 1)[0]:
    n += 1
  return cmd[:n], cmd[n:]


def _limits(env, timeout=None):
  from composer_jax.env.sandbox import Limits
  limits = Limits.from_config(env)
  return limits if timeout is None else dataclasses.replace(limits, timeout_s=float(timeout))


def _sandbox_exec(args) -> int:
  from composer_jax.env.sandbox import Sandbox, SandboxError
  args.overrides, cmd = _split_overrides(list(args.cmd))
  if not cmd:
    raise ConfigError("sandbox exec: no command given; write it after --, e.g. -- python -V")
  if not os.path.isdir(args.workspace):
    raise ConfigError(f"--workspace {args.workspace!r} is not a directory: pass an existing folder")
  if args.timeout is not None and args.timeout <= 0:
    raise ConfigError(f"--timeout {args.timeout} must be positive")
  env = _env_cfg(args)
  try:
    sb = Sandbox(args.workspace, _limits(env, args.timeout), mode=env.sandbox)
  except SandboxError as e:
    raise ConfigError(str(e)) from None
  r = sb.run(cmd if len(cmd) > 1 else cmd[0])
  sys.stdout.write(r.output if r.output.endswith("\n") or not r.output else r.output + "\n")
  note = "timed out, " if r.timed_out else ""
  print(f"[exit code {r.exit_code}; {note}{r.seconds:.2f} s; "
        f"{'bubblewrap' if r.sandboxed else 'rlimits only'}]", file=sys.stderr)
  return r.exit_code if 0 <= r.exit_code < 256 else 1


def _tasks_generate(args) -> int:
  from composer_jax.config_check import check_out
  check_out(args.out, runs=False)  # a folder of task directories: only a file in the way is refused
  if args.synthetic is not None:
    return _tasks_generate_synthetic(args)
  from composer_jax.env.generate import (
    DEFAULT_CACHE,
    SourceError,
    fetch_sdist,
    generate,
  )
  if args.max < 1:
    raise ConfigError(f"--max {args.max} must be >= 1")
  if args.repo and not os.path.isdir(args.repo):
    raise ConfigError(f"--repo {args.repo!r} is not a directory: pass a repository folder")
  env = _env_cfg(args)
  limits = _limits(env, env.grade_timeout_s)
  os.makedirs(args.out, exist_ok=True)
  sources = []
  try:
    if args.repo:
      sources.append((args.repo, None, {"kind": "local", "path": os.path.abspath(args.repo)}))
    for pkg in args.package or []:
      root = fetch_sdist(pkg, env.cache_dir or DEFAULT_CACHE)
      sources.append((root, pkg.split("==")[0], {"kind": "sdist", "package": pkg,
                                                  "path": os.path.basename(root)}))
  except SourceError as e:
    raise ConfigError(str(e)) from None
  reports = []
  for root, name, source in sources:
    try:
      rep = generate(root, args.out, name=name, source=source, max_tasks=args.max,
                     max_tries=args.max_tries, limits=limits, mode=env.sandbox, workers=env.workers,
                     seed=args.seed, max_fail_fraction=env.max_fail_fraction,
                     task_limits={"timeout_s": env.timeout_s, "max_turns": env.max_turns,
                                  "grade_timeout_s": env.grade_timeout_s})
    except SourceError as e:
      print(f"composer-jax: {e}", file=sys.stderr)
      continue
    reports.append({k: v for k, v in rep.items() if k not in ("tasks", "recipe")})
  print(json.dumps(reports, indent=1))
  total = sum(r["kept"] for r in reports)
  print(f"{total} tasks from {sum(r['kept'] > 0 for r in reports)} source(s) in {args.out}")
  return 0 if total else 1


def _tasks_generate_synthetic(args) -> int:
  from composer_jax.env import synthetic
  env = _env_cfg(args)
  try:
    rep = synthetic.generate(args.synthetic, args.seed, args.out, split=args.split,
                             templates=args.templates, levels=args.levels,
                             limits={"timeout_s": min(env.timeout_s, 10.0), "max_turns": 8,
                                     "grade_timeout_s": min(env.grade_timeout_s, 10.0)})
  except synthetic.SyntheticError as e:
    raise ConfigError(str(e)) from None
  print(json.dumps({k: v for k, v in rep.items() if k != "instance_ids"}, indent=1))
  print(f"{rep['n']} synthetic tasks in {args.out}")
  return 0


def _tasks_expert(args) -> int:
  from composer_jax.env.expert import expert_trajectories
  from composer_jax.env.tasks import TaskError, load_tasks
  env = _env_cfg(args)
  try:
    tasks = load_tasks(args.tasks)
  except TaskError as e:
    raise ConfigError(str(e)) from None
  tok = None
  if args.tokenizer:
    from composer_jax.data.tokenizer import load_tokenizer
    tok = load_tokenizer(args.tokenizer)
  if args.flawed < 0:
    raise ConfigError(f"--flawed {args.flawed}: give a count >= 0 of flawed runs per task")
  if not 0.0 <= args.recover <= 1.0:
    raise ConfigError(f"--recover {args.recover}: give a share of the tasks in [0, 1]")
  rep = expert_trajectories(tasks, args.out, tokenizer=tok, run_tests=not args.no_run_tests,
                            tool_docs=env.tool_docs, mode=env.sandbox, flawed=args.flawed,
                            recover=args.recover, recover_by=args.recover_by, seed=args.seed,
                            log=lambda m: print(m, file=sys.stderr))
  stats = args.out + ".stats.json"
  with open(stats, "w") as f:
    json.dump(rep, f, indent=1)
  print(json.dumps({k: v for k, v in rep.items() if k != "trajectories"}, indent=1))
  extra = f" and {rep['flawed']} flawed (failing) ones" if args.flawed else ""
  extra += f" and {rep['recovered']} recovery runs" if args.recover else ""
  print(f"{rep['kept']}/{rep['tasks']} trajectories graded 1.0{extra} -> {args.out} (per-trajectory "
        f"stats: {stats})")
  return 0 if rep["kept"] else 1


def _tasks_setup(args) -> int:
  from composer_jax.env.autoinstall import SetupError, auto_install
  if not os.path.isdir(args.repo):
    raise ConfigError(f"--repo {args.repo!r} is not a directory: pass a repository folder")
  env = _env_cfg(args)
  try:
    recipe, _ = auto_install(args.repo, _limits(env, env.grade_timeout_s), env.sandbox)
  except SetupError as e:
    print(f"set-up failed: {e}", file=sys.stderr)
    return 1
  print(json.dumps(recipe.to_json(), indent=1))
  return 0


def _tasks_grade(args) -> int:
  from composer_jax.env.grading import grade
  from composer_jax.env.tasks import TaskError, load_task
  if not os.path.isdir(args.workspace):
    raise ConfigError(f"--workspace {args.workspace!r} is not a directory")
  try:
    task = load_task(args.task)
  except TaskError as e:
    raise ConfigError(str(e)) from None
  env = _env_cfg(args)
  r = grade(task, args.workspace, _limits(env, env.grade_timeout_s), env.sandbox)
  print(json.dumps({"reward": r.reward, **r.details}, indent=1))
  return 0 if r.resolved else 1

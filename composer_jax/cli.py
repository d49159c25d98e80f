"""The ``composer-jax`` command line.

Each room of the house registers its own subcommands (``register(subparsers)`` in its ``cli.py``);
this file only assembles them and turns a ``ConfigError`` into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from composer_jax.config import ConfigError

# Modules that define ``register(subparsers)``. Keep heavy imports (jax) inside the handlers so that
# bad input is reported before anything compiles.
COMMAND_MODULES = [
    "composer_jax.model.cli",  # params
    "composer_jax.hf.cli",  # convert --from-hf / --to-hf
    "composer_jax.train.cli",  # pretrain, extend, sft
    "composer_jax.env.cli",  # sandbox exec, tasks generate / setup / grade
    "composer_jax.eval.cli",  # eval
    "composer_jax.rl.cli",  # rl
    "composer_jax.recipe",  # run: the whole recipe
]


class IntermixedParser(argparse.ArgumentParser):
  """Lets ``key=value`` overrides follow options (``--out DIR a.b=1``): plain argparse stops
  filling a ``nargs='*'`` positional once an option has been seen."""

  def parse_known_args(self, args=None, namespace=None):
    if getattr(self, "_inner", False):
      return super().parse_known_args(args, namespace)
    self._inner = True
    try:
      return super().parse_known_intermixed_args(args, namespace)
    finally:
      self._inner = False


def _intermix(parser: argparse.ArgumentParser) -> None:
  """Make every leaf subcommand intermixed (argparse cannot intermix sub-parsers or REMAINDER)."""
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for child in action.choices.values():
        _intermix(child)
  if parser.prog != "composer-jax" and not any(
      a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in parser._actions):
    parser.__class__ = IntermixedParser


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="composer-jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  for name in COMMAND_MODULES:
    importlib.import_module(name).register(sub)
  _intermix(parser)
  return parser


def compile_cache_env(environ) -> None:
  """JAX's persistent compilation cache for every command, unless JAX_COMPILATION_CACHE_DIR is set
  ('' turns it off). The main job's stages and rollout workers compile the same sampler shapes:
  evaluating 16 episodes took 44 s with a cold cache and 21 s warm (docs/rl_tiny.md). Env vars, so
  they must be set before jax is imported (the handlers import it). One folder per jaxlib version
  and host CPU: XLA:CPU entries hold code for the CPU that compiled them, and a home folder shared
  by other machines, or a jaxlib reinstalled in place, must not be served them."""
  if "JAX_COMPILATION_CACHE_DIR" not in environ:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(base, "composer_jax", "xla", _host_key())
  # The tiny config's programs compile in ~0.1-1 s, under JAX's default floor of 1 s.
  environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _host_key() -> str:
  import hashlib
  import importlib.metadata
  import platform
  try:
    jaxlib = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    jaxlib = "none"
  cpu = platform.machine() + platform.processor()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:  # Linux: the CPU's feature flags
      cpu += next((line for line in f if line.startswith(("flags", "Features"))), "")
  except OSError:
    pass
  return f"jaxlib-{jaxlib}-" + hashlib.sha256(cpu.encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
  compile_cache_env(os.environ)
  parser = build_parser()
  args = parser.parse_args(argv)
  from composer_jax.env import scratch
  try:
    with scratch.scope():  # its episodes' files, swept by the next command if this one is killed
      rc = args.func(args)
  except ConfigError as e:
    print(f"composer-jax: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("composer-jax: interrupted", file=sys.stderr)
    return 130
  return int(rc or 0)


if __name__ == "__main__":
  sys.exit(main())

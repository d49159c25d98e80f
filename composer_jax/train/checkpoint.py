"""Orbax checkpoints: async saves, keep-N, exact resume, fallback past a broken latest checkpoint.

A checkpoint is one Orbax step directory with named items: the array pytrees given to ``save``
(parameters, optimizer state, non-trained variables, RNG, step), the data iterator's state and a
JSON ``meta`` item (step, resolved config). Orbax writes into a temporary directory and renames it
when complete, so a run killed mid-save leaves no half checkpoint among the listed steps.

Two ways a listed step can fail, told apart before any array is read:
  * corrupt (its metadata or arrays do not read: truncated or garbage files): skipped, with one line
    saying so, in favour of the previous step;
  * incompatible (it reads, but its trees, shapes or dtypes differ from this run's, e.g. after a
    config change): ``IncompatibleCheckpoint`` with one line naming the first mismatched array and
    the config fields that differ from the checkpoint's own config. Falling back or starting fresh
    would silently overwrite a folder that holds newer steps.

Restoring takes abstract targets (``jax.ShapeDtypeStruct`` with a sharding), so a checkpoint saved on
one mesh loads onto any other mesh.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from composer_jax.config import ConfigError

JSON_ITEMS = ("data", "meta")


class IncompatibleCheckpoint(ConfigError):
  """A readable checkpoint whose arrays do not fit this run's state."""


def _key(k) -> str:
  for a in ("key", "idx", "name"):
    if hasattr(k, a):
      return str(getattr(k, a))
  return str(k)


def _leaves(tree: Any) -> dict[str, tuple]:
  """{'a.b.0': (shape, dtype)} with keys that agree between a live pytree and Orbax metadata."""
  return {".".join(_key(k) for k in path): (tuple(x.shape), np.dtype(x.dtype))
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _flat(d: Any, prefix: str = "") -> dict:
  if not isinstance(d, dict):
    return {prefix[:-1]: d}
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}."))
  return out


def config_diff(saved: dict | None, current: dict | None, limit: int = 4) -> str:
  """'model.d_model 32 there, 64 here; ...' for the config fields that differ."""
  if not saved or not current:
    return ""
  a, b = _flat(saved), _flat(current)
  diffs = [f"{k} {a.get(k)!r} there, {b.get(k)!r} here" for k in sorted(set(a) | set(b))
           if a.get(k) != b.get(k)]
  more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
  return "; ".join(diffs[:limit]) + more


def layout_mismatch(there: Any, here: Any) -> str | None:
  """One line when two sets of leaf keys differ in ``model.scan_layers`` (stacked ``moe_layers.*``
  parameters against per-layer ``layers.N.*`` ones): no array of one fits the other."""
  from composer_jax.model.scan import STACK
  a, b = (any(STACK in k.split(".") for k in keys) for keys in (there, here))
  if a == b:
    return None
  flag = lambda x: "true" if x else "false"
  return (f"it was written with model.scan_layers={flag(a)} (MoE layers "
          f"{'stacked' if a else 'one module each'}) and this run has model.scan_layers={flag(b)}; "
          f"set model.scan_layers={flag(a)} to load it")


def _abstract(tree: Any) -> Any:
  """ShapeDtypeStructs (keeping shardings) for concrete arrays; abstract leaves pass through."""
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  return jax.tree.map(one, tree)


class Checkpointer:
  """A CheckpointManager over ``directory`` saving every ``every`` steps and keeping ``keep``."""

  def __init__(self, directory: str, *, keep: int = 3, every: int = 0, async_save: bool = True,
               local: bool = False):
    """``local``: a reader this process alone uses (a policy evaluated on process 0 of a
    multi-process job): no barrier with the other processes, which are not there to meet it, and
    no clean-up of a writer's temporary folders."""
    self.directory = os.path.abspath(directory)
    self.every = every
    extra = {}
    if local and jax.process_count() > 1:
      me = jax.process_index()
      extra["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
          primary_host=me, active_processes={me})
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not local, enable_async_checkpointing=async_save and not local,
        cleanup_tmp_directories=not local, **extra)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every > 0 and step % self.every == 0)

  def save(self, step: int, arrays: dict[str, Any], data: dict | None, meta: dict) -> None:
    items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
    items["data"] = ocp.args.JsonSave(data or {})
    items["meta"] = ocp.args.JsonSave(meta)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, targets: dict[str, Any], json_items: tuple[str, ...] = JSON_ITEMS
              ) -> dict[str, Any]:
    """Restore the named array items onto the shardings of ``targets`` plus the JSON items."""
    items = {name: ocp.args.StandardRestore(_abstract(t)) for name, t in targets.items()}
    items.update({name: ocp.args.JsonRestore() for name in json_items})
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return {name: out[name] for name in items}

  def saved_config(self, step: int) -> dict | None:
    """The resolved config stored in a step's ``meta`` item (None if it does not read)."""
    try:
      with open(os.path.join(self.directory, str(step), "meta", "metadata")) as f:
        return json.load(f).get("config")
    except (OSError, ValueError, AttributeError):
      return None

  def check_compatible(self, step: int, targets: dict[str, Any], config: dict | None = None,
                       exact_dtype: bool = True) -> None:
    """Raise ``IncompatibleCheckpoint`` if a step's arrays do not fit ``targets`` (reading only
    metadata). Unreadable metadata raises whatever Orbax raises: the step is corrupt."""
    for name, target in targets.items():
      tree = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / name)
      there, here = _leaves(tree.tree), _leaves(_abstract(target))
      layout = layout_mismatch(there, here)
      if layout:
        raise IncompatibleCheckpoint(f"checkpoint step {step} in {self.directory} does not fit "
                                     f"this run: {layout}")
      problem = None
      for k in sorted(set(there) | set(here)):
        if k not in there or k not in here:
          problem = (f"{name}.{k} exists only {'here' if k in here else 'in the checkpoint'} "
                     f"({len(there)} arrays there, {len(here)} here)")
        elif there[k][0] != here[k][0] or (exact_dtype and there[k][1] != here[k][1]):
          (s1, d1), (s2, d2) = there[k], here[k]
          problem = f"{name}.{k} is {list(s1)} {d1} there, {list(s2)} {d2} here"
        if problem:
          break
      if problem:
        diff = config_diff(self.saved_config(step), config)
        raise IncompatibleCheckpoint(
            f"checkpoint step {step} in {self.directory} does not fit this run: {problem}"
            + (f"; config differs: {diff}" if diff else "")
            + "; run with the checkpoint's config or a new output directory")

  def restore_latest(self, targets: dict[str, Any], json_items: tuple[str, ...] = JSON_ITEMS,
                     log=None, config: dict | None = None, exact_dtype: bool = True
                     ) -> tuple[int, dict[str, Any]] | None:
    """The newest readable checkpoint as (step, items), or None when there is none.

    A corrupt step falls back to the previous one (one line via ``log``); an incompatible one
    raises ``IncompatibleCheckpoint`` (``config``, the run's resolved config as a dict, lets the
    message name the differing fields).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    steps = self.steps()[::-1]
    for i, step in enumerate(steps):
      try:
        self.check_compatible(step, targets, config, exact_dtype)
        return step, self.restore(step, targets, json_items)
      except IncompatibleCheckpoint:
        raise
      except Exception as e:  # noqa: BLE001 -- an unreadable checkpoint means: use the previous one
        nxt = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "starting fresh"
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        log(f"checkpoint step {step} in {self.directory} is incomplete or corrupt "
            f"({type(e).__name__}: {reason}); {nxt}")
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def find_checkpoint(path: str) -> tuple[str, int | None]:
  """Resolve ``--init`` paths: a run dir, its ``checkpoints`` dir, or one step dir inside it."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), None
  base = os.path.basename(path.rstrip("/"))
  if base.isdigit() and os.path.isdir(path):
    return os.path.dirname(path), int(base)
  return path, None

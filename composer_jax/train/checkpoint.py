"""Orbax checkpoints: async saves, keep-N, exact resume, fallback past a broken latest checkpoint.

A checkpoint is one Orbax step directory with named items: the array pytrees given to ``save``
(parameters, optimizer state, non-trained variables, RNG, step), the data iterator's state and a
JSON ``meta`` item (step, resolved config). Orbax writes into a temporary directory and renames it
when complete, so a run killed mid-save leaves no half checkpoint among the listed steps. A listed
step that still fails to read (truncated or corrupted files) is skipped, with one line saying so,
in favour of the previous one.

Restoring takes abstract targets (``jax.ShapeDtypeStruct`` with a sharding), so a checkpoint saved on
one mesh loads onto any other mesh.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

JSON_ITEMS = ("data", "meta")


def _abstract(tree: Any) -> Any:
  """ShapeDtypeStructs (keeping shardings) for concrete arrays; abstract leaves pass through."""
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  return jax.tree.map(one, tree)


class Checkpointer:
  """A CheckpointManager over ``directory`` saving every ``every`` steps and keeping ``keep``."""

  def __init__(self, directory: str, *, keep: int = 3, every: int = 0, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.every = every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
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

  def restore_latest(self, targets: dict[str, Any], json_items: tuple[str, ...] = JSON_ITEMS,
                     log=None) -> tuple[int, dict[str, Any]] | None:
    """The newest readable checkpoint as (step, items), or None when there is none."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    steps = self.steps()[::-1]
    for i, step in enumerate(steps):
      try:
        return step, self.restore(step, targets, json_items)
      except Exception as e:  # noqa: BLE001 -- any unreadable checkpoint means: use the previous one
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

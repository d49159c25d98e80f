"""Shared by the rename attack tests: a synthetic ``rename`` task, its gold applied in a copy."""

from __future__ import annotations

import os
import random
import re
import shutil

from composer_jax.env import synthetic
from composer_jax.env.synthetic import TEMPLATES
from composer_jax.env.tasks import read_text, write_text


def gold_rename(tmp_path, seed: str):
  """(task, workspace with the gold applied, the renamed module, the old name, the new name)."""
  task = synthetic.write_task(TEMPLATES["rename"].make(random.Random(seed), 1), str(tmp_path / "rename-1"))
  hidden = next(r for r in task.hidden_tests if r.startswith("test_"))
  amod, old = re.search(r"hasattr\((\w+), '(\w+)'\)", read_text(os.path.join(task.protected_dir, hidden))).groups()
  new = re.search(r"^def (\w+)\(", read_text(os.path.join(task.gold_dir, f"{amod}.py")), re.M).group(1)
  ws = str(tmp_path / "ws")
  shutil.copytree(task.workspace_dir, ws)
  for rel in task.gold_files:
    write_text(os.path.join(ws, rel), read_text(os.path.join(task.gold_dir, rel)))
  return task, ws, amod, old, new

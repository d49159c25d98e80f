"""Syntax-aware deletion, reference removal, auto-install proposals, and one real sdist."""

from __future__ import annotations

import ast
import socket

import pytest

from composer_jax.env import autoinstall
from composer_jax.env import feature_deletion as fd


def test_method_deletion_keeps_class_valid(tmp_path):
  (tmp_path / "m.py").write_text("class A:\n    @property\n    def only(self):\n        x = 1\n"
                                 "        return x\n\n\nclass B:\n    pass\n")
  cands = fd.find_candidates(str(tmp_path), ["m.py"])
  only = [c for c in cands if c.qualname == "A.only"][0]
  assert only.lineno == 2  # the decorator is part of it
  new = fd.delete_candidate(str(tmp_path), only, ["m.py"])["m.py"]
  tree = ast.parse(new)
  assert [type(n).__name__ for n in tree.body[0].body] == ["Pass"] and "only" not in new


def test_reference_edits_keep_layout():
  src = ('from .a import (\n    x,\n    y,\n)\nfrom .a import y, z\nfrom .b import y\n'
         '__all__ = ["x", "y",\n  "z"]\ntry:\n    from .a import y\nexcept ImportError:\n    pass\n')
  edits, n = fd._reference_edits(src, "y", "a")
  new = fd._apply(src.splitlines(keepends=True), edits)
  assert n == 4
  ast.parse(new)
  assert "from .a import (\n    x,\n)" in new and "from .a import z" in new
  assert "from .b import y" in new  # another module's y is not ours
  assert '"y"' not in new and '"z"' in new and "try:\n    pass" in new


def test_autoinstall_propose(tmp_path):
  (tmp_path / "src" / "pkg").mkdir(parents=True)
  (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_p.py").write_text(
      "import os\nimport yaml\nimport pkg\nimport not_a_real_dep_cj\n"
      "try:\n    import cStringIO\nexcept ImportError:\n    pass\n")
  (tmp_path / "pyproject.toml").write_text('[project]\nname="pkg"\ndependencies=["numpy>=1", '
                                           '"other-missing-cj; python_version<\'3\'"]\n'
                                           '[project.optional-dependencies]\ntest=["pytest-cov"]\n')
  r = autoinstall.propose(str(tmp_path))
  assert r.pythonpath == ["src", ".deps"] and r.package_modules == ["pkg"]
  # numpy / yaml are installed, the py2 fallback and the coverage plugin are not needed
  assert r.commands == ["python -m pip install -q --no-input --target .deps not_a_real_dep_cj"]


def _pypi_reachable() -> bool:
  try:
    socket.create_connection(("pypi.org", 443), timeout=3).close()
    return True
  except OSError:
    return False


def test_real_sdist_generation(tmp_path):
  """A short real run: isodate's sdist (tests included), a few candidates. Skipped offline."""
  from composer_jax.env.episode import OraclePolicy, run_episode
  from composer_jax.env.generate import fetch_sdist, generate
  from composer_jax.env.sandbox import Limits
  from composer_jax.env.tasks import load_tasks
  try:
    root = fetch_sdist("isodate==0.7.2")
  except Exception as e:
    if _pypi_reachable():
      raise
    pytest.skip(f"PyPI unreachable: {e}")
  rep = generate(root, str(tmp_path), name="isodate", max_tasks=1, max_tries=6,
                 limits=Limits(timeout_s=120), log=lambda *a: None)
  assert rep["baseline_tests"] > 200 and rep["kept"] == 1
  task = load_tasks(str(tmp_path))[0]
  assert run_episode(task, OraclePolicy()).reward == 1.0


def test_generation_reads_only_the_repositorys_regular_files(tmp_path):
  """Set-up commands (a model may propose them) run in the staging repo before generation reads its
  test files: a FIFO named like a test would block that read for good, a link out of the repo would
  read a host file."""
  import os

  from composer_jax.env.generate import _all_files
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_ok.py").write_text("def test_ok():\n    pass\n")
  os.mkfifo(tmp_path / "tests" / "test_fifo.py")
  outside = tmp_path.parent / f"{tmp_path.name}-host.py"
  outside.write_text("secret = 1\n")
  (tmp_path / "tests" / "test_link.py").symlink_to(outside)
  (tmp_path / "tests" / "test_inner.py").symlink_to(tmp_path / "tests" / "test_ok.py")
  assert _all_files(str(tmp_path)) == ["tests/test_inner.py", "tests/test_ok.py"]

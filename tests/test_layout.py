"""The repository root is on sys.path whenever tests run (`python -m pytest`, pytest's rootdir
insertion for the `tests` package), so a top-level folder that is an import package shadows any
installed distribution of the same name. A top-level `kernels/` once shadowed PyPI's `kernels`,
which transformers imports, and every HF parity test failed on import."""

from __future__ import annotations

import importlib.metadata
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_top_level_package_shadows_an_installed_distribution():
  ours = {"composer_jax"}
  installed = importlib.metadata.packages_distributions()
  top = [n for n in sorted(os.listdir(ROOT)) if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))]
  assert "composer_jax" in top and "tests" in top  # the scan sees the packages it should
  clashes = {n: installed[n] for n in top if n not in ours and n in installed}
  assert not clashes, f"top-level packages that shadow installed distributions: {clashes}"


def test_pypi_kernels_is_the_one_imported_beside_ours():
  import composer_jax.kernels as ours
  assert ours.__file__.startswith(os.path.join(ROOT, "composer_jax", "kernels"))
  try:
    import kernels
  except ImportError:  # transformers without its kernels dependency: nothing to shadow
    return
  assert not os.path.abspath(kernels.__file__).startswith(ROOT + os.sep)

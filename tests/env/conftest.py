"""Shared fixture: a task set generated from the local demo repository (no network), made once per
test session. The store lives under /var/tmp, not /tmp: the sandbox's private /tmp would hide it
anyway, and the point is that the allow-list (not the tmpfs) keeps gold files and hidden tests out of
reach. A link from the session's base temp folder lets tests/eval reuse it in the same session."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from composer_jax.env.demo import demo_task_set


@pytest.fixture(scope="session")
def demo_tasks(tmp_path_factory):
  parent = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
  base = tempfile.mkdtemp(prefix="cj-demo-tasks-", dir=parent)
  link = tmp_path_factory.getbasetemp() / "composer_jax_demo_tasks"
  if not os.path.lexists(link):
    os.symlink(base, link)
  yield demo_task_set(base)
  shutil.rmtree(base, ignore_errors=True)

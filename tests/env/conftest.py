"""Shared fixture: a task set generated from the local demo repository (no network), made once per
test session (tests/env and tests/eval share it through the session's base temp folder)."""

from __future__ import annotations

import pytest

from composer_jax.env.demo import demo_task_set


@pytest.fixture(scope="session")
def demo_tasks(tmp_path_factory):
  return demo_task_set(str(tmp_path_factory.getbasetemp() / "composer_jax_demo_tasks"))

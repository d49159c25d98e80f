"""Scratch folders of rollout workers (env/scratch.py): a dead worker's folder is swept by the next
worker on its host; a live process's folder, another host's and anything not ours are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from composer_jax.env import scratch


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_claim_sweeps_only_this_hosts_dead_workers(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)  # claim() sets it; restore after
  host = scratch._host()
  parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    dead = tmp_path / f"{scratch.PREFIX}{host}-{_dead_pid()}-abc"
    live = tmp_path / f"{scratch.PREFIX}{host}-{parent.pid}-def"
    other_host = tmp_path / f"{scratch.PREFIX}elsewhere-{_dead_pid()}-ghi"
    not_ours = tmp_path / "cj-ep-xyz"
    for d in (dead, live, other_host, not_ours):
      (d / "ws").mkdir(parents=True)
      (d / "ws" / "app.py").write_text("x = 1\n")
    path, swept = scratch.claim(str(tmp_path))
    assert swept == [str(dead)] and not dead.exists()
    assert live.exists() and other_host.exists() and not_ours.exists()
    # Everything tempfile makes from now on in this process lands in the new folder.
    assert os.path.dirname(path) == str(tmp_path) and tempfile.gettempdir() == path
    with tempfile.TemporaryDirectory(prefix="cj-ep-") as ep:
      assert os.path.dirname(ep) == path
    # Our own folder is never swept by ourselves.
    assert scratch.sweep(str(tmp_path)) == [] and os.path.isdir(path)
  finally:
    parent.kill()
    parent.wait()
  assert scratch.sweep(str(tmp_path)) == [str(live)]  # once its process is gone

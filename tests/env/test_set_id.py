"""No file keeps a setuid or setgid bit after a sandbox call (``quota.drop_set_id``): ``cp /bin/sh x;
chmod 4755 x`` in the sandbox would otherwise leave a root shell in the workspace when the host
runs as root, and the workspace can be a user's own folder."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from composer_jax.env import quota
from composer_jax.env import sandbox as sbm
from composer_jax.env.sandbox import Limits, Sandbox

QUICK = Limits(timeout_s=10, memory_mb=1024, max_procs=64, max_file_mb=64, max_output_chars=4000)


def _mode(path) -> int:
  return stat.S_IMODE(os.lstat(path).st_mode)


def test_drop_set_id_clears_the_bits_and_never_follows_a_link(tmp_path):
  ws, outside = tmp_path / "ws", tmp_path / "outside"
  (ws / "deep" / "er").mkdir(parents=True)
  outside.mkdir()
  for rel, mode in (("suid", 0o4755), ("deep/sgid", 0o2750), ("deep/er/both", 0o6711),
                    ("deep/er/unreadable", 0o4000), ("plain", 0o755)):
    (ws / rel).write_text("x")
    os.chmod(ws / rel, mode)
  (outside / "host_suid").write_text("x")
  os.chmod(outside / "host_suid", 0o4755)
  os.symlink(outside / "host_suid", ws / "link")  # the host's own setuid file stays as it is
  os.mkfifo(ws / "fifo")
  cleared = quota.drop_set_id([str(ws)])
  assert sorted(os.path.relpath(p, ws) for p in cleared) == [
      "deep/er/both", "deep/er/unreadable", "deep/sgid", "suid"]
  assert (_mode(ws / "suid"), _mode(ws / "deep/sgid"), _mode(ws / "deep/er/both")) == (0o755, 0o750, 0o711)
  assert _mode(ws / "deep/er/unreadable") == 0 and _mode(ws / "plain") == 0o755
  assert _mode(outside / "host_suid") == 0o4755
  assert quota.drop_set_id([str(ws)]) == []  # nothing left to clear


@pytest.mark.parametrize("mode", ["bwrap", "off"])
def test_a_set_id_copy_of_a_shell_made_in_the_sandbox_is_cleared_at_once(tmp_path, mode):
  if mode == "bwrap" and not sbm.bwrap_available():
    pytest.skip("bubblewrap cannot run here")
  ws = tmp_path / "ws"
  (ws / "sub").mkdir(parents=True)
  sb = Sandbox(str(ws), QUICK, mode="required" if mode == "bwrap" else "off")
  sh = shutil.which("sh")
  r = sb.run(f"cp {sh} x && chmod 4755 x && cp {sh} sub/y && chmod 2755 sub/y && ls -l x sub/y")
  assert r.exit_code == 0, r.output
  assert "rws" in r.output  # the bits were set inside the call ...
  assert _mode(ws / "x") == 0o755 and _mode(ws / "sub/y") == 0o755  # ... and are gone after it
  assert "setuid/setgid bits cleared on 2 file(s)" in r.output
  assert "cleared" not in sb.run("chmod 755 x && echo ok").output  # an honest chmod says nothing

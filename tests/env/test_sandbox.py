"""Sandbox: isolation, limits, timeout kills the process group, clipping, fallback and refusal."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

from composer_jax.env import sandbox as sbm
from composer_jax.env.sandbox import Limits, Sandbox, SandboxError, clip_output

needs_bwrap = pytest.mark.skipif(not sbm.bwrap_available(),
                                 reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")


@needs_bwrap
def test_bwrap_isolation(tmp_path):
  sb = Sandbox(str(tmp_path), Limits(timeout_s=20), mode="required")
  r = sb.run("echo hi > out.txt && cat out.txt")
  assert r.ok and r.sandboxed and r.output.strip() == "hi"
  assert (tmp_path / "out.txt").read_text() == "hi\n"
  # the system is read-only, /tmp is private, the network is gone
  assert not sb.run("touch /usr/cj_probe").ok
  sb.run("touch /tmp/cj_private_probe")
  assert not os.path.exists("/tmp/cj_private_probe")
  r = sb.run(["python", "-c", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"])
  assert r.exit_code != 0


@needs_bwrap
def test_hidden_paths_are_empty(tmp_path):
  # Planted where only `hide` protects it: under a path the sandbox shows (a read-only bind, the
  # workspace). A store above the workspace (outside the allow-list) stays invisible, the workspace not.
  env_dir = tmp_path / "env"
  (env_dir / "pkg").mkdir(parents=True)
  (env_dir / "pkg" / "gold.py").write_text("answer")
  (env_dir / "other.py").write_text("visible")
  store = tempfile.mkdtemp(prefix="cj-store-", dir="/var/tmp")
  try:
    ws = os.path.join(store, "ws")
    os.makedirs(os.path.join(ws, "hidden_copy"))
    with open(os.path.join(ws, "hidden_copy", "gold.py"), "w") as f:
      f.write("answer")
    with open(os.path.join(store, "gold.py"), "w") as f:
      f.write("answer")
    sb = Sandbox(ws, ro_binds=[str(env_dir)],
                 hide=[str(env_dir / "pkg"), store, os.path.join(ws, "hidden_copy")])
    r = sb.run(f"cat {env_dir}/other.py; ls {env_dir}/pkg; cat {env_dir}/pkg/gold.py; "
               f"cat {store}/gold.py; cat hidden_copy/gold.py; echo ws > ws.txt")
    assert "visible" in r.output and "answer" not in r.output
    with open(os.path.join(ws, "ws.txt")) as f:
      assert f.read() == "ws\n"
  finally:
    shutil.rmtree(store, ignore_errors=True)


def test_timeout_kills_the_process_group(tmp_path):
  sb = Sandbox(str(tmp_path), Limits(timeout_s=30))
  t0 = time.perf_counter()
  r = sb.run("(sleep 2; touch late) & sleep 30", timeout=0.5)
  assert r.timed_out and r.exit_code == 124 and "timed out" in r.output
  assert time.perf_counter() - t0 < 10
  time.sleep(2.5)  # the background child would have written by now had it survived
  assert not (tmp_path / "late").exists()


def test_rlimits(tmp_path):
  sb = Sandbox(str(tmp_path), Limits(timeout_s=30, memory_mb=512, max_file_mb=1))
  r = sb.run(["python", "-c", "x = bytearray(1 << 30)"])
  assert r.exit_code != 0 and "MemoryError" in r.output
  sb.run("head -c 5000000 /dev/zero > big")
  assert os.path.getsize(tmp_path / "big") <= 1 << 20


def test_clipped_output(tmp_path):
  sb = Sandbox(str(tmp_path), Limits(timeout_s=30, max_output_chars=200))
  r = sb.run("python -c \"print('HEAD'); print('x' * 100000); print('TAIL')\"")
  assert r.clipped and len(r.output) < 400
  assert r.output.startswith("HEAD") and r.output.rstrip().endswith("TAIL") and "clipped" in r.output
  text, clipped = clip_output("a" * 50 + "b" * 50, 20)
  assert clipped and text.startswith("a" * 10) and text.endswith("b" * 10) and "80 characters" in text


def test_fallback_warns_and_required_refuses(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(sbm, "_BWRAP_OK", False)
  monkeypatch.setattr(sbm, "_WARNED", False)
  with pytest.raises(SandboxError, match="env.sandbox=required"):
    Sandbox(str(tmp_path), mode="required")
  sb = Sandbox(str(tmp_path), mode="auto")
  assert "WARNING" in capsys.readouterr().err
  r = sb.run("echo fallback")
  assert r.ok and not r.sandboxed and r.output.strip() == "fallback"


def test_cli_sandbox_exec(tmp_path, capsys):
  from composer_jax.cli import main
  assert main(["sandbox", "exec", "--workspace", str(tmp_path), "--", "sh", "-c", "echo ok; exit 3"]) == 3
  assert "ok" in capsys.readouterr().out
  assert main(["sandbox", "exec", "--workspace", str(tmp_path / "missing"), "--", "true"]) == 2
  assert main(["sandbox", "exec", "--workspace", str(tmp_path), "--timeout", "0.5", "--",
               "sleep", "10"]) == 124
  # overrides as every other command takes them (before --), and --set as an alias
  capsys.readouterr()
  assert main(["sandbox", "exec", "--workspace", str(tmp_path), "env.sandbox=off", "env.timeout_s=0.5",
               "--", "sleep", "10"]) == 124
  assert "rlimits only" in capsys.readouterr().err
  assert main(["sandbox", "exec", "--workspace", str(tmp_path), "--set", "env.sandbox=off", "--",
               "true"]) == 0
  assert "rlimits only" in capsys.readouterr().err

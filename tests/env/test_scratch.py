"""Scratch folders (env/scratch.py): a dead process's folder is swept by the next rollout worker or
`composer-jax` command on its host; a live process's folder, another host's and anything not ours are
left alone; a command's folder is gone when it returns."""

from __future__ import annotations

import os
import signal
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


def test_a_scope_restores_tempfile_and_removes_its_folder(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  with scratch.scope() as path:
    assert os.path.dirname(path) == str(tmp_path) and tempfile.gettempdir() == path
    ws = tempfile.mkdtemp(prefix="cj-ep-")
    open(os.path.join(ws, "app.py"), "w").close()
  assert tempfile.tempdir == str(tmp_path) and not os.path.exists(path)


def test_every_command_runs_in_one_and_a_killed_ones_is_swept(tmp_path, monkeypatch):
  """`composer-jax` runs each command in a scope (so the episodes of sync RL and of evaluation land
  in it); a command killed mid-episode leaves its folder, and the next process to claim sweeps it."""
  from composer_jax import cli
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  seen = []

  def probe(args):
    seen.append(tempfile.mkdtemp(prefix="cj-ep-"))
    return 0

  build = cli.build_parser

  def parser():
    p = build()
    sub = next(a for a in p._actions if a.choices and "rl" in a.choices)
    sub.add_parser("probe").set_defaults(func=probe)
    return p

  monkeypatch.setattr(cli, "build_parser", parser)
  assert cli.main(["probe"]) == 0
  folder = os.path.dirname(seen[0])
  assert os.path.basename(folder).startswith(f"{scratch.PREFIX}{scratch._host()}-{os.getpid()}-")
  assert not os.path.exists(folder) and tempfile.tempdir == str(tmp_path)
  # kill -9 mid-"episode": the folder outlives the process until a claim on this host sweeps it.
  code = ("import sys, tempfile, time\nfrom composer_jax.env import scratch\n"
          "with scratch.scope(sys.argv[1]) as p:\n"
          "  ws = tempfile.mkdtemp(prefix='cj-ep-'); print(ws, flush=True); time.sleep(60)\n")
  proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
  ws = proc.stdout.readline().strip()
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  proc.stdout.close()
  assert os.path.isdir(ws)
  path, swept = scratch.claim(str(tmp_path))
  assert swept == [os.path.dirname(ws)] and not os.path.exists(ws) and os.path.isdir(path)


def test_reclaim_removes_a_killed_processs_folder_and_nothing_else(tmp_path):
  """What a run's shutdown does with the workers it killed (``Orchestrator.shutdown``): each one's
  folder goes once its pid is gone, a zombie counting as gone; a process still alive after the
  timeout, a folder named for another pid or host, and a symlink are left alone."""
  host = scratch._host()
  killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    mine = tmp_path / f"{scratch.PREFIX}{host}-{killed.pid}-a"
    kept = tmp_path / f"{scratch.PREFIX}{host}-{alive.pid}-b"
    other_host = tmp_path / f"{scratch.PREFIX}elsewhere-{killed.pid}-c"
    wrong_pid = tmp_path / f"{scratch.PREFIX}{host}-{alive.pid}-d"
    for d in (mine, kept, other_host, wrong_pid):
      (d / "ws").mkdir(parents=True)
    link = tmp_path / f"{scratch.PREFIX}{host}-{killed.pid}-e"
    link.symlink_to(other_host)
    killed.kill()  # not reaped: a zombie until wait(), as an orphan under a pid 1 that never reaps
    gone = scratch.reclaim({killed.pid: str(mine), alive.pid: str(kept)}, timeout=0.5)
    assert gone == [str(mine)] and not mine.exists() and kept.exists()
    assert scratch.reclaim({killed.pid: str(other_host)}, timeout=0.5) == [] and other_host.exists()
    assert scratch.reclaim({killed.pid: str(wrong_pid)}, timeout=0.5) == [] and wrong_pid.exists()
    assert scratch.reclaim({killed.pid: str(link)}, timeout=0.5) == [] and (other_host / "ws").exists()
  finally:
    for p in (killed, alive):
      p.kill()
      p.wait()

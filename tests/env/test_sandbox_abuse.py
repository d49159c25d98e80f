"""Abuse attempts against the sandbox, each checking that the host is untouched.

Isolation (what a command can see, reach or signal) needs bubblewrap: without it those tests are
skipped with the reason shown, never passed. What the rlimit-only fallback also promises (nothing
outlives a call, resource limits, environment built from scratch) is tested in both modes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import pytest

from composer_jax.env import reaper
from composer_jax.env import sandbox as sbm
from composer_jax.env.generate import DEFAULT_CACHE
from composer_jax.env.sandbox import Limits, Sandbox, SandboxError
from composer_jax.env.tasks import load_tasks

NO_BWRAP = "bubblewrap cannot run here, isolation untested (apt-get install -y bubblewrap)"
needs_bwrap = pytest.mark.skipif(not sbm.bwrap_available(), reason=NO_BWRAP)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(sbm.__file__)))  # .../composer_jax
QUICK = Limits(timeout_s=10, memory_mb=1024, max_procs=64, max_file_mb=8, max_output_chars=4000)


@pytest.fixture(params=["bwrap", "fallback"])
def mode(request):
  """Both modes for the promises the fallback keeps too."""
  if request.param == "bwrap" and not sbm.bwrap_available():
    pytest.skip(NO_BWRAP)
  return "required" if request.param == "bwrap" else "off"


def _procs_with(needle: bytes) -> list[int]:
  """Host pids whose command line or environment contains ``needle``."""
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == os.getpid():
      continue
    for part in ("cmdline", "environ"):
      try:
        with open(f"/proc/{name}/{part}", "rb") as f:
          if needle in f.read():
            found.append(int(name))
            break
      except OSError:
        continue
  return found


@pytest.fixture
def planted(demo_tasks):
  """A secret in several places outside the workspace; removed afterwards."""
  secret = f"cj-secret-{uuid.uuid4().hex}"
  made, paths = [], {}

  def plant(key, folder, name="secret.txt"):
    os.makedirs(folder, exist_ok=True)
    made.append(folder)
    paths[key] = os.path.join(folder, name)
    with open(paths[key], "w") as f:
      f.write(secret)

  tag = uuid.uuid4().hex[:8]
  plant("var_tmp", f"/var/tmp/cj-abuse-{tag}")
  plant("home", os.path.join(os.path.expanduser("~"), f".cj-abuse-{tag}"))
  plant("sdist_cache", os.path.join(DEFAULT_CACHE, f"cj-abuse-{tag}", "pkg"), "core.py")
  plant("checkout", os.path.join(CHECKOUT, f".cj-abuse-{tag}"))
  task = load_tasks(demo_tasks[0])[0]
  gold = os.path.join(task.gold_dir, task.gold_files[0])
  paths["gold"] = gold
  paths["other_task"] = os.path.join(load_tasks(demo_tasks[0])[-1].path, "task.json")
  with open(gold) as f:
    gold_text = f.read()
  yield secret, paths, gold_text
  for d in made:
    shutil.rmtree(d, ignore_errors=True)
  shutil.rmtree(os.path.join(DEFAULT_CACHE, f"cj-abuse-{tag}"), ignore_errors=True)


@needs_bwrap
def test_secrets_outside_the_workspace_are_unreadable(tmp_path, planted):
  secret, paths, gold_text = planted
  sb = Sandbox(str(tmp_path), QUICK, mode="required")
  for key, path in paths.items():
    r = sb.run(["/bin/sh", "-c", 'cat "$0"; ls "$(dirname "$0")"', path])
    assert r.exit_code != 0, (key, r.output)
    assert secret not in r.output and os.path.basename(path) not in r.output.replace(path, ""), key
  r = sb.run(f"cat {CHECKOUT}/composer_jax/env/sandbox.py {CHECKOUT}/README.md; ls {CHECKOUT}")
  assert "allow-list" not in r.output and secret not in r.output
  assert gold_text.strip() and gold_text.strip() not in r.output


@needs_bwrap
def test_listing_shows_only_the_allow_list(tmp_path):
  sb = Sandbox(str(tmp_path), QUICK, mode="required")
  top = set(sb.run("ls -A /").output.split())
  allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "tmp"}
  allowed |= {p.split("/")[1] for p in sbm.interpreter_paths()} | {str(tmp_path).split("/")[1]}
  assert top <= allowed, top - allowed
  assert not top & {"var", "opt", "srv", "mnt", "home", "work", "media", "boot"}
  # /root shows at most the path down to the interpreter (pyenv), none of the host's files
  shown = set(sb.run("ls -A /root 2>/dev/null").output.split())
  under_root = {p.split("/")[2] for p in sbm.interpreter_paths() if p.startswith("/root/")}
  assert shown <= under_root, shown
  assert sb.run("ls -A /home 2>/dev/null").output.strip() == ""
  etc = set(sb.run("ls -A /etc").output.split())
  assert etc <= set(sbm._ETC) and "shadow" not in etc


@needs_bwrap
def test_no_network_to_a_local_server(tmp_path):
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(4)
  srv.settimeout(0.2)
  port = srv.getsockname()[1]
  accepted = []
  stop = threading.Event()

  def serve():
    while not stop.is_set():
      try:
        conn, _ = srv.accept()
        accepted.append(1)
        conn.close()
      except OSError:
        continue
  th = threading.Thread(target=serve, daemon=True)
  th.start()
  try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
    time.sleep(0.3)
    assert accepted == [1]
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
    r = Sandbox(str(tmp_path), QUICK, mode="required").run(["python", "-c", code])
    assert r.exit_code != 0 and ("refused" in r.output or "unreachable" in r.output.lower())
    time.sleep(0.3)
    assert accepted == [1]
  finally:
    stop.set()
    th.join(timeout=2)
    srv.close()


@needs_bwrap
def test_writes_outside_the_workspace_do_not_reach_the_host(tmp_path):
  tag = uuid.uuid4().hex[:8]
  targets = [f"/var/tmp/cj-w-{tag}", os.path.join(os.path.expanduser("~"), f".cj-w-{tag}"),
             f"/tmp/cj-w-{tag}", os.path.join(CHECKOUT, f"cj-w-{tag}"),
             os.path.join(sbm.interpreter_paths()[0], f"cj-w-{tag}"), f"/usr/cj-w-{tag}"]
  sb = Sandbox(str(tmp_path), QUICK, mode="required")
  sb.run("; ".join(f"echo x > {t}" for t in targets) + "; echo done > ok")
  try:
    assert (tmp_path / "ok").read_text() == "done\n"
    assert not [t for t in targets if os.path.exists(t)]
  finally:
    for t in targets:
      if os.path.isfile(t):
        os.remove(t)


@needs_bwrap
def test_host_processes_are_invisible_and_unsignalled(tmp_path):
  secret = f"cj-env-{uuid.uuid4().hex}"
  host = subprocess.Popen(["sleep", "60"], env={"CJ_SECRET": secret, "PATH": "/usr/bin:/bin"})
  try:
    sb = Sandbox(str(tmp_path), QUICK, mode="required")
    r = sb.run(f"kill -9 {host.pid}; cat /proc/{host.pid}/environ /proc/{host.pid}/cmdline; "
               "ls /proc | grep -c '^[0-9]'")
    assert host.poll() is None  # still alive
    assert secret not in r.output
    assert int(r.output.split()[-1]) < 10  # only the sandbox's own few processes
  finally:
    host.kill()
    host.wait()


@needs_bwrap
def test_fork_bomb_is_bounded(tmp_path):
  if os.getuid() == 0 and reaper._cgroup_base() is None:
    pytest.skip("root ignores RLIMIT_NPROC and no pids cgroup can be made here: a fork bomb would "
                "be bounded only by the timeout, not run on a shared host")
  tag = uuid.uuid4().hex[:12]
  sb = Sandbox(str(tmp_path), Limits(timeout_s=2, max_procs=32, memory_mb=256), mode="required",
               env={"CJ_TAG": tag})
  t0 = time.perf_counter()
  r = sb.run("b(){ b | b & }; b; sleep 5")
  # Either the timeout kills the tree, or the pids limit starves it first so that even the shell's
  # own `sleep` cannot fork and it exits early (seen on CI): both are bounded, neither succeeds.
  assert time.perf_counter() - t0 < 10 and r.exit_code != 0
  assert r.timed_out or "fork" in r.output.lower()
  time.sleep(0.2)
  assert not _procs_with(f"CJ_TAG={tag}".encode())


def test_huge_allocation_fails(tmp_path, mode):
  r = Sandbox(str(tmp_path), QUICK, mode=mode).run(["python", "-c", "b = bytearray(40 << 30)"])
  assert r.exit_code != 0 and "MemoryError" in r.output


def test_cpu_spin_is_stopped(tmp_path, mode):
  sb = Sandbox(str(tmp_path), QUICK, mode=mode)
  t0 = time.perf_counter()
  r = sb.run("while :; do :; done", timeout=0.5)
  assert r.timed_out and r.exit_code == 124 and time.perf_counter() - t0 < 5
  # RLIMIT_CPU stops a spin before a long wall-clock timeout
  sb = Sandbox(str(tmp_path), Limits(timeout_s=20, cpu_s=1), mode=mode)
  t0 = time.perf_counter()
  r = sb.run(["python", "-c", "while True: pass"])
  assert not r.timed_out and r.exit_code != 0 and time.perf_counter() - t0 < 15


def test_file_size_flood_is_capped(tmp_path, mode):
  sb = Sandbox(str(tmp_path), Limits(timeout_s=10, max_file_mb=1, max_output_chars=1000), mode=mode)
  sb.run("head -c 5000000 /dev/zero > big")
  assert os.path.getsize(tmp_path / "big") <= 1 << 20
  r = sb.run("yes flood | head -c 20000000")  # stdout goes to a file, capped the same way
  assert r.clipped and len(r.output) < 2000


def test_nothing_outlives_the_call(tmp_path, mode):
  tag = f"{time.time_ns() % 10**6:06d}{os.getpid() % 1000:03d}"  # a unique sleep length to look for
  sb = Sandbox(str(tmp_path), QUICK, mode=mode)
  t0 = time.perf_counter()
  r = sb.run(f"sleep 300.{tag}1 & (setsid sleep 300.{tag}2 &) ; nohup sleep 300.{tag}3 >/dev/null 2>&1 &"
             " echo started")
  assert r.ok and "started" in r.output and time.perf_counter() - t0 < 5
  escaped = ""
  if mode == "required" or reaper._cgroup_base():  # env -i drops the fallback's marker; a cgroup keeps it
    escaped = f"env -i setsid sleep 300.{tag}4 &"
    r = sb.run(escaped + " echo started")
    assert r.ok
  time.sleep(0.2)
  left = _procs_with(f"300.{tag}".encode())
  for pid in left:  # do not leave them running even when the test fails
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass
  assert not left


def test_environment_is_built_from_scratch(tmp_path, mode, monkeypatch):
  monkeypatch.setenv("CJ_HOST_TOKEN", "hunter2")
  r = Sandbox(str(tmp_path), QUICK, mode=mode, env={"TASK_VAR": "1"}).run("env")
  assert "hunter2" not in r.output and "TASK_VAR=1" in r.output
  # The call's marker (the reaper's fallback handle) is random: no host pid or call count in it.
  marker = next(line for line in r.output.splitlines() if line.startswith("COMPOSER_JAX_SANDBOX_CALL="))
  assert str(os.getpid()) not in marker and "-" not in marker
  path = next(line for line in r.output.splitlines() if line.startswith("PATH="))
  assert ".pyenv/shims" not in path and path.split("=", 1)[1] == sbm.search_path()
  home = next(line for line in r.output.splitlines() if line.startswith("HOME="))[5:]
  assert home != os.path.expanduser("~")
  if mode == "off":  # the fallback's private HOME is removed after the call
    assert not os.path.exists(home)


def test_model_driven_runs_refuse_without_isolation(tmp_path, monkeypatch):
  if sbm.bwrap_available():
    for m in ("off", "auto"):
      assert Sandbox(str(tmp_path), mode=m, model_driven=True).use_bwrap
  monkeypatch.setattr(sbm, "_BWRAP_OK", False)
  for m in ("off", "auto", "required"):
    with pytest.raises(SandboxError) as e:
      Sandbox(str(tmp_path), mode=m, model_driven=True)
    assert "apt-get install -y bubblewrap" in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(SandboxError, match="bubblewrap"):
    sbm.require_isolation("off", "an RL rollout")
  from composer_jax.env.autoinstall import Recipe, run_setup
  with pytest.raises(SandboxError, match="bubblewrap"):  # model-proposed set-up commands
    run_setup(str(tmp_path), Recipe(["."], ["pkg"], ["true"]), QUICK, "off", model_proposed=True)
  assert run_setup(str(tmp_path), Recipe(["."], ["pkg"], ["true"]), QUICK, "auto")  # trusted: falls back


def test_model_driven_episode_refuses_without_isolation(demo_tasks, monkeypatch):
  from composer_jax.env.episode import NullPolicy, run_episode
  monkeypatch.setattr(sbm, "_BWRAP_OK", False)
  task = load_tasks(demo_tasks[0])[0]
  with pytest.raises(SandboxError, match="apt-get install -y bubblewrap"):
    run_episode(task, NullPolicy(), mode="off", model_driven=True)


def _entries(path) -> int:
  return sum(len(dirs) + len(files) for _, dirs, files in os.walk(path))


def test_a_disk_flood_is_stopped_and_nothing_runs_over_the_budget(tmp_path, mode):
  """RLIMIT_FSIZE caps one file, not how many: a loop of 4 MB files (here at ~130 MB/s; a real flood
  writes ~1 GB/s) is stopped once the workspace passes ``workspace_mb``, and the next call does not
  run until the files are gone."""
  ws = tmp_path / "ws"
  (ws / "deps").mkdir(parents=True)
  (ws / "deps" / "big.so").write_bytes(b"\0" * (40 << 20))  # what the workspace starts with is allowed
  sb = Sandbox(str(ws), Limits(timeout_s=20, max_file_mb=8, workspace_mb=32), mode=mode)
  assert sb.run("echo ok").ok
  shutil.rmtree(ws / "deps")
  t0 = time.perf_counter()
  r = sb.run("i=0; while [ $i -lt 200 ]; do head -c 4M /dev/zero > f$i; i=$((i+1)); sleep 0.02; done")
  assert r.stopped and "env.workspace_mb=32" in r.stopped and "[command stopped" in r.output
  assert r.exit_code == 125 and not r.timed_out and time.perf_counter() - t0 < 6
  assert 18 < len(os.listdir(ws)) < 70  # 40 MB + 32 MB is 18 files; unstopped, 200
  r = sb.run("echo ran > ran.txt")
  assert r.exit_code == 125 and r.output.startswith("[not run") and not (ws / "ran.txt").exists()
  assert len(sb.stopped) == 2
  for f in os.listdir(ws):
    os.remove(ws / f)
  assert sb.run("echo ran > ran.txt").ok and (ws / "ran.txt").exists()


def test_a_flood_of_files_or_through_a_bind_is_stopped(tmp_path, mode):
  """Empty files cost no bytes but make the grading copy take minutes: ``workspace_files`` bounds
  them. A read-write bind (the grader's results folder) counts with the workspace."""
  ws, out = tmp_path / "ws", tmp_path / "out"
  ws.mkdir()
  out.mkdir()
  sb = Sandbox(str(ws), Limits(timeout_s=30, workspace_files=2000), mode=mode, binds=[str(out)])
  t0 = time.perf_counter()
  r = sb.run(["python", "-c", "import os\nfor i in range(300000): open(f'e{i}', 'w').close()"])
  assert "env.workspace_files=2000" in r.stopped and time.perf_counter() - t0 < 15
  assert 2000 < _entries(ws) < 150000
  sb = Sandbox(str(ws), Limits(timeout_s=20, max_file_mb=8, workspace_mb=32, workspace_files=0),
               mode=mode, binds=[str(out)])
  for f in os.listdir(ws):
    os.remove(ws / f)
  r = sb.run(f"i=0; while [ $i -lt 200 ]; do head -c 4M /dev/zero > {out}/f$i; i=$((i+1)); sleep 0.02; done")
  assert "env.workspace_mb=32" in r.stopped and len(os.listdir(out)) < 60


@needs_bwrap
def test_the_private_tmp_is_bounded(tmp_path):
  """/tmp is a tmpfs, so what is written there is host memory (1.5 GB in 2 s, unbounded before).
  So were bubblewrap's root and /dev (4 GB into /root in one call, stop 58): they are read-only
  now, and /dev/shm is a tmpfs of the same bound as /tmp."""
  if not sbm._bwrap_sizes():
    pytest.skip("this bubblewrap (< 0.6) has no --size; the memory cgroup alone bounds /tmp")
  sb = Sandbox(str(tmp_path), Limits(timeout_s=20, tmp_mb=16), mode="required")
  for where in ("/tmp", "/dev/shm"):
    r = sb.run(f"head -c 64M /dev/zero > {where}/f; wc -c < {where}/f")
    assert "No space left" in r.output and int(r.output.split()[-1]) <= 16 << 20, where
  r = sb.run("for d in / /root /etc /dev; do (echo x > $d/cj-w) 2>/dev/null && echo wrote $d; done; "
             "echo x > /dev/null && python -c 'import multiprocessing as m; m.Lock()' && echo ok")
  assert r.output.split() == ["ok"], r.output
  hidden = tmp_path / "hidden"
  hidden.mkdir()
  r = Sandbox(str(tmp_path), QUICK, mode="required", hide=[str(hidden)]).run(f"echo x > {hidden}/f")
  assert r.exit_code != 0 and not (hidden / "f").exists()  # a hidden folder is read-only inside


def test_memory_pressure_ends_the_sandboxed_command_first(tmp_path, mode):
  """RLIMIT_AS bounds each process, not their sum: three children of 120 MB each fit under a 256 MB
  limit one by one. Where a memory cgroup can be made the call as a whole is held to it, so one of
  them is killed; in every case the call's processes are the OOM killer's first choice."""
  sb = Sandbox(str(tmp_path), Limits(timeout_s=30, memory_mb=256), mode=mode)
  assert sb.run("cat /proc/self/oom_score_adj").output.split()[0] == "1000"
  code = ("import os, time\nkids = []\nfor _ in range(3):\n  pid = os.fork()\n  if pid == 0:\n"
          "    b = bytearray(120 << 20)\n    b[::4096] = b'x' * len(range(0, len(b), 4096))\n"
          "    time.sleep(2)\n    os._exit(0)\n  kids.append(pid)\n"
          "print('status', [os.waitpid(k, 0)[1] for k in kids])")
  r = sb.run(["python", "-c", code])
  if reaper._memory_base() is None:
    pytest.skip("no memory cgroup can be made here: the call's total memory is not bounded")
  if "status" in r.output:
    assert any(int(s) != 0 for s in r.output.split("status", 1)[1].strip(" []\n").split(",")), r.output
  else:  # the OOM killer took the parent instead
    assert r.exit_code in (-9, 137), r.output


def test_a_deep_tree_is_stopped_and_removed(tmp_path, mode):
  """``mkdir d; cd d`` in a loop nests 5000 folders in well under the 0.2 s between measurements.
  Python 3.11's recursive ``rmtree`` and ``copytree`` raise RecursionError on such a tree (an
  episode's clean-up did, and three such units stop an RL run), so the call is stopped past
  ``quota.MAX_DEPTH`` and ``scratch.remove_tree`` removes any depth."""
  from composer_jax.env import quota, scratch
  ws = tmp_path / "ws"
  ws.mkdir()
  sb = Sandbox(str(ws), QUICK, mode=mode)
  r = sb.run(["python", "-c", "import os\nfor _ in range(5000):\n  os.mkdir('d')\n  os.chdir('d')"])
  assert f"more than {quota.MAX_DEPTH} levels deep" in r.stopped
  scratch.remove_tree(str(ws))
  assert not os.path.lexists(ws)
  deep = tmp_path / "deep"  # the depth the unsandboxed loop reached in 0.2 s, made here for sure
  deep.mkdir()
  fd = os.open(deep, os.O_RDONLY)
  for _ in range(3000):
    os.mkdir("d", dir_fd=fd)
    fd, old = os.open("d", os.O_RDONLY, dir_fd=fd), fd
    os.close(old)
  os.close(fd)
  with pytest.raises(RecursionError):
    shutil.rmtree(deep)
  scratch.remove_tree(str(deep))
  assert not os.path.lexists(deep)

"""A process's scratch folder for episode workspaces, swept once the process that made it is gone.

An episode removes its workspace when it closes, but a process killed mid-episode (SIGKILL, the OOM
killer, a lost node) cannot: a rollout worker, or the driver of a run whose RL is synchronous or
that is evaluating. So every `composer-jax` command (``scope``) and every rollout worker (``claim``)
keeps all its temporary files under one folder named by its host and pid, and the next one to start
on the same host removes the folders of pids that no longer run: the replacement of a dead worker
cleans up after it, and a `--resume` after a killed run. The host is in the name because /tmp can be
shared between containers, whose pids differ.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

PREFIX = "cj-scratch-"


def remove_tree(path: str) -> None:
  """Remove a folder a sandboxed command wrote to, never raising. Python 3.11's ``rmtree`` recurses
  once a level and fails past ~1000 (``mkdir d; cd d`` in a loop makes 3000 in 3 s); what it leaves
  goes to ``rm -rf``, which walks any depth."""
  try:
    shutil.rmtree(path, ignore_errors=True)
  except RecursionError:
    pass
  # A folder the command made unreadable (chmod 000) stops a non-root host's rm until it is opened
  # up again; chmod -R never follows a link.
  for cmd in (["rm", "-rf", "--", path], ["chmod", "-R", "u+rwx", "--", path], ["rm", "-rf", "--", path]):
    if not os.path.lexists(path):
      return
    try:
      subprocess.run(cmd, capture_output=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired):
      pass


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[str]:
  """``tempfile.TemporaryDirectory`` for folders a sandboxed command writes to (``remove_tree``)."""
  path = tempfile.mkdtemp(prefix=prefix)
  try:
    yield path
  finally:
    remove_tree(path)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  try:  # a zombie (killed, not yet reaped: a container's pid 1 may never reap it) holds no files
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return True


def _host() -> str:
  return socket.gethostname().replace("-", "_").replace(os.sep, "_")


def sweep(root: str | None = None) -> list[str]:
  """Remove this host's scratch folders under ``root`` whose process is gone; returns their paths."""
  root = root or tempfile.gettempdir()
  mine = f"{PREFIX}{_host()}-"
  gone = []
  for name in sorted(os.listdir(root)):
    if not name.startswith(mine):
      continue
    pid = name[len(mine):].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
      continue
    path = os.path.join(root, name)
    remove_tree(path)
    gone.append(path)
  return gone


def reclaim(folders: dict[int, str], timeout: float = 10.0) -> list[str]:
  """Remove the scratch folders of processes this one has just killed (pid -> folder), each once
  its pid is gone: a run that ends while its rollout workers are mid-episode leaves nothing behind.
  Only this host's folders named by that pid are touched; one whose process outlives ``timeout``
  seconds is left to the next ``sweep``. Returns the paths removed."""
  deadline = time.monotonic() + timeout
  gone = []
  for pid, path in folders.items():
    if not os.path.basename(path).startswith(f"{PREFIX}{_host()}-{pid}-"):
      continue  # another host's worker (rl.ray_address), or not a scratch folder at all
    while _alive(pid) and time.monotonic() < deadline:
      time.sleep(0.05)
    if not _alive(pid) and os.path.isdir(path) and not os.path.islink(path):
      remove_tree(path)
      gone.append(path)
  return gone


def claim(root: str | None = None) -> tuple[str, list[str]]:
  """Sweep, then make a scratch folder for this process the default for ``tempfile`` (so every
  episode's workspace and every sandbox call's output file land in it). Returns (folder, swept)."""
  root = root or tempfile.gettempdir()
  swept = sweep(root)
  path = tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}-", dir=root)
  tempfile.tempdir = path
  return path, swept


@contextlib.contextmanager
def scope(root: str | None = None) -> Iterator[str]:
  """``claim`` for the length of a block: afterwards ``tempfile``'s default is what it was and the
  folder is gone. The command line runs every command in one (``composer_jax.cli.main``)."""
  before = tempfile.tempdir
  path, _ = claim(root)
  try:
    yield path
  finally:
    tempfile.tempdir = before
    remove_tree(path)

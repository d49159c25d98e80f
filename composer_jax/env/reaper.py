"""Nothing outlives a sandbox call: per-call pids cgroups, process-group kills, and a marker sweep.

Each call gets a cgroup with ``pids.max`` where one can be made (cgroup v1 with the pids controller, or
a delegated v2 subtree): root ignores RLIMIT_NPROC, the cgroup still bounds a fork bomb, and killing
every process in it catches whatever left the process group. Without a cgroup (the rlimit-only
fallback), processes that left the group are found by the per-call marker in their environment.
``_wait_exit`` waits without reaping, so the group id stays reserved until the group is killed.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import select
import signal
import subprocess
import time


def _under(path: str, roots) -> bool:
  return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


_CALLS = itertools.count()


@functools.cache
def _cgroup_base() -> str | None:
  """A pids-cgroup folder this process may make children in, or None (then rlimits only)."""
  try:
    with open("/proc/self/cgroup") as f:
      own = [line.rstrip("\n").split(":", 2) for line in f]
    with open("/proc/self/mountinfo") as f:
      mounts = [line.split() for line in f]
  except OSError:
    return None
  for m in mounts:
    sep = m.index("-")
    fstype, opts, root, point = m[sep + 1], m[sep + 3].split(","), m[3], m[4]
    if fstype == "cgroup" and "pids" in opts:
      rel = next((p for _, c, p in own if "pids" in c.split(",")), None)
    elif fstype == "cgroup2":
      rel = next((p for h, c, p in own if h == "0" and c == ""), None)
    else:
      continue
    if rel is None or not _under(rel, [root]):
      continue
    base = os.path.join(os.path.normpath(os.path.join(point, os.path.relpath(rel, root))),
                        "composer_jax_sandbox")
    try:
      os.makedirs(base, exist_ok=True)
      if fstype == "cgroup2":
        with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
          f.write("+pids")
      _sweep_stale(base)
      probe = _make_call_cgroup(base, 8)
      if probe:
        _remove_cgroup(probe)
        return base
    except OSError:
      continue
  return None


def _make_call_cgroup(base: str, max_procs: int) -> str | None:
  path = os.path.join(base, f"{os.getpid()}-{next(_CALLS)}")
  try:
    os.mkdir(path)
    with open(os.path.join(path, "pids.max"), "w") as f:
      f.write(str(max_procs) if max_procs > 0 else "max")
    return path
  except OSError:
    _remove_cgroup(path)
    return None


def _cgroup_pids(path: str) -> list[int]:
  try:
    with open(os.path.join(path, "cgroup.procs")) as f:
      return [int(x) for x in f.read().split()]
  except (OSError, ValueError):
    return []


def _kill_cgroup(path: str) -> None:
  """SIGKILL every process in the call's cgroup, again for any forked meanwhile (the pids cap bounds
  that race; a killed process cannot fork). Those still exiting are left to the kernel."""
  sent: set[int] = set()
  for _ in range(1000):
    pids = [p for p in _cgroup_pids(path) if p not in sent]
    if not pids:
      return
    for pid in pids:
      sent.add(pid)
      try:
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass


def _remove_cgroup(path: str, wait: bool = True) -> bool:
  for _ in range(50 if wait else 1):
    try:
      os.rmdir(path)
      return True
    except FileNotFoundError:
      return True
    except OSError:  # busy while a killed process is still exiting
      if wait:
        time.sleep(0.005)
  return False


_PENDING: list[str] = []  # call cgroups whose last processes were still exiting


def _release_cgroup(path: str) -> None:
  """Remove the call's cgroup without waiting; busy ones are retried on later calls and at exit."""
  _PENDING.append(path)
  for p in list(_PENDING):
    if _remove_cgroup(p, wait=False):
      try:
        _PENDING.remove(p)
      except ValueError:
        pass


@atexit.register
def _release_pending() -> None:
  for p in _PENDING:
    _remove_cgroup(p)


def _sweep_stale(base: str) -> None:
  """Remove call cgroups left by processes that died before cleaning up."""
  for name in os.listdir(base):
    owner = name.split("-")[0]
    if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
      _kill_cgroup(os.path.join(base, name))
      _remove_cgroup(os.path.join(base, name))


def _kill_marked(marker: bytes) -> None:
  """Fallback without a cgroup: kill processes whose environment carries this call's marker."""
  me = os.getpid()
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == me:
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        if marker in f.read().split(b"\0"):
          os.kill(int(name), signal.SIGKILL)
    except (OSError, ValueError):
      continue


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
  """Wait until the process exits WITHOUT reaping it (the zombie keeps its pid and process group
  reserved, so the group can be killed safely afterwards). False on timeout."""
  try:
    fd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):
    try:
      proc.wait(timeout=timeout)
      return True
    except subprocess.TimeoutExpired:
      return False
  try:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(min(max(0, int(timeout * 1000)), 2**31 - 1)))
  finally:
    os.close(fd)

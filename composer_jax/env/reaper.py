"""Nothing outlives a sandbox call: per-call pids cgroups, process-group kills, and a marker sweep.

Each call gets a cgroup with ``pids.max`` where one can be made (cgroup v1 with the pids controller, or
a delegated v2 subtree): root ignores RLIMIT_NPROC, the cgroup still bounds a fork bomb, and killing
every process in it catches whatever left the process group. Where a memory cgroup can be made too,
it bounds the call's resident memory as a whole (its private ``/tmp`` included), which RLIMIT_AS,
per process, does not. Without a cgroup (the rlimit-only
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
from collections.abc import Iterator


def _under(path: str, roots) -> bool:
  return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


_CALLS = itertools.count()


def _hierarchy(controller: str) -> Iterator[tuple[str, str]]:
  """(fstype, folder) of this process's own cgroup in each hierarchy that may hold ``controller``."""
  try:
    with open("/proc/self/cgroup") as f:
      own = [line.rstrip("\n").split(":", 2) for line in f]
    with open("/proc/self/mountinfo") as f:
      mounts = [line.split() for line in f]
  except OSError:
    return
  for m in mounts:
    sep = m.index("-")
    fstype, opts, root, point = m[sep + 1], m[sep + 3].split(","), m[3], m[4]
    if fstype == "cgroup" and controller in opts:
      rel = next((p for _, c, p in own if controller in c.split(",")), None)
    elif fstype == "cgroup2":
      rel = next((p for h, c, p in own if h == "0" and c == ""), None)
    else:
      continue
    if rel is None or not _under(rel, [root]):
      continue
    yield fstype, os.path.normpath(os.path.join(point, os.path.relpath(rel, root)))


def _controller_base(controller: str, limit_file: dict[str, str], probe_value: int) -> str | None:
  """A folder of ``controller``'s hierarchy this process may make call cgroups in, or None."""
  for fstype, own in _hierarchy(controller):
    base = os.path.join(own, "composer_jax_sandbox")
    try:
      os.makedirs(base, exist_ok=True)
      if fstype == "cgroup2":
        with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
          f.write(f"+{controller}")
      _sweep_stale(base)
      probe = _make_cgroup(base, {limit_file[fstype]: probe_value})
      if probe:
        _remove_cgroup(probe)
        _LIMIT_FILE[controller, base] = limit_file[fstype]
        return base
    except OSError:
      continue
  return None


_LIMIT_FILE: dict[tuple[str, str], str] = {}  # (controller, base) -> the file of its call cgroups' limit


@functools.cache
def _cgroup_base() -> str | None:
  """A pids-cgroup folder this process may make children in, or None (then rlimits only)."""
  return _controller_base("pids", {"cgroup": "pids.max", "cgroup2": "pids.max"}, 8)


@functools.cache
def _memory_base() -> str | None:
  """A memory-cgroup folder this process may make children in, or None (then RLIMIT_AS per process
  and ``oom_score_adj`` only). On cgroup v2 it is the pids base when memory can be enabled there."""
  return _controller_base("memory", {"cgroup": "memory.limit_in_bytes", "cgroup2": "memory.max"},
                          64 << 20)


def _make_cgroup(base: str, limits: dict[str, int]) -> str | None:
  path = os.path.join(base, f"{os.getpid()}-{next(_CALLS)}")
  try:
    os.mkdir(path)
    for name, value in limits.items():
      with open(os.path.join(path, name), "w") as f:
        f.write(str(value) if value > 0 else "max")
    return path
  except OSError:
    _remove_cgroup(path)
    return None


def _make_call_cgroups(max_procs: int, memory_bytes: int) -> tuple[str | None, list[str]]:
  """The call's pids cgroup (the one ``_kill_cgroup`` empties) and every cgroup its first process
  joins: on cgroup v1 the memory cgroup is a second one, on v2 one cgroup holds both limits."""
  pids_base = _cgroup_base()
  mem_base = _memory_base() if memory_bytes > 0 else None
  limits = {"pids.max": max_procs}
  if mem_base and mem_base == pids_base:
    limits[_LIMIT_FILE["memory", mem_base]] = memory_bytes
  pids = _make_cgroup(pids_base, limits) if pids_base else None
  joined = [pids] if pids else []
  if mem_base and mem_base != pids_base:
    mem = _make_cgroup(mem_base, {_LIMIT_FILE["memory", mem_base]: memory_bytes})
    joined += [mem] if mem else []
  return pids, joined


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

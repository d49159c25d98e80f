"""What a sandbox call may leave on the host's disk: a bound on the bytes and entries of its folders.

RLIMIT_FSIZE caps one file, not how many: at ~1 GB/s a command fills the host's disk in a minute,
and a million empty files make the grading copy take minutes. So the sandbox measures its writable
folders (the workspace and ``binds``) before a call, every fraction of a second during it, and after
it, and stops a call that grows them past either bound (``Sandbox.run``; the episode then ends, flagged:
``guards.quota_flag``). The walk never follows a link and stops as soon as a bound is passed, so it
costs at most one bound's worth of entries. After each call, ``drop_set_id`` clears any setuid or
setgid bit a call set in those folders.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import NamedTuple


MAX_DEPTH = 128  # folders deeper than this (or than the workspace began with) stop a call


class Usage(NamedTuple):
  bytes: int
  entries: int
  depth: int  # of the deepest folder, the roots' children at 1


def _walk(roots: Sequence[str]):
  """(path, lstat or None where it failed, depth) of every entry under ``roots``, the roots'
  children at depth 1; links are never followed."""
  stack = [(r, 0) for r in roots if os.path.isdir(r)]
  while stack:
    path, depth = stack.pop()
    try:
      it = os.scandir(path)
    except OSError:  # removed meanwhile, or unreadable: nothing of it reaches the host's disk
      continue
    with it:
      for e in it:
        try:
          st = e.stat(follow_symlinks=False)
        except OSError:
          st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
          stack.append((e.path, depth + 1))
        yield e.path, st, depth + 1


def usage(roots: Sequence[str], max_bytes: int = 0, max_entries: int = 0, max_depth: int = 0) -> Usage:
  """What ``roots`` hold. A file counts its length or its allocated blocks, whichever is more (a
  sparse file counts its length: a copy may fill it in); a file with several hard links counts once.
  The walk stops once ``max_bytes``, ``max_entries`` or ``max_depth`` (0: none) is passed."""
  total, entries, deepest, seen = 0, 0, 0, set()
  for _, st, depth in _walk(roots):
    entries += 1
    if st is not None and stat.S_ISDIR(st.st_mode):
      deepest = max(deepest, depth)
    elif st is not None and stat.S_ISREG(st.st_mode) and (st.st_nlink == 1 or (st.st_dev, st.st_ino) not in seen):
      if st.st_nlink > 1:
        seen.add((st.st_dev, st.st_ino))
      total += max(st.st_size, st.st_blocks * 512)
    if ((max_bytes and total > max_bytes) or (max_entries and entries > max_entries)
            or (max_depth and deepest > max_depth)):
      break
  return Usage(total, entries, deepest)


SET_ID = stat.S_ISUID | stat.S_ISGID


def drop_set_id(roots: Sequence[str]) -> list[str]:
  """Clear the setuid and setgid bits of every regular file under ``roots``; returns their paths.

  Uid 0 in the sandbox is the host's root when the host runs as root, and an owner may ``chmod u+s``
  its own file with no capability: ``cp /bin/sh x; chmod 4755 x`` leaves a root shell in the
  workspace. The sandbox mounts nosuid, but the host does not, and a workspace may be a user's own
  folder (``composer-jax env``), not a mode-700 scratch folder. So ``Sandbox.run`` clears the bits
  after every call, once the call's processes are gone. The file is opened by ``O_PATH`` without
  following a link and changed through its descriptor."""
  cleared = []
  for path, st, _ in _walk(roots):
    if st is None or not stat.S_ISREG(st.st_mode) or not st.st_mode & SET_ID:
      continue
    try:
      fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
      continue
    try:
      now = os.fstat(fd)
      if stat.S_ISREG(now.st_mode) and now.st_mode & SET_ID:
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(now.st_mode) & ~SET_ID)
        cleared.append(path)
    except OSError:
      pass
    finally:
      os.close(fd)
  return cleared


def over(roots: Sequence[str], max_mb: int, max_entries: int, base: Usage = Usage(0, 0, 0)) -> str:
  """Why ``roots`` hold more than ``max_mb`` MB or ``max_entries`` entries (0: no bound) beyond
  ``base`` (their ``usage`` when the sandbox was made: a repository with its dependencies may start
  large), or folders deeper than ``MAX_DEPTH`` (Python 3.11's recursive ``rmtree`` and ``copytree``
  fail past ~1000 levels, and a loop of ``mkdir d; cd d`` makes 3000 in 3 s), or ""."""
  if not (max_mb or max_entries):
    return ""
  cap_bytes = base.bytes + (max_mb << 20) if max_mb else 0
  cap_entries = base.entries + max_entries if max_entries else 0
  cap_depth = max(MAX_DEPTH, base.depth)
  total, entries, depth = usage(roots, cap_bytes, cap_entries, cap_depth)
  if cap_bytes and total > cap_bytes:
    return (f"the workspace grew by more than env.workspace_mb={max_mb} MB; a coding task needs no "
            "files this large")
  if cap_entries and entries > cap_entries:
    return (f"the workspace grew by more than env.workspace_files={max_entries} files and folders; "
            "a coding task needs no more")
  if depth > cap_depth:
    return (f"the workspace holds folders more than {cap_depth} levels deep; a coding task needs no "
            "such nesting")
  return ""

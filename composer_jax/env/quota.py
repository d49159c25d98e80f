"""What a sandbox call may leave on the host's disk: a bound on the bytes and entries of its folders.

RLIMIT_FSIZE caps one file, not how many: at ~1 GB/s a command fills the host's disk in a minute,
and a million empty files make the grading copy take minutes. So the sandbox measures its writable
folders (the workspace and ``binds``) before a call, every fraction of a second during it, and after
it, and stops a call that grows them past either bound (``Sandbox.run``; the episode then ends, flagged:
``guards.quota_flag``). The walk never follows a link and stops as soon as a bound is passed, so it
costs at most one bound's worth of entries.
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


def usage(roots: Sequence[str], max_bytes: int = 0, max_entries: int = 0, max_depth: int = 0) -> Usage:
  """What ``roots`` hold. A file counts its length or its allocated blocks, whichever is more (a
  sparse file counts its length: a copy may fill it in); a file with several hard links counts once.
  The walk stops once ``max_bytes``, ``max_entries`` or ``max_depth`` (0: none) is passed."""
  total, entries, deepest, seen = 0, 0, 0, set()
  stack = [(r, 0) for r in roots if os.path.isdir(r)]
  while stack:
    path, depth = stack.pop()
    try:
      it = os.scandir(path)
    except OSError:  # removed meanwhile, or unreadable: nothing of it reaches the host's disk
      continue
    with it:
      for e in it:
        entries += 1
        try:
          st = e.stat(follow_symlinks=False)
        except OSError:
          continue
        if stat.S_ISDIR(st.st_mode):
          stack.append((e.path, depth + 1))
          deepest = max(deepest, depth + 1)
        elif stat.S_ISREG(st.st_mode) and (st.st_nlink == 1 or (st.st_dev, st.st_ino) not in seen):
          if st.st_nlink > 1:
            seen.add((st.st_dev, st.st_ino))
          total += max(st.st_size, st.st_blocks * 512)
        if ((max_bytes and total > max_bytes) or (max_entries and entries > max_entries)
                or (max_depth and deepest > max_depth)):
          return Usage(total, entries, deepest)
  return Usage(total, entries, deepest)


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

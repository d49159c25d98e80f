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


def usage(roots: Sequence[str], max_bytes: int = 0, max_entries: int = 0) -> tuple[int, int]:
  """(bytes, entries) under ``roots``. A file counts its length or its allocated blocks, whichever
  is more (a sparse file counts its length: a copy may fill it in); a file with several hard links
  counts once. The walk stops once ``max_bytes`` or ``max_entries`` (0: none) is passed."""
  total, entries, seen = 0, 0, set()
  stack = [r for r in roots if os.path.isdir(r)]
  while stack:
    try:
      it = os.scandir(stack.pop())
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
          stack.append(e.path)
        elif stat.S_ISREG(st.st_mode) and (st.st_nlink == 1 or (st.st_dev, st.st_ino) not in seen):
          if st.st_nlink > 1:
            seen.add((st.st_dev, st.st_ino))
          total += max(st.st_size, st.st_blocks * 512)
        if (max_bytes and total > max_bytes) or (max_entries and entries > max_entries):
          return total, entries
  return total, entries


def over(roots: Sequence[str], max_mb: int, max_entries: int, base: tuple[int, int] = (0, 0)) -> str:
  """Why ``roots`` hold more than ``max_mb`` MB or ``max_entries`` entries (0: no bound) beyond
  ``base`` (their ``usage`` when the sandbox was made: a repository with its dependencies may start
  large), or ""."""
  if not (max_mb or max_entries):
    return ""
  cap_bytes = base[0] + (max_mb << 20) if max_mb else 0
  cap_entries = base[1] + max_entries if max_entries else 0
  total, entries = usage(roots, cap_bytes, cap_entries)
  if cap_bytes and total > cap_bytes:
    return (f"the workspace grew by more than env.workspace_mb={max_mb} MB; a coding task needs no "
            "files this large")
  if cap_entries and entries > cap_entries:
    return (f"the workspace grew by more than env.workspace_files={max_entries} files and folders; "
            "a coding task needs no more")
  return ""

"""Cores of one machine split between the learner and its local rollout workers (``rl.worker_cpus``).

The learner's update and a worker's rollouts each run an XLA thread pool over every core, so while
both are busy they preempt each other. With ``rl.worker_cpus=N`` the workers (and the sandboxes
they start, which inherit the mask) keep to the last N cores of the process's CPU set and the
learner to the rest. Linux only; elsewhere, or when the split would leave the learner no core,
nothing is pinned. On 2 cores it did not pay (docs/rl.md, "Cores of their own"): off by default.

``rl.worker_priority`` is the other way to keep them apart: the workers (and their sandboxes) run at
a lower scheduling priority on the same cores, so the learner's threads take a core whenever they
are runnable and the rollouts get what the learner leaves idle.
"""

from __future__ import annotations

import os


def split(n_worker: int, cpus=None) -> tuple[frozenset, frozenset] | None:
  """(learner cores, worker cores) out of ``cpus`` (default: this process's CPU set), or None when
  pinning is off (``n_worker=0``, no affinity API, or fewer than n_worker + 1 cores)."""
  if n_worker <= 0 or not hasattr(os, "sched_setaffinity"):
    return None
  cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
  if len(cores) <= n_worker:
    return None
  return frozenset(cores[:-n_worker]), frozenset(cores[-n_worker:])


def pin_process(cpus) -> frozenset:
  """Pins every thread of this process to ``cpus`` (the XLA pool's threads already exist, and a
  thread's affinity is its own); threads started later inherit it. Returns the previous set."""
  before = frozenset(os.sched_getaffinity(0))
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), cpus)
    except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
      pass
  return before



def lower_priority(priority: str) -> None:
  """Every thread of this process to ``priority`` ("normal" leaves them alone; "low": nice 19;
  "idle": SCHED_IDLE). Linux keeps both per thread, and threads and processes started later inherit
  their creator's. An unprivileged process cannot raise them again, so only worker processes call
  this. Under EEVDF a woken nice-0 thread may still wait out a nice-19 thread's slice (~3 ms), while
  a SCHED_IDLE thread is preempted on the wakeup itself."""
  if priority == "normal" or not hasattr(os, "sched_setscheduler"):
    return
  for tid in os.listdir("/proc/self/task"):
    try:
      if priority == "idle":
        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
      elif os.getpriority(os.PRIO_PROCESS, int(tid)) < 19:
        os.setpriority(os.PRIO_PROCESS, int(tid), 19)
    except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
      pass

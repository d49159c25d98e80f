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


def _each_thread(fn) -> None:
  """``fn(tid)`` for every thread of this process (a thread's affinity and priority are its own)."""
  for tid in os.listdir("/proc/self/task"):
    try:
      fn(int(tid))
    except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
      pass


def pin_process(cpus) -> frozenset:
  """Pins every thread of this process to ``cpus`` (the XLA pool's threads already exist); threads
  started later inherit it. Returns the previous set."""
  before = frozenset(os.sched_getaffinity(0))
  _each_thread(lambda tid: os.sched_setaffinity(tid, cpus))
  return before


def lower_priority(priority: str) -> None:
  """Every thread of this process to ``priority`` ("normal" leaves them alone; "low": nice 19;
  "idle": SCHED_IDLE). Threads and processes started later inherit their creator's. An unprivileged
  process cannot raise them again, so only worker processes call this. A learner-like XLA job beside
  a busy worker took 1.22x its time alone at nice 19 and 1.11x at SCHED_IDLE, which the scheduler
  preempts as soon as another thread wakes (experiments/cpu_priority.py)."""
  if priority == "normal" or not hasattr(os, "sched_setscheduler"):
    return

  def lower(tid: int) -> None:
    if priority == "idle":
      os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    elif os.getpriority(os.PRIO_PROCESS, tid) < 19:  # never back up from a higher nice value
      os.setpriority(os.PRIO_PROCESS, tid, 19)

  _each_thread(lower)

"""rl.worker_cpus and rl.worker_priority: the learner and the local rollout workers kept apart on one machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from composer_jax.config import ConfigError, load_config
from composer_jax.rl.cpus import split

needs_two = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs the Linux affinity API and 2 cores")


def _runs_ok(code: str) -> None:
  """Runs ``code`` in a fresh interpreter (so this test process keeps its own cores and priority)
  and expects it to print ok."""
  out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_split_gives_the_workers_the_last_cores_and_never_leaves_the_learner_none():
  assert split(1, {0, 1}) == ({0}, {1})
  assert split(2, {4, 1, 7, 3}) == ({1, 3}, {4, 7})
  assert split(0, {0, 1}) is None  # off
  assert split(1, {5}) is None  # one core: nothing to split
  assert split(2, {0, 1}) is None
  with pytest.raises(ConfigError, match="rl.worker_cpus"):
    load_config(None, ["rl.worker_cpus=-1"])


@needs_two
def test_pin_process_moves_threads_that_already_exist():
  """XLA's pool threads exist before the learner is pinned: every thread of the process must move,
  not only the caller (a subprocess, so this test's own process keeps its cores)."""
  code = """
import os, threading, time
from composer_jax.rl.cpus import pin_process
go = threading.Event()
t = threading.Thread(target=go.wait); t.start()
before = pin_process({0})
tids = os.listdir("/proc/self/task")
masks = {tid: os.sched_getaffinity(int(tid)) for tid in tids}
go.set(); t.join()
assert len(tids) >= 2 and all(m == {0} for m in masks.values()), masks
late = threading.Thread(target=lambda: None); late.start(); late.join()  # inherits from its creator
pin_process(before)
assert os.sched_getaffinity(0) == before
print("ok")
"""
  _runs_ok(code)


class AffinityWorker:
  """A stand-in rollout worker that reports the cores it may run on."""

  def __init__(self, cfg_dict, tok_path, worker_id, seed, cpus=None):
    if cpus:
      from composer_jax.rl.cpus import pin_process
      pin_process(set(cpus))

  def push(self, chain):
    pass

  def info(self):
    import os
    return {"cpus": sorted(os.sched_getaffinity(0))}


def _thread_masks() -> dict:
  """{thread id: its CPU set} for this process's threads; one that ends while listed is skipped."""
  out = {}
  for tid in os.listdir("/proc/self/task"):
    try:
      out[tid] = os.sched_getaffinity(int(tid))
    except ProcessLookupError:
      pass
  return out


@needs_two
def test_orchestrator_pins_workers_and_learner_and_gives_the_cores_back(monkeypatch):
  pytest.importorskip("ray")
  from composer_jax.rl.orchestrator import Orchestrator
  monkeypatch.setenv("PYTHONPATH", os.getcwd())  # the actor imports this module
  cores = sorted(os.sched_getaffinity(0))
  before = _thread_masks()
  cfg = load_config(None, ["rl.num_workers=1", "rl.async=true", "rl.worker_cpus=1"])
  orch = Orchestrator(cfg, "", log=lambda m: None, worker_cls=AffinityWorker)
  try:
    assert os.sched_getaffinity(0) == set(cores[:-1])
    (info,) = orch.worker_info().values()
    assert info["cpus"] == cores[-1:]
  finally:
    orch.shutdown()
  after = {tid: m for tid, m in _thread_masks().items() if tid in before}
  assert after and after == {tid: before[tid] for tid in after}  # (some threads have ended meanwhile)


needs_sched = pytest.mark.skipif(
    not hasattr(os, "sched_setscheduler") or os.getpriority(os.PRIO_PROCESS, 0) != 0
    or os.sched_getscheduler(0) != os.SCHED_OTHER,
    reason="needs Linux scheduling policies and a test run at normal priority")


@needs_sched
def test_a_rollout_worker_puts_every_thread_at_rl_worker_priority():
  """rl.worker_priority=idle: the worker moves the threads it already has and those it starts later
  (XLA's pool, the sandboxes' launcher) to SCHED_IDLE; a subprocess, since an unprivileged process
  cannot come back."""
  code = """
import os, threading
from composer_jax.config import load_config
from composer_jax.rl.rollout_worker import RolloutWorker
go = threading.Event()
t = threading.Thread(target=go.wait, daemon=True); t.start()  # a thread older than the worker
# A gang member: nothing touches JAX before its ``join``, so the constructor is all there is.
cfg = load_config(None, ["rl.worker_priority=idle", "rl.worker_hosts=2", "rl.worker_devices=1",
                        "rl.learner_sampler=mesh"])
w = RolloutWorker(cfg.to_dict(), "", 0, 0, member=1)
pols = {tid: os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")}
late = []
t2 = threading.Thread(target=lambda: late.append(os.sched_getscheduler(threading.get_native_id())))
t2.start(); t2.join(); go.set(); t.join()
import subprocess, sys
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                       capture_output=True, text=True, check=True).stdout.strip()
assert len(pols) >= 2 and set(pols.values()) == {os.SCHED_IDLE}, pols
assert late == [os.SCHED_IDLE], late
assert child == str(os.SCHED_IDLE), child  # a process it starts (a sandbox) inherits it
print("ok")
"""
  _runs_ok(code)
  with pytest.raises(ConfigError, match="rl.worker_priority"):
    load_config(None, ["rl.worker_priority=lowest"])


@needs_sched
def test_low_priority_is_nice_19_and_normal_leaves_threads_alone():
  code = """
import os
from composer_jax.rl.cpus import lower_priority
lower_priority("normal")
assert os.getpriority(os.PRIO_PROCESS, 0) == 0 and os.sched_getscheduler(0) == os.SCHED_OTHER
lower_priority("low")
assert os.getpriority(os.PRIO_PROCESS, 0) == 19 and os.sched_getscheduler(0) == os.SCHED_OTHER
print("ok")
"""
  _runs_ok(code)

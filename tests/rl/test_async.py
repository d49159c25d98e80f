"""Asynchronous RL: the `rl.async` key, the ledger of handed-out work across a checkpoint, and a run
on Ray with a rollout worker SIGKILLed mid-episode (its work is re-queued, the worker replaced, the
run finishes with every task trained exactly once)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

from composer_jax.config import ConfigError, load_config
from composer_jax.env import sandbox
from composer_jax.rl.curriculum import TaskStream
from composer_jax.rl.orchestrator import Ledger
from tests.rl.conftest import DYNAMIC, MODEL, RL


def _jsonl(path) -> list:
  with open(path) as f:
    return [json.loads(x) for x in f if x.strip()]


def test_async_key_alias(tmp_path):
  assert load_config(None, ["rl.async=true"]).rl.async_ is True
  assert load_config(None, ["rl.async_=true"]).rl.async_ is True
  p = tmp_path / "c.yaml"
  p.write_text("rl:\n  async: true\n  num_workers: 2\n  max_staleness: 0\n")
  cfg = load_config(str(p))
  assert cfg.rl.async_ and cfg.rl.num_workers == 2 and cfg.rl.max_staleness == 0
  with pytest.raises(ConfigError, match="rl.max_staleness"):
    load_config(None, ["rl.max_staleness=-1"])
  with pytest.raises(ConfigError, match="rl.full_sync_every"):
    load_config(None, ["rl.full_sync_every=0"])
  with pytest.raises(ConfigError, match="rl.object_store_mb"):
    load_config(None, ["rl.object_store_mb=10"])


def test_sized_object_store_is_preallocated_and_serves_weights():
  """rl.object_store_mb starts a local Ray with a store of that size, its pages faulted in up front;
  a weight update goes through it bit-exactly."""
  ray = pytest.importorskip("ray")
  import numpy as np

  from composer_jax.rl import weights as W
  from composer_jax.rl.orchestrator import _local_ray
  assert _local_ray(load_config(None, ["rl.num_workers=3"]).rl) == {"num_cpus": 3}
  kw = _local_ray(load_config(None, ["rl.object_store_mb=80"]).rl)
  assert kw["object_store_memory"] == 80 * 2**20 and kw["_system_config"] == {"preallocate_plasma_memory": True}
  ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
           **kw)
  try:
    assert ray.available_resources()["object_store_memory"] == pytest.approx(80 * 2**20, rel=0.01)
    a = np.arange(3 * 2**20, dtype=np.float32)
    got = W.decode(ray.get(ray.put(W.encode_full(1, ["a"], [a]))), None)[0]
    np.testing.assert_array_equal(got, a)
  finally:
    ray.shutdown()


def test_ledger_survives_a_crash_without_losing_or_repeating_a_task():
  """Groups handed out, some trained, some in flight, one re-queued (dead worker); the state goes
  through JSON (the checkpoint); the resumed ledger hands the pending tasks out again first, and over
  the run every task of the epoch is trained exactly once."""
  n = 7
  led = Ledger(TaskStream(n, seed=3))
  trained = []
  a = led.take(3)
  led.done(a[0][0])
  trained.append(a[0][1])
  led.requeue(a[1][0])  # its worker died: handed out again
  b = led.take(2)  # the re-queued task comes first
  assert b[0][1] == a[1][1]
  led.done(b[0][0])
  trained.append(b[0][1])
  state = json.loads(json.dumps(led.state()))  # checkpoint; pending: a[2], b[1]
  assert sorted(state["queue"]) == sorted([a[2][1], b[1][1]])
  # kill -9 here; the resumed run:
  led2 = Ledger(TaskStream(n, seed=3))
  led2.set_state(state)
  assert led2.outstanding() == 0 and led2.next_gid == led.next_gid
  while len(trained) < n:
    (gid, task), = led2.take(1)
    led2.done(gid)
    trained.append(task)
  assert sorted(trained) == list(range(n))
  # ... and the next epoch starts where the first one ended.
  assert led2.stream.epoch in (0, 1) and led2.stream.state()["n"] == n


class SleepWorker:
  """A stand-in rollout worker (no model): holds the pushed weight version, 'plays' a unit by
  sleeping, returns one fake rollout per group."""

  def __init__(self, cfg_dict, tok_path, worker_id, seed):
    self.id, self.version, self.busy = worker_id, -1, False

  def push(self, chain):
    self.version = chain[-1][0]

  def info(self):
    return {"pid": os.getpid(), "busy": self.busy, "version": self.version}

  def run(self, unit):
    self.busy = True
    time.sleep(0.4)
    self.busy = False
    return {"groups": {gid: [(task, self.version)] for gid, task in unit}, "worker": self.id}


@contextlib.contextmanager
def _orchestrator(worker_cls, workers: int = 1, version: int = 3, log=lambda m: None):
  """A local Ray of 2 CPUs and an Orchestrator of stand-in workers holding weights ``version``."""
  ray = pytest.importorskip("ray")
  import jax.numpy as jnp

  from composer_jax.rl.orchestrator import Orchestrator
  cfg = load_config(None, [f"rl.num_workers={workers}", "rl.async=true"])
  ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
           num_cpus=2, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
  try:
    orch = Orchestrator(cfg, "", log=log, worker_cls=worker_cls)
    orch.broadcast({"w": jnp.ones(4)}, version)
    yield orch
  finally:
    ray.shutdown()


def test_orchestrator_requeues_and_replaces_a_killed_worker(tmp_path):
  """Short form of the fault test (runs by default): a worker SIGKILLed mid-unit loses every unit it
  held; they come back as lost, a replacement gets the current weights, and re-submitted units
  finish: each group is played exactly once."""
  with _orchestrator(SleepWorker) as orch:
    led = Ledger(TaskStream(5, seed=0))
    for _ in range(3):
      orch.submit(led.take(2))
    deadline = time.time() + 60
    while not (info := next(iter(orch.worker_info().values())))["busy"] and time.time() < deadline:
      time.sleep(0.05)
    os.kill(info["pid"], signal.SIGKILL)
    played = {}
    while orch.inflight:
      results, lost = orch.wait(timeout=5)
      for unit in lost:
        for gid, _ in unit:
          led.requeue(gid)
        orch.submit(led.take(len(unit)))
      for res in results:
        for gid, got in res["groups"].items():
          assert gid not in played
          played[gid] = got[0]
          led.done(gid)
    assert orch.counts["worker_deaths"] == 1 and orch.counts["requeued"] == 6
    # Every task handed out was played once: the first 6 of the stream (5 + one of the next epoch).
    want = TaskStream(5, seed=0).take(6)
    assert sorted(t for t, _ in played.values()) == sorted(want) and led.outstanding() == 0
    assert all(v == 3 for _, v in played.values())  # the replacement got the broadcast weights
    orch.shutdown()


class ScratchWorker(SleepWorker):
  """Claims a scratch folder as ``RolloutWorker`` does and leaves an episode workspace in it while a
  unit runs (and never finishes one)."""

  def __init__(self, *a):
    super().__init__(*a)
    import tempfile

    from composer_jax.env import scratch
    self.scratch, _ = scratch.claim()
    self.tempfile = tempfile

  def info(self):
    return {**super().info(), "scratch": self.scratch}

  def run(self, unit):
    self.busy = True
    self.tempfile.mkdtemp(prefix="cj-ep-")
    time.sleep(120)


def test_shutdown_mid_unit_removes_the_workers_episode_folders():
  """A run ends with its workers mid-unit (the stage is over; their episodes are not needed):
  ``shutdown`` kills them and removes their scratch folders, workspaces included, once they are gone."""
  with _orchestrator(ScratchWorker, workers=2) as orch:
    led = Ledger(TaskStream(4, seed=0))
    for _ in range(2):
      orch.submit(led.take(1))
    deadline = time.time() + 60
    while time.time() < deadline:
      infos = list(orch.worker_info().values())
      if all(i["busy"] and os.listdir(i["scratch"]) for i in infos):
        break
      time.sleep(0.05)
    assert len(infos) == 2 and all(os.listdir(i["scratch"]) for i in infos)
    orch.shutdown()
    assert not any(os.path.exists(i["scratch"]) for i in infos)


class PoisonWorker(SleepWorker):
  """Raises on any unit that holds task 99 (as a grading bug would), plays the rest."""

  def run(self, unit):
    if any(task == 99 for _, task in unit):
      raise SystemError("AST constructor recursion depth mismatch (before=30, after=27)")
    return super().run(unit)


def test_a_unit_that_raises_is_requeued_on_a_new_worker_and_a_repeating_error_stops_the_run():
  """A unit whose worker raised (not died) comes back lost; that worker is killed and replaced (its
  engine may hold the unit's slots) and the run goes on. The fourth raising unit is raised to the
  caller: an error that repeats is a bug, and re-queuing it forever would burn the run."""
  from composer_jax.rl.orchestrator import MAX_UNIT_ERRORS
  logs = []
  with _orchestrator(PoisonWorker, log=logs.append) as orch:
    import ray

    def drain():
      got, lost = [], []
      while orch.inflight:
        r, lo = orch.wait(timeout=5)
        got += r
        lost += lo
      return got, lost

    orch.submit([(0, 99)])
    got, lost = drain()
    assert got == [] and lost == [[(0, 99)]]
    assert orch.counts["unit_errors"] == 1 and orch.counts["worker_deaths"] == 0
    assert orch.counts["requeued"] == 1 and len(orch.workers) == 1 and 0 not in orch.workers
    assert "raised" in logs[-1] and "recursion depth mismatch" in logs[-1]
    orch.submit([(1, 4)])  # the replacement plays, with the broadcast weights
    got, _ = drain()
    assert got[0]["groups"] == {1: [(4, 3)]}
    for _ in range(MAX_UNIT_ERRORS - 1):
      orch.submit([(2, 99)])
      drain()
    orch.submit([(3, 99)])
    with pytest.raises(ray.exceptions.RayTaskError, match="recursion depth mismatch"):
      drain()
    orch.shutdown()


requires_bwrap = pytest.mark.skipif(not sandbox.bwrap_available(),
                                    reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")


@pytest.mark.slow
@requires_bwrap
def test_async_run_survives_a_killed_worker(world):
  """1 Ray worker, 2 learner steps of 2 tasks x 2 samples. The worker is SIGKILLed while it plays the
  first unit; its unit is re-queued, a replacement joins, the run finishes. Every trained trajectory
  is within rl.max_staleness of the learner; the 4 tasks are each trained once (one epoch). Then a
  resumed run trains the tasks the checkpoint held as pending. The workers sample on a mesh of 2 fake
  CPU devices (rl.worker_devices=2, the experts split over them): the replacement builds it too.
  The first run streams its units into one decode batch (rl.worker_stream), the resumed one plays
  one unit at a time."""
  pytest.importorskip("ray")
  from composer_jax.rl.async_loop import AsyncRLRun
  root, init, tasks = world
  out = root / "async"
  cfg = load_config(None, MODEL + RL + [f"rl.tasks={tasks}", "rl.async=true", "rl.num_workers=1",
                                        "rl.max_staleness=1", "rl.full_sync_every=2", "rl.steps=2",
                                        "rl.worker_devices=2", "rl.worker_mesh={expert: 2}",
                                        "rl.worker_stream=true"])
  run = AsyncRLRun(cfg, str(out), init=init)
  try:
    run.top_up()
    deadline = time.time() + 240
    while True:  # wait until the worker is inside an episode (its workspace made), then kill it
      info = next(iter(run.orch.worker_info().values()))
      if (info["busy"] and os.listdir(info["scratch"])) or time.time() > deadline:
        break
      time.sleep(0.2)
    assert info["busy"] and os.listdir(info["scratch"]), "the worker never started an episode"
    os.kill(info["pid"], signal.SIGKILL)
    last = run.run()
    assert not os.path.exists(info["scratch"])  # its replacement swept them (env/scratch.py)
  finally:
    run.orch.shutdown()
  recs = _jsonl(out / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2]
  assert last["worker_deaths"] == 1 and last["requeued"] >= 1
  for r in recs:
    assert r["staleness_max"] <= 1 and 0 <= r["learner_idle_frac"] <= 1
    assert r["rollout_tokens_per_s"] >= 0 and r["completion_tokens_mean"] > 0
    assert r["worker_devices"] == 2  # every worker's sampler spread over its two devices
  # Tokens count when their unit arrives: a step whose groups all came in during the step before
  # (learner idle 0) sampled none in its own window.
  assert sum(r["rollout_tokens_per_s"] for r in recs) > 0
  assert recs[0]["broadcast_kind"] == "delta" and recs[1]["broadcast_kind"] == "full"
  seen = [r["task"] for r in _jsonl(out / "rollouts.jsonl")]
  assert len(seen) == 8  # 2 steps x 2 groups of 2
  # The checkpoint carries the ledger: tasks handed out but not trained are pending there.
  with open(out / "checkpoints" / "2" / "data" / "metadata") as f:
    data = json.load(f)
  assert data["version"] == 2 and data["ledger"]["next_gid"] >= 5
  pending = data["ledger"]["queue"]
  assert pending, "work handed out at the checkpoint (the workers were topped up before the update)"
  # None lost: every task of the first epoch was trained or is pending. Not "each once in steps 1-2":
  # Ray may run a threaded actor's queued units out of order (measured: the replacement worker
  # finished the next epoch's unit before the re-queued one), so the learner, which trains the groups
  # as they arrive, can meet a task of the next epoch first.
  assert set(seen) | {run.tasks[i].instance_id for i in pending} == {t.instance_id for t in run.tasks}
  # Resume (as after kill -9 of the learner: the checkpoint is the only state): the pending tasks are
  # handed out first and trained at step 3; nothing is lost, the stream continues.
  # Step 3 also runs DAPO's dynamic sampling: without shaping penalties every group of the random
  # policy scores 0 alike, so it takes 2 rounds x 2 groups, finds none informative and skips the update.
  # And it broadcasts from the shards of its 8-device learner (rl.broadcast_from=shards): the worker
  # rebuilds every tensor from the pieces.
  cfg3 = load_config(None, MODEL + RL + [f"rl.tasks={tasks}", "rl.async=true", "rl.num_workers=1",
                                         "rl.max_staleness=1", "rl.steps=3", *DYNAMIC,
                                         "rl.broadcast_from=shards"])
  run = AsyncRLRun(cfg3, str(out), resume=True)
  try:
    assert run.version == 2 and list(run.ledger.queue) == pending
    run.run()
  finally:
    run.orch.shutdown()
  recs = _jsonl(out / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 3]
  assert (recs[2]["groups_drawn"], recs[2]["groups_informative"], recs[2]["update_skipped"]) == (4, 0, 1)
  assert recs[2]["grad_norm"] == 0 and recs[2]["pass_rate"] == 0
  step3 = [r for r in _jsonl(out / "rollouts.jsonl") if r["step"] == 3]
  assert len(step3) == 8 and not any(r["trained"] for r in step3[4:])  # 2 set aside, logged too
  step3 = {r["task"] for r in step3 if r["trained"]}
  assert step3 <= {run.tasks[i].instance_id for i in pending}  # the pending tasks are handed out first

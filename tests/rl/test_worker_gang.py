"""A rollout worker spanning several processes (``rl.worker_hosts``, rl/rollout_worker.py): two Ray
actors x 2 fake CPU devices joined by jax.distributed (gloo), one 4-device sampler mesh.

  * it plays a unit exactly as one actor over 4 devices on the same mesh does (the same episodes);
  * a member SIGKILLed while the gang plays a unit takes the whole gang with it: the unit comes back
    lost, a new gang (new placement group, new jax.distributed job) replaces it, gets the current
    weights and plays the re-submitted unit;
  * and asynchronous RL runs on such a gang.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from composer_jax.config import load_config
from composer_jax.env import sandbox
from tests.rl.conftest import MODEL, RL

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sandbox.bwrap_available(),
                                 reason="bubblewrap cannot run here (apt-get install -y bubblewrap)")]

ASYNC = ["rl.async=true", "rl.num_workers=1", "rl.object_store_mb=80", "rl.weight_delta=false",
         "rl.learner_sampler=mesh", "rl.worker_mesh={expert: 2, tensor: 2}"]
GANG = ["rl.worker_hosts=2", "rl.worker_devices=2"]
ONE = ["rl.worker_hosts=1", "rl.worker_devices=4"]


def _play(orch, unit, timeout=300) -> dict:
  """Submit one unit and wait for its result."""
  orch.submit(unit)
  deadline = time.time() + timeout
  while time.time() < deadline:
    results, lost = orch.wait(timeout=1.0)
    assert not lost, "no worker should die here"
    if results:
      return results[0]
  raise AssertionError("the unit did not finish")


def _versions(ray, orch, wid: int) -> list[int]:
  """The weight version each member of gang ``wid`` holds."""
  return [ray.get(m.info.options(concurrency_group="weights").remote())["version"]
          for m in [orch.workers[wid], *orch.gangs[wid][1]]]


def _messages(result) -> list:
  return [[r.traj.messages for r in rs] for _, rs in sorted(result["groups"].items())]


def test_a_gang_plays_like_one_worker_and_is_replaced_whole(world):
  ray = pytest.importorskip("ray")
  from composer_jax.rl.loop import load_policy
  from composer_jax.rl.orchestrator import Orchestrator
  _, init, tasks = world
  tok = os.path.join(init, "tokenizer.json")
  _, _, _, params, rest = load_policy(init)
  unit = [(0, 0), (1, 1)]  # two groups of rl.group_size=2 episodes: the 4 slots of rl.decode_batch
  played = {}
  for name, layout in (("one", ONE), ("gang", GANG)):
    cfg = load_config(None, MODEL + RL + ASYNC + layout + [f"rl.tasks={tasks}"])
    orch = Orchestrator(cfg, tok, log=lambda m: None)
    try:
      orch.broadcast((params, rest), 0)
      res = _play(orch, unit)
      assert res["devices"] == 4  # one actor's 4 devices, or 2 members x 2
      played[name] = _messages(res)
      if name == "gang":
        # Each member pulled only its devices' blocks: half of every expert tensor (the mesh splits
        # the experts over the two members) and the rest whole.
        full = orch.publisher.last_bytes
        for m in [orch.workers[0], *orch.gangs[0][1]]:
          got = ray.get(m.info.options(concurrency_group="weights").remote())["fetched_bytes"]
          assert 0.5 * full < got < 0.9 * full, (got, full)
        # A new version: member 0 swaps to it between decode steps and names it to the follower,
        # which takes it from its own copy of the chain.
        orch.broadcast((params, rest), 1)
        res = _play(orch, unit)
        assert res["swaps"] == 1
        assert _versions(ray, orch, 0) == [1, 1]
        # Kill the follower while member 0 is inside the unit (in a collective or a tool call).
        orch.broadcast((params, rest), 2)
        orch.submit(unit)
        deadline = time.time() + 120
        while not (info := orch.worker_info()[0])["busy"] and time.time() < deadline:
          time.sleep(0.05)
        assert info["busy"], "member 0 never started the unit"
        follower = orch.gangs[0][1][0]
        pid = ray.get(follower.info.options(concurrency_group="weights").remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        lost = []
        deadline = time.time() + 120
        while not lost and time.time() < deadline:
          results, lost = orch.wait(timeout=1.0)
          assert not results, "the gang lost a member: its unit cannot finish"
        assert lost == [unit] and orch.counts["worker_deaths"] == 1
        assert list(orch.workers) == [1] and list(orch.gangs) == [1]  # a whole new gang
        res = _play(orch, unit)
        assert res["worker"] == 1 and res["devices"] == 4
        assert _versions(ray, orch, 1) == [2, 2]  # the replacement took the current weights
    finally:
      orch.shutdown()
  # The same episodes from the same weights and seed: the gang's mesh is one actor's, over 2 hosts.
  assert played["gang"] == played["one"]


def test_async_rl_on_a_gang(world):
  """Two learner steps with a 2 x 2 gang: the gang takes each new version between decode steps
  (member 0 names it to the other in every call) and the run finishes. Its units stream into one
  decode batch (rl.worker_stream; the test above plays one unit at a time)."""
  pytest.importorskip("ray")
  from composer_jax.rl.async_loop import AsyncRLRun
  root, init, tasks = world
  out = root / "gang_rl"
  cfg = load_config(None, MODEL + RL + ASYNC + GANG + [f"rl.tasks={tasks}", "rl.steps=2",
                                                       "rl.max_staleness=1", "rl.worker_stream=true"])
  AsyncRLRun(cfg, str(out), init=init).run()
  with open(out / "metrics.jsonl") as f:
    recs = [json.loads(x) for x in f if x.strip()]
  assert [r["step"] for r in recs] == [1, 2]
  assert all(r["worker_devices"] == 4 and r["worker_deaths"] == 0 for r in recs)
  assert all(r["staleness_max"] <= 1 and r["completion_tokens_mean"] > 0 for r in recs)

"""Rollout workers over several devices (rl.worker_devices, rl/worker_devices.py): the one-line
refusals of a layout, the actor's resources and environment, and a sampler whose weights are placed
shard by shard on a tensor x expert mesh of fake CPU devices, against the same sampler on one device.
(The Ray worker itself on a 2-device mesh: tests/rl/test_async.py's fault test.)"""

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import ConfigError, load_config
from composer_jax.env import sandbox
from composer_jax.rl import worker_devices as WD
from composer_jax.rl.sampler import Engine, Request
from composer_jax.rl.weights import to_device
from composer_jax.train.step import split_model
from tests.rl.conftest import MODEL, RL
from tests.rl.test_sampler import _setup

LAYOUT = ["model.vocab_size=96", "rl.decode_batch=4", "rl.worker_devices=4",
          "rl.worker_mesh={tensor: 2, expert: 2}"]


@pytest.mark.parametrize("overrides,match", [
    (["rl.worker_mesh={tensor: 2}"], r"rl.worker_mesh=\{'tensor': 2\} needs rl.worker_devices >= 1"),
    (["rl.worker_devices=2", "rl.worker_mesh={tensor: 4}"], "spans 4 devices but rl.worker_devices=2"),
    (["rl.worker_devices=2", "rl.worker_mesh={tesnor: 2}"], "rl.worker_mesh.tesnor: unknown mesh axis"),
    (["rl.worker_devices=4", "rl.worker_mesh={expert: 4}", "rl.decode_batch=6"],
     r"rl.decode_batch=6 is not divisible by the worker mesh's batch axes \(data x fsdp x expert = 4\)"),
    (["rl.worker_devices=2", "rl.worker_mesh={context: 2}"], "rl.worker_mesh.context must be 1"),
    (["rl.worker_platform=gpu"], "rl.worker_platform=gpu needs rl.worker_devices >= 1"),
    (["rl.worker_devices=-1"], "rl.worker_devices=-1 must be >= 0"),
    (["rl.learner_sampler=mesh", "mesh.context=2"],
     "rl.learner_sampler=mesh samples on the trainer's mesh, whose context axis is 2"),
    (["rl.worker_hosts=0"], "rl.worker_hosts=0 must be >= 1"),
    (["rl.worker_hosts=2"], "rl.worker_hosts=2 needs rl.worker_devices >= 1"),
    (["rl.worker_hosts=2", "rl.worker_devices=2", "rl.async=false"],
     "rl.worker_hosts=2 is the Ray rollout workers' layout, but rl.async=false"),
    (["rl.worker_hosts=2", "rl.worker_devices=2"], "rl.worker_hosts=2: .* set rl.learner_sampler=mesh"),
    # A gang's mesh spans hosts x devices: {tensor: 2} is not 2 x 2.
    (["rl.worker_hosts=2", "rl.worker_devices=2", "rl.learner_sampler=mesh", "rl.worker_mesh={tensor: 2}"],
     r"spans 2 devices but rl.worker_devices=2 x rl.worker_hosts=2 = 4"),
    (["rl.broadcast_from=shards", "rl.async=false"],
     "rl.broadcast_from=shards is where the Ray workers' weights come from, but rl.async=false"),
    # Every parameter is laid out on the abstract model: 2048 ids do not split over tensor=3.
    (["rl.worker_devices=3"], r"rl.worker_mesh .*'tensor': 3.*dim 'vocab' of size 2048 is not divisible"),
])
def test_a_bad_worker_layout_is_refused_in_one_line(overrides, match):
  with pytest.raises(ConfigError, match=match) as e:
    load_config("configs/tiny.yaml", overrides)
  assert "\n" not in str(e.value)


def test_actor_resources_and_environment():
  shipped = load_config("configs/tiny.yaml")  # its workers' own XLA flags, never the learner's
  assert WD.actor_env(shipped) == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": shipped.rl.worker_xla_flags}
  plain = ["rl.worker_xla_flags="]
  cpu = load_config("configs/tiny.yaml", plain)
  assert WD.actor_resources(cpu) == {"num_cpus": 1}
  assert WD.actor_env(cpu) == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # the learner's flags stay out
  assert WD.mesh_sizes(cpu)["tensor"] == 1 and WD.sampler_mesh(cpu) is None
  gpu = load_config("configs/tiny.yaml", plain + ["rl.worker_devices=8", "rl.worker_platform=gpu",
                                                  "rl.worker_mesh={expert: -1, tensor: 2}"])
  assert WD.actor_resources(gpu) == {"num_cpus": 1, "num_gpus": 8}
  assert WD.actor_env(gpu) == {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": ""}
  assert WD.mesh_sizes(gpu) == {"data": 1, "fsdp": 1, "expert": 4, "context": 1, "tensor": 2}
  tpu = load_config("configs/tiny.yaml", plain + ["rl.worker_devices=4", "rl.worker_platform=tpu"])
  assert WD.actor_resources(tpu) == {"num_cpus": 1, "resources": {"TPU": 4}}
  fake = load_config("configs/tiny.yaml", plain + ["rl.worker_devices=2"])
  assert WD.actor_env(fake)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
  own = load_config("configs/tiny.yaml", ["rl.worker_devices=2",
                                          "rl.worker_xla_flags=--xla_cpu_multi_thread_eigen=false"])
  assert WD.actor_env(own)["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2 "
                                            "--xla_cpu_multi_thread_eigen=false")
  with pytest.raises(ConfigError, match="rl.worker_devices=16, but this rollout worker sees 8 cpu"):
    WD.sampler_mesh(load_config("configs/tiny.yaml", ["rl.worker_devices=16", "rl.worker_mesh={expert: 16}"]))


def test_sharded_sampler_matches_the_one_device_sampler():
  """The worker's path: the broadcast's host tensors (leaf order of (params, rest)) placed with
  leaf_shardings on a tensor=2 x expert=2 mesh, each device holding only its slices (the routed
  experts split 2 ways, the vocabulary 2 ways), then four episodes decoded on that mesh. Against the
  same engine on one device with the same seed: the same tokens, the same routed experts for every
  fed token, log-probs within 1e-5 (float32; the sharded reductions sum in another order)."""
  cfg, model = _setup(LAYOUT)
  graphdef, params, rest = split_model(model)
  host = [np.asarray(a) for a in jax.tree.leaves((params, rest))]
  treedef = jax.tree.structure((params, rest))
  mesh = WD.sampler_mesh(cfg)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 2, "context": 1, "tensor": 2}
  shardings = WD.leaf_shardings(cfg, nnx.split(model, nnx.Param, ...)[1:], mesh)
  assert len(shardings) == len(host)
  p2, r2 = jax.tree.unflatten(treedef, to_device(host, shardings))
  w_up = p2["layers"][2]["mlp"]["w_up"][...]  # [experts, d, ffn]
  assert w_up.addressable_shards[0].data.shape[0] == cfg.model.n_routed_experts // 2
  emb = p2["embed"][...]
  assert emb.addressable_shards[0].data.shape[0] == cfg.model.vocab_size // 2

  def play(params, rest, mesh):
    rs = np.random.RandomState(7)
    eng = Engine(graphdef, params, rest, cfg, n_slots=4, max_len=128, seed=5, mesh=mesh)
    return eng.run([Request(k, [int(t) for t in rs.randint(0, 96, n)], 10, ())
                    for k, n in zip("abcd", (5, 11, 3, 19))])

  one, sharded = play(params, rest, None), play(p2, r2, mesh)
  for a, b in zip(one, sharded):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.context_experts, b.context_experts)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.skipif(not sandbox.bwrap_available(), reason="bubblewrap cannot run here")
def test_sync_rl_samples_on_the_worker_mesh_with_the_trainers_weights(world, tmp_path):
  """rl.async=false with rl.worker_devices=2: the leader's own engine decodes on an expert=2 mesh of
  the weights it is given after each update, and the learner's forward agrees with the sampler
  (log-prob gap under 1e-4, routing mismatch under 1 %, as on one device in test_loop.py)."""
  from composer_jax.rl.loop import RLRun
  _, init, tasks = world
  cfg = load_config(None, MODEL + RL + [f"rl.tasks={tasks}", "rl.steps=1", "rl.worker_devices=2",
                                        "rl.worker_mesh={expert: 2}"])
  run = RLRun(cfg, str(tmp_path / "rl"), init=init)
  devices = lambda: {d for a in jax.tree.leaves(run.engine.params) for d in a.devices()}
  assert len(devices()) == 2 and run.engine.mesh.shape["expert"] == 2
  last = run.run()
  assert last["train_infer_logprob_abs_diff"] < 1e-4 and last["routing_mismatch_frac"] < 0.01
  assert run.engine.version == 1 and len(devices()) == 2  # the update's weights, on the mesh again


def test_a_follower_engine_replaying_the_leaders_calls_holds_the_same_cache():
  """rl.learner_sampler=mesh on several processes: the leader's engine sends each model call's host
  inputs through ``tell``; a follower's engine ``replay``s them. Here both engines share one process
  (tensor=2 x expert=2): after the leader's four episodes, the follower has made the same calls, got
  the same outputs and holds bit-identical cache buffers, their slot rows split over the batch
  axis (expert=2)."""
  cfg, model = _setup(LAYOUT)
  graphdef, params, rest = split_model(model)
  mesh = WD.sampler_mesh(cfg)
  calls = []

  def tell(op, arrays, **kw):
    assert op == "engine"
    calls.append(({k: np.copy(v) for k, v in arrays.items()}, kw["view"]))
    return arrays

  make = lambda tell: Engine(graphdef, params, rest, cfg, n_slots=4, max_len=128, seed=5, mesh=mesh,
                             tell=tell)
  leader, follower = make(tell), make(None)
  c = leader._bufs[0][0]
  assert c.addressable_shards[0].data.shape[0] == 2  # 4 slots over expert=2
  outs, own = [], leader.replay  # the leader's engine makes each call through replay too
  leader.replay = lambda args, view: outs.append(own(args, view)) or outs[-1]
  rs = np.random.RandomState(7)
  gens = leader.run([Request(k, [int(t) for t in rs.randint(0, 96, n)], 10, ())
                     for k, n in zip("abcd", (5, 11, 3, 19))])
  assert len(calls) == len(outs) == leader.stats["steps"] > 10 and all(len(g.tokens) == 10 for g in gens)
  for (args, view), want in zip(calls, outs):
    for a, b in zip(follower.replay(args, view), want):  # sampled ids, log-probs, routed experts
      np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(leader._bufs), jax.tree.leaves(follower._bufs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(leader._bufs[0][0]).any()


@pytest.mark.slow
@pytest.mark.skipif(not sandbox.bwrap_available(), reason="bubblewrap cannot run here")
def test_sync_rl_samples_on_the_trainers_mesh(world, tmp_path):
  """rl.learner_sampler=mesh: the learner's own engine decodes with the trainer's arrays themselves
  (no gather, no copy) on the trainer's 8-device mesh, before and after the update, and the
  end-of-run evaluation runs on it too; learner and sampler agree as on one device."""
  from composer_jax.rl.loop import RLRun
  _, init, tasks = world
  cfg = load_config(None, MODEL + RL + [f"rl.tasks={tasks}", "rl.steps=1", "rl.learner_sampler=mesh",
                                        "mesh.data=2", "mesh.expert=2", "mesh.tensor=2",
                                        f"rl.eval_tasks={tasks}", "eval.samples=1"])
  run = RLRun(cfg, str(tmp_path / "rl"), init=init)
  assert run.engine.mesh is run.tr.mesh and run.engine.params is run.tr.state["params"]
  last = run.run()
  assert last["train_infer_logprob_abs_diff"] < 1e-4 and last["routing_mismatch_frac"] < 0.01
  assert run.engine.version == 1 and run.engine.params is run.tr.state["params"]
  assert last["eval"]["tasks"] == 4 and last["eval"]["samples_per_task"] == 1

"""The devices of a rollout worker and its sampler's mesh over them (``rl.worker_devices``).

With ``rl.worker_devices=0`` (the default) a Ray rollout worker is one CPU process holding the whole
policy on one CPU device. With ``N >= 1`` it holds N devices of ``rl.worker_platform``: Ray reserves
them for the actor (``num_gpus=N``, or N ``TPU`` resources; on a GPU node Ray sets the actor's
``CUDA_VISIBLE_DEVICES``), the worker lays its sampler's mesh over them (``rl.worker_mesh``, axis
sizes as in the ``mesh`` section; ``{}`` = every device on ``tensor``) and places every broadcast
tensor shard by shard with the trainer's rule table, so a policy larger than one device still
decodes. ``worker_platform=cpu`` with N > 1 gives the actor N fake host devices: the path the tests
take, the same code as on accelerators. With ``rl.worker_hosts=H > 1`` a worker is a gang of H such
actors, one per host, joined by ``jax.distributed``: the mesh spans their H x N devices (``rl/rollout_worker.py``). The learner process's own sampler (``RLRun.engine``: the
sync loop's rollouts) and the evaluation engine (``rl.loop.load_policy`` / ``eval_run_dir``) use
the same layout over their process's first N devices, unless ``rl.learner_sampler=mesh`` puts them
on the trainer's mesh over every process (``learner_layout``).

The sizes are checked with the config (``check``), before Ray or a compile starts: the mesh must use
exactly the worker's devices and divide the decode batch over its batch axes, and every parameter
must split over it by the rule table (checked on the abstract model); context parallelism is not a
decode layout.
"""

from __future__ import annotations

import numpy as np

from composer_jax.config import Config, ConfigError, MeshConfig
from composer_jax.parallel.mesh import fill_axis

_AXES = ("data", "fsdp", "expert", "context", "tensor")
_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def mesh_sizes(cfg: Config) -> dict[str, int]:
  """The sampler mesh's axis sizes (every axis named, -1 resolved); ConfigError on a bad one."""
  rl, n = cfg.rl, cfg.rl.worker_devices * max(cfg.rl.worker_hosts, 1)
  given = dict(rl.worker_mesh or {})
  if given and n < 1:
    raise ConfigError(f"rl.worker_mesh={given} needs rl.worker_devices >= 1 (the devices it spans)")
  for axis, size in given.items():
    if axis not in _AXES:
      raise ConfigError(f"rl.worker_mesh.{axis}: unknown mesh axis; known: {list(_AXES)}")
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ConfigError(f"rl.worker_mesh.{axis}={size!r} must be an integer >= 1 or -1 (fill)")
  sizes = {a: int(given.get(a, 1)) for a in _AXES}
  if not given:
    sizes["tensor"] = max(n, 1)
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"rl.worker_mesh: at most one axis may be -1, got {fill}")
  sizes = fill_axis(sizes, n, field="rl.worker_mesh", devices="devices of rl.worker_devices")
  total = int(np.prod(list(sizes.values())))
  if n >= 1 and total != n:
    hosts = f" x rl.worker_hosts={rl.worker_hosts}" if rl.worker_hosts > 1 else ""
    raise ConfigError(f"rl.worker_mesh={given} spans {total} devices but rl.worker_devices="
                      f"{rl.worker_devices}{hosts} = {n}: make them equal")
  return sizes


def check(cfg: Config) -> None:
  """Every refusal of a worker layout, in one line each (called by config_check)."""
  rl = cfg.rl
  if rl.worker_devices < 0:
    raise ConfigError(f"rl.worker_devices={rl.worker_devices} must be >= 0 (0 = one CPU device)")
  if rl.worker_devices == 0 and rl.worker_platform != "cpu":
    raise ConfigError(f"rl.worker_platform={rl.worker_platform} needs rl.worker_devices >= 1 (the "
                      "accelerators each rollout worker reserves)")
  if rl.worker_hosts < 1:
    raise ConfigError(f"rl.worker_hosts={rl.worker_hosts} must be >= 1 (processes of one rollout worker)")
  if rl.worker_hosts > 1:
    if rl.worker_devices < 1:
      raise ConfigError(f"rl.worker_hosts={rl.worker_hosts} needs rl.worker_devices >= 1 (each member's "
                        "devices: the gang's mesh spans hosts x devices)")
    if not rl.async_:
      raise ConfigError(f"rl.worker_hosts={rl.worker_hosts} is the Ray rollout workers' layout, but "
                        "rl.async=false samples in the learner job: set rl.async=true, or "
                        "rl.learner_sampler=mesh for a sampler over the learner's hosts")
    if rl.learner_sampler != "mesh":
      raise ConfigError(f"rl.worker_hosts={rl.worker_hosts}: a policy that needs several hosts to "
                        "decode needs them for the learner job's own sampler (evaluations) too: set "
                        "rl.learner_sampler=mesh")
  if rl.broadcast_from == "shards" and not rl.async_:
    raise ConfigError("rl.broadcast_from=shards is where the Ray workers' weights come from, but "
                      "rl.async=false broadcasts nothing: set rl.async=true or rl.broadcast_from=leader")
  if rl.learner_sampler == "mesh" and cfg.mesh.context != 1:
    raise ConfigError(f"rl.learner_sampler=mesh samples on the trainer's mesh, whose context axis is "
                      f"{cfg.mesh.context}: decoding feeds one token a row, which context parallelism "
                      "does not split; set rl.learner_sampler=leader or mesh.context=1")
  s = mesh_sizes(cfg)
  if s["context"] > 1:
    raise ConfigError("rl.worker_mesh.context must be 1: the sampler decodes one token a row, which "
                      "context parallelism does not split; use tensor or expert")
  batch = s["data"] * s["fsdp"] * s["expert"]
  if rl.decode_batch % batch:
    raise ConfigError(f"rl.decode_batch={rl.decode_batch} is not divisible by the worker mesh's batch "
                      f"axes (data x fsdp x expert = {batch}): change rl.decode_batch or rl.worker_mesh")
  if rl.worker_devices * rl.worker_hosts > 1:
    _check_params(cfg, s)


def _check_params(cfg: Config, sizes: dict) -> None:
  """Every parameter's layout on the worker mesh, from the abstract model (nothing allocated): the
  rule table's one-line refusal of a dim the mesh does not divide, named as the worker's."""
  import types

  from flax import nnx

  from composer_jax.model.build import abstract_model
  from composer_jax.parallel.rules import make_rules, state_specs
  _, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
  try:
    state_specs((params, rest), types.SimpleNamespace(shape=sizes), make_rules(cfg.mesh.rules))
  except ConfigError as e:
    raise ConfigError(f"rl.worker_mesh {sizes}: {e}") from None


def actor_resources(cfg: Config) -> dict:
  """Ray resources of one rollout actor: 1 CPU, plus its accelerators."""
  rl = cfg.rl
  out: dict = {"num_cpus": 1}
  if rl.worker_devices and rl.worker_platform == "gpu":
    out["num_gpus"] = rl.worker_devices
  elif rl.worker_devices and rl.worker_platform == "tpu":
    out["resources"] = {"TPU": rl.worker_devices}
  return out


def actor_env(cfg: Config) -> dict:
  """Environment variables of a rollout actor's process (before JAX starts in it)."""
  rl = cfg.rl
  env = {"JAX_PLATFORMS": _JAX_PLATFORMS[rl.worker_platform]}
  # Fake host devices only where the worker asks for several CPU devices; XLA_FLAGS is set either
  # way so that the learner's own flags (e.g. a test's 8 fake devices) do not leak into the actor.
  n = rl.worker_devices if rl.worker_platform == "cpu" and rl.worker_devices > 1 else 0
  flags = ([f"--xla_force_host_platform_device_count={n}"] if n else []) + rl.worker_xla_flags.split()
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def sampler_mesh(cfg: Config):
  """The worker's mesh over its first ``rl.worker_devices`` local devices, or None (one device).
  A gang's (``rl.worker_hosts`` > 1, after ``jax.distributed.initialize``): over every member's
  devices, process by process."""
  import jax

  from composer_jax.parallel.mesh import build_mesh
  n, hosts = cfg.rl.worker_devices, cfg.rl.worker_hosts
  if n * hosts <= 1:
    return None
  local = jax.local_devices()
  if len(local) < n:
    raise ConfigError(f"rl.worker_devices={n}, but this rollout worker sees {len(local)} "
                      f"{local[0].platform} device(s): check the node's accelerators (Ray's "
                      "num_gpus / TPU resources) or lower rl.worker_devices")
  if hosts > 1 and (jax.process_count() != hosts or len(local) != n):
    raise ConfigError(f"rl.worker_hosts={hosts} x rl.worker_devices={n}: this gang member is one of "
                      f"{jax.process_count()} process(es) with {len(local)} device(s)")
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id)) if hosts > 1 else local[:n]
  sizes = mesh_sizes(cfg)
  return build_mesh(MeshConfig(**sizes, rules=dict(cfg.mesh.rules)), devices=devices)


def block_grids(cfg: Config, abstract_tree) -> list | None:
  """A gang's (``rl.worker_hosts`` > 1) block grid per leaf of ``abstract_tree``, from the rule
  table on the worker mesh's sizes: how the broadcast cuts each tensor (``weights.block_grid``), the
  same on the learner (no worker devices there) and in every member. None for one-process workers."""
  if cfg.rl.worker_hosts <= 1:
    return None
  import types

  import jax
  from jax.sharding import PartitionSpec

  from composer_jax.parallel.rules import make_rules, state_specs
  from composer_jax.rl.weights import block_grid
  sizes = mesh_sizes(cfg)
  specs = state_specs(abstract_tree, types.SimpleNamespace(shape=sizes), make_rules(cfg.mesh.rules))
  specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return [block_grid(x.shape, sp, sizes) for x, sp in zip(jax.tree.leaves(abstract_tree), specs,
                                                           strict=True)]


def leaf_shardings(cfg: Config, abstract_tree, mesh) -> list | None:
  """One NamedSharding per leaf of ``abstract_tree`` (the (params, rest) of ``nnx.split``), in leaf
  order, from the trainer's rule table; None without a mesh (one device)."""
  import jax

  from composer_jax.parallel.rules import make_rules, state_shardings
  if mesh is None:
    return None
  shardings = state_shardings(abstract_tree, mesh, make_rules(cfg.mesh.rules))
  return jax.tree.leaves(shardings)


def layout(cfg: Config, abstract_tree) -> tuple:
  """(mesh, one sharding per leaf of ``abstract_tree``) of a sampler, or (None, None) on one device:
  what a Ray worker, the learner's own engine and the evaluation engine each place their weights by."""
  mesh = sampler_mesh(cfg)
  return mesh, leaf_shardings(cfg, abstract_tree, mesh)


def learner_mesh(cfg: Config, mesh=None):
  """The learner job's own sampler's mesh: a worker's (``sampler_mesh``) over this process's devices,
  or with ``rl.learner_sampler=mesh`` the trainer's (``mesh``, else built from ``cfg.mesh``) over
  every process."""
  if cfg.rl.learner_sampler != "mesh":
    return sampler_mesh(cfg)
  if mesh is None:
    from composer_jax.parallel.mesh import build_mesh
    mesh = build_mesh(cfg.mesh)
  return mesh


def learner_layout(cfg: Config, abstract_tree, mesh=None) -> tuple:
  """``layout`` for the learner job's own sampler (``learner_mesh``): with ``rl.learner_sampler=mesh``
  each device holds the slices of the weights it trains."""
  mesh = learner_mesh(cfg, mesh)
  return mesh, leaf_shardings(cfg, abstract_tree, mesh)

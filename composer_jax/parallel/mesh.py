"""Device mesh from the ``mesh`` config section.

Axes, outermost first: data, fsdp, expert, context, tensor (tensor innermost so that its collectives
stay on the fastest links). ``-1`` fills one axis with the remaining devices.

Multi-host: set ``mesh.distributed=true`` and the usual ``jax.distributed`` environment (on Cloud TPU,
SLURM or MPI nothing else; elsewhere JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) —
every process then calls ``jax.distributed.initialize()`` before building the mesh.
"""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np
from jax.sharding import Mesh

from composer_jax.config import ConfigError, MeshConfig
from composer_jax.parallel.rules import MESH_AXES


def set_cpu_devices(n: int) -> None:
  """Ask XLA for ``n`` fake CPU devices; must run before JAX initialises its backends."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def maybe_initialize_distributed(cfg: MeshConfig) -> None:
  """Join the multi-host job (must run before anything touches the devices).

  JAX reads the coordinator from JAX_COORDINATOR_ADDRESS and detects the process count and id on
  Cloud TPU, SLURM, Open MPI, mpi4py and Kubernetes; JAX_NUM_PROCESSES / JAX_PROCESS_ID fill them in
  anywhere else (a GPU box, a fake CPU cluster). CPU processes need a collectives backend to talk to
  each other at all: gloo.
  """
  if not cfg.distributed or jax.distributed.is_initialized():
    return
  kw = {}
  for env, arg in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
    if os.environ.get(env):
      try:
        kw[arg] = int(os.environ[env])
      except ValueError:
        raise ConfigError(f"mesh.distributed: {env}={os.environ[env]!r} is not an integer") from None
  if "num_processes" in kw and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
    raise ConfigError("mesh.distributed: JAX_NUM_PROCESSES is set but JAX_COORDINATOR_ADDRESS is not; "
                      "set it to host:port of process 0")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
  jax.distributed.initialize(**kw)


def fill_axis(sizes: dict[str, int], n_devices: int, field: str = "mesh",
              devices: str = "visible devices") -> dict[str, int]:
  """``sizes`` with its one -1 axis (if any) filled from ``n_devices``; the errors name ``field``."""
  sizes = dict(sizes)
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  fill = [a for a, s in sizes.items() if s == -1]
  if fill:
    if n_devices % fixed:
      raise ConfigError(f"{field}: the fixed axes use {fixed} devices, which does not divide the "
                        f"{n_devices} {devices}; change {field}.{fill[0]} or the other axes")
    sizes[fill[0]] = n_devices // fixed
  return sizes


def resolve_axis_sizes(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
  sizes = fill_axis({a: getattr(cfg, a) for a in MESH_AXES}, n_devices)
  total = int(np.prod(list(sizes.values())))
  if total > n_devices:
    raise ConfigError(f"mesh: {sizes} needs {total} devices but only {n_devices} are visible; "
                      "shrink the mesh (or pass --cpu-devices N for fake CPU devices)")
  return sizes


def build_mesh(cfg: MeshConfig, devices=None) -> Mesh:
  if devices is None:
    maybe_initialize_distributed(cfg)
  devices = list(devices if devices is not None else jax.devices())
  sizes = resolve_axis_sizes(cfg, len(devices))
  total = int(np.prod(list(sizes.values())))
  shape = tuple(sizes[a] for a in MESH_AXES)
  try:
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(shape, devices=devices[:total])
  except Exception as e:  # noqa: BLE001 -- e.g. a partial device list: any order works, slower links
    warnings.warn(f"mesh: no topology-aware device order for {dict(zip(MESH_AXES, shape))} "
                  f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                  "using row-major device order", stacklevel=2)
    grid = np.asarray(devices[:total]).reshape(shape)
  mesh = Mesh(grid, MESH_AXES)
  return mesh

"""What the asynchronous RL stage needs of the machine, checked before any stage starts.

``config_check.validate`` checks a config on its own; these checks look at the machine: a Ray
cluster that answers at ``rl.ray_address`` (as a GCS, of this Ray and Python), a preallocated object
store that fits in memory, cores left for the learner when ``rl.worker_cpus`` pins the workers, and
memory for ``rl.num_workers`` worker processes.
Without them a wrong address or an oversized store surfaced as Ray's error (or a minute of retries)
when the RL stage began, 15 minutes into the main job. Each failure is one line naming the field and
the fix.
"""

from __future__ import annotations

import os
import socket
import threading

import numpy as np

from composer_jax.config import Config, ConfigError
from composer_jax.train.fit import available_memory_bytes, check_fits

# Ray joins the cluster in this variable whatever address ray.init is given (ray._private.services,
# get_ray_address_from_environment), so it counts as the address too.
ENV = "RAY_ADDRESS"
STORE_SHARE = 0.5  # a preallocated store may take at most this share of the memory available
# A rollout worker's host memory beyond its weights and cache: Python, Ray's core worker, the JAX
# runtime and the sampler's compiled programs: about 950 MiB at the tiny config's peak on CPU
# (experiments/rl_worker_memory.py: 1,027 MiB in all). Set below that, so that the estimate stays a
# floor (measured / estimated 1.13-1.34) and the check never refuses workers that would fit.
WORKER_RUNTIME_MB = 768
CACHE_COPIES = 1.5  # the latent cache and a decode step's new one (the peak grew 1.7x and 2.8x the cache)
_FORMS = "give 'auto', 'host:port' (the head's GCS port, 6379 by default) or 'ray://host:port'"


def ray_address(rl) -> str:
  """The cluster the workers' Ray joins: ``RAY_ADDRESS`` when set, else ``rl.ray_address``; '' = a
  Ray of this process's own."""
  return os.environ.get(ENV, "") or rl.ray_address


def check(cfg: Config, timeout_s: float = 3.0) -> None:
  """Raises ConfigError (one line) when the RL stage of ``cfg`` could not start its Ray workers."""
  rl = cfg.rl
  if not rl.async_:
    return  # the synchronous loop starts no Ray
  env = os.environ.get(ENV, "")
  if env and rl.ray_address and env != rl.ray_address:
    raise ConfigError(f"rl.ray_address={rl.ray_address!r} but {ENV}={env!r}, and Ray joins {ENV} "
                      f"whatever it is given: make them agree, or unset one")
  field = f"{ENV}={env!r}" if env else f"rl.ray_address={rl.ray_address!r}"
  own = f"unset {ENV}" if env else "leave rl.ray_address empty"
  if ray_address(rl):
    _check_cluster(ray_address(rl), field, own, timeout_s)
    if ray_address(rl) == "local":  # a new Ray of its own, sized by Ray: the workers are still here
      _check_workers(cfg)
  else:
    _check_local(cfg)


def _check_cluster(addr: str, field: str, own: str, timeout_s: float) -> None:
  if addr == "local":
    return  # ray.init starts a new local cluster
  if addr == "auto":
    found = _current_cluster()
    if not found and _gcs_running():
      return  # Ray's fallback: it asks the running GCS process for its address
    if not found:
      raise ConfigError(f"{field} finds no Ray cluster started on this machine: start one (`ray start "
                        f"--head`), give its address, or {own} for a Ray of this job's own")
    addr = found
  host, port = _host_port(addr, field)
  try:
    socket.create_connection(_resolve(host, port, field, timeout_s), timeout=timeout_s).close()
  except OSError as e:
    head = ("`ray start --head`, whose client server listens on 10001" if addr.startswith("ray://")
            else f"`ray start --head --port {port}`")
    raise ConfigError(f"{field}: nothing answers at {host}:{port} ({e.strerror or e}): start the "
                      f"head there ({head}), fix the address, or {own} for a Ray of this job's "
                      f"own") from None
  if not addr.startswith("ray://"):  # a Ray Client server checks versions itself when it is joined
    _check_versions(f"{host}:{port}", field, own, timeout_s)


def _check_versions(addr: str, field: str, own: str, timeout_s: float) -> None:
  """The GCS at ``addr`` answers as one and recorded the Ray and Python this process runs: ray.init
  checks the same, but only after a minute of retries on a port that is not a GCS's."""
  meta = cluster_metadata(addr, timeout_s)
  if meta and meta.get("error") == "AuthenticationError":
    raise ConfigError(f"{field}: the cluster at {addr} refused this process's Ray auth token: put the "
                      f"cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN, "
                      f"or {own}")
  if meta is None or "error" in meta:
    raise ConfigError(f"{field}: {addr} accepts connections but does not answer as a Ray GCS within "
                      f"{timeout_s:g} s (the dashboard listens on 8265 and the client server on "
                      f"10001; the GCS on `ray start --head --port`, 6379 by default): give the GCS "
                      f"port, or {own} for a Ray of this job's own")
  if not meta:
    return  # no record to compare (an old head, or this Ray's client unavailable)
  try:
    from ray._private.utils import check_version_info  # ray.init's own comparison (match level too)
  except ImportError:  # a Ray that moved this private helper: ray.init still checks, later
    return
  try:
    check_version_info(meta, "this machine")
  except RuntimeError:
    (ray_v, py_v), theirs = _ours(), (meta.get("ray_version"), meta.get("python_version"))
    raise ConfigError(f"{field}: the cluster runs Ray {theirs[0]} on Python {theirs[1]}, this "
                      f"process Ray {ray_v} on Python {py_v}, and Ray joins only the same versions: "
                      f"install ray=={theirs[0]} under Python {theirs[1]} here, or {own}") from None


def _ours() -> tuple[str, str]:
  from ray._private.utils import compute_version_info
  return compute_version_info()


# Run in a child process: Ray's GCS client blocks for a minute of retries on a port that does not
# speak its protocol, logs from C++ and may end the process (rpc_client.h), so the bounds are its
# own connect timeouts plus a wall-clock limit.
_PROBE = """
import json, sys
try:
  from ray._raylet import GcsClient
except ImportError:  # a Ray without this (private) client: nothing to compare
  print("{}"); sys.exit(0)
try:
  raw = GcsClient(address=sys.argv[1]).internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster",
                                                         timeout=float(sys.argv[2]))
except Exception as e:  # AuthenticationError, or RpcError from a port that is not a GCS's
  print(json.dumps({"error": type(e).__name__})); sys.exit(0)
print(raw.decode() if raw else "{}")
"""


def cluster_metadata(addr: str, timeout_s: float) -> dict | None:
  """What the Ray head at ``addr`` recorded of itself (``ray_version``, ``python_version``, ...);
  {} when there is no record to read; {"error": NAME} when Ray's client raised NAME; None when
  ``addr`` does not answer as a GCS."""
  import json
  import subprocess
  import sys
  t = max(1, round(timeout_s))
  env = {**os.environ, "RAY_gcs_rpc_server_connect_timeout_s": str(t),
         "RAY_gcs_rpc_server_reconnect_timeout_s": str(t)}
  try:
    out = subprocess.run([sys.executable, "-c", _PROBE, addr, str(timeout_s)], env=env,
                         capture_output=True, text=True, timeout=4 * timeout_s + 15)
  except subprocess.TimeoutExpired:
    return None
  if out.returncode != 0:
    return None
  try:
    meta = json.loads(out.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    return None
  return meta if isinstance(meta, dict) else None


def _resolve(host: str, port: int, field: str, timeout_s: float) -> tuple:
  """The first TCP address of ``host``, looked up on a daemon thread: getaddrinfo takes no timeout,
  and a resolver that does not answer would otherwise hold the preflight for as long as it likes."""
  done, box = threading.Event(), {}

  def look():
    try:
      box["addr"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][:2]
    except OSError as e:
      box["error"] = e
    done.set()

  threading.Thread(target=look, daemon=True, name="preflight-resolve").start()
  if not done.wait(timeout_s):
    raise ConfigError(f"{field}: looking up {host!r} took over {timeout_s:g} s: check the name and "
                      f"this machine's DNS, or give the head's IP address")
  if "error" in box:
    raise box["error"]
  return box["addr"]


def _host_port(addr: str, field: str) -> tuple[str, int]:
  rest = addr.removeprefix("ray://")
  host, sep, port = rest.rpartition(":")
  if not sep or not host or "/" in rest or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f"{field} is not a Ray address: {_FORMS}")
  return host.strip("[]"), int(port)  # [::1]:6379


def _current_cluster() -> str:
  """The address of the last `ray start` on this machine (Ray's own record of it, in its temp
  folder), or '' when there is none."""
  tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
  try:
    with open(os.path.join(tmp, "ray", "ray_current_cluster")) as f:
      return f.read().strip()
  except OSError:
    return ""


def _gcs_running() -> bool:
  """A Ray head's GCS process on this machine: without the record, ``auto`` still finds it."""
  for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
    try:
      with open(f"/proc/{pid}/comm") as f:
        if f.read().strip() == "gcs_server":
          return True
    except OSError:
      continue
  return False


def _check_local(cfg: Config) -> None:
  rl = cfg.rl
  if rl.object_store_mb > 0:
    avail = available_memory_bytes() >> 20
    cap = int(avail * STORE_SHARE)
    if rl.object_store_mb > cap:
      raise ConfigError(f"rl.object_store_mb={rl.object_store_mb} preallocates more than "
                        f"{STORE_SHARE:.0%} of the {avail} MiB of memory available here: give at most "
                        f"{cap}, or 0 for Ray's default (sized and filled lazily)")
  _check_workers(cfg)
  if rl.worker_cpus > 0 and hasattr(os, "sched_getaffinity"):
    cores = len(os.sched_getaffinity(0))
    if rl.worker_cpus >= cores:
      raise ConfigError(f"rl.worker_cpus={rl.worker_cpus} leaves the learner no core: this process "
                        f"may run on {cores}; give at most {cores - 1}, or 0 for no pinning")


def worker_bytes(cfg: Config) -> dict:
  """Host memory one rollout worker process needs at least: the runtime, the broadcast weights (the
  receiver keeps them on the host for delta updates; on CPU the device arrays alias them) and, on a
  CPU sampler, the latent cache of ``rl.decode_batch`` slots. A gang's member holds its share."""
  rl = cfg.rl
  params, cache = _policy_and_cache_bytes(cfg)
  cache = int(CACHE_COPIES * cache) if rl.worker_platform == "cpu" else 0
  share = (params + cache) // rl.worker_hosts
  return {"runtime": WORKER_RUNTIME_MB << 20, "params": params, "cache": cache,
          "total": (WORKER_RUNTIME_MB << 20) + share}


def _policy_and_cache_bytes(cfg: Config) -> tuple[int, int]:
  """(bytes of the policy as broadcast: parameters and the rest, such as the router bias; bytes of a
  sampler's latent cache of ``rl.decode_batch`` slots at ``rl.max_context``, with the MTP depth's
  when it drafts)."""
  import jax
  from flax import nnx

  from composer_jax.model.build import abstract_model, model_config
  from composer_jax.model.cache import Cache, init_cache, init_layer_cache
  m, rl = model_config(cfg), cfg.rl
  nbytes = lambda tree: sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                            for x in jax.tree.leaves(tree))
  n, length = rl.decode_batch, rl.max_context or m.max_seq_len
  cache = nbytes(jax.eval_shape(lambda: init_cache(m, n, length)))
  if rl.speculative_mtp:
    cache += nbytes(jax.eval_shape(lambda: Cache((init_layer_cache(m, n, length),))))
  return nbytes(nnx.state(abstract_model(m))), cache


def learner_extras(cfg: Config, step_params: int) -> dict:
  """{what: (bytes per device, devices)} the learner job holds beside its step, at least: its own
  sampler's cache (for sync rollouts and the evaluations; ``RLRun``), whole on one device with
  ``rl.learner_sampler=leader`` and ``rl.worker_devices`` <= 1, a copy of the policy for that sampler
  where it is not the trainer's arrays, and the frozen policy of ``rl.kl_coef`` or a frozen feedback
  teacher (``step_params``: the trainer's parameter bytes per device). Each is split as evenly as
  its layout allows, so the sum stays a floor for the learner's first device, which holds them all."""
  import jax
  rl = cfg.rl
  params, cache = _policy_and_cache_bytes(cfg)
  on_mesh = rl.learner_sampler == "mesh"
  n = jax.device_count() if on_mesh else max(rl.worker_devices, 1)
  where = "split over the trainer's mesh" if on_mesh else f"on {n} device(s) of the leader"
  out = {f"the learner's own sampler's cache ({where}: rl.decode_batch x rl.max_context)":
         (-(-cache // n), n)}
  if not on_mesh and (n > 1 or jax.process_count() > 1):  # else the sampler reads the trainer's arrays
    out[f"its copy of the policy ({where})"] = (-(-params // n), n)
  if rl.kl_coef > 0 or (rl.feedback_kl_coef > 0 and rl.feedback_teacher == "frozen"):
    out["the frozen policy (rl.kl_coef, rl.feedback_teacher=frozen)"] = (step_params, jax.device_count())
  return out


def _check_workers(cfg: Config, learner: int = 0, prefix: str = "") -> None:
  """``rl.num_workers`` x ``rl.worker_hosts`` JAX processes must fit in the memory left beside the
  object store (and ``learner`` bytes of the learner's step, when it shares the host), or the
  kernel's OOM killer ends them (or the learner) when RL begins."""
  rl = cfg.rl
  procs = rl.num_workers * rl.worker_hosts
  if procs == 0:
    return
  each = worker_bytes(cfg)["total"]
  avail = available_memory_bytes() - (rl.object_store_mb << 20) - learner
  if procs * each > avail:
    fit = max(avail // each // rl.worker_hosts, 0)
    beside = [f"the learner's step ({learner >> 20} MiB)"] if learner else []
    beside += ["rl.object_store_mb"] if rl.object_store_mb else []
    raise ConfigError(
        f"{prefix}rl.num_workers={rl.num_workers}: {procs} rollout worker process(es) need at least "
        f"{procs * each >> 20} MiB ({each >> 20} MiB each: runtime, weights and cache), more than the "
        f"{max(avail, 0) >> 20} MiB available here{' beside ' + ' and '.join(beside) if beside else ''}: "
        f"give at most {fit}, a smaller rl.decode_batch or rl.max_context, or join a cluster "
        f"(rl.ray_address)")


def learner_shape(cfg: Config, n_devices: int | None = None) -> tuple[int, int]:
  """(row length, rows per batch shard per micro-step) of the learner's largest RL step: rows as
  ``RLRun._batch`` counts them (a group's rows, or at least one quantum when packing, plus the
  PPO-ptx chats), at rl.pack_length or rl.max_context, the longest a bucketed row may be."""
  import jax

  from composer_jax.rl.learner import row_count
  from composer_jax.train.plan import mesh_sizes
  rl = cfg.rl
  sizes, _ = mesh_sizes(cfg, n_devices or jax.device_count())
  quantum = cfg.train.grad_accum * rl.minibatches * sizes["data"] * sizes["fsdp"] * sizes["expert"]
  group = rl.tasks_per_step * rl.group_size
  rows = quantum if rl.pack_length else row_count(group, int(np.lcm(quantum, group)))
  if rl.sft_mix_coef > 0:
    rows += row_count(rl.sft_mix_rows, quantum)
  return rl.pack_length or rl.max_context, -(-rows // quantum)


def learner_host_bytes(cfg: Config, got: dict) -> int:
  """Host memory the learner takes beside local workers: ``check_fits``'s need (``got``) on every
  local device when those are CPU devices (they share the host), else none. It reads the devices,
  so it runs after ``jax.distributed`` has started (``check_learner``)."""
  import jax
  rl = cfg.rl
  # Local workers are process 0's (the leader's); another learner process's host holds none.
  local = rl.async_ and ray_address(rl) in ("", "local") and jax.process_index() == 0
  if not local or jax.default_backend() != "cpu":
    return 0
  n = len(jax.local_devices())
  return got["floor"] * n + sum(each * min(devs, n) for each, devs in got["extra"].values())


def check_learner(cfg: Config, prefix: str = "") -> dict:
  """The learner's RL step, with what the learner job holds beside it (``learner_extras``), must fit
  its devices (``train/fit.py``), before any weight is made; on CPU devices that need comes off the
  memory that local rollout workers may take."""
  rl = cfg.rl
  length, rows = learner_shape(cfg)
  fixes = "a smaller rl.decode_batch or rl.max_context" + (
      "" if rl.learner_sampler == "mesh" else ", rl.learner_sampler=mesh or more rl.worker_devices")
  got = check_fits(cfg, length, rows, f"{prefix}the RL learner's step of {rows} row(s) of {length} tokens "
                   f"per batch shard per micro-step (rl.tasks_per_step x rl.group_size"
                   f"{' + rl.sft_mix_rows' if rl.sft_mix_coef > 0 else ''}, at "
                   f"{'rl.pack_length' if rl.pack_length else 'rl.max_context'})",
                   extra=lambda parts: learner_extras(cfg, parts["params"]), extra_fixes=fixes)
  learner = learner_host_bytes(cfg, got)
  if learner:
    _check_workers(cfg, learner, prefix)
  return got

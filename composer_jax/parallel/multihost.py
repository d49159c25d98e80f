"""What changes when one JAX program is several processes (``mesh.distributed=true``).

Every process runs the same train step over one global mesh, so most code is unchanged. Three
things are not:
  * files in the run directory (metrics, TensorBoard, plots, config, tokenizer) are written by
    process 0 only, on a filesystem every process sees (as Orbax checkpoints already require);
  * state that differs per process -- each process packs its own slice of the documents, so its
    data iterator sits at its own place -- is gathered into the checkpoint as one entry per
    process, and each process takes its own entry back on resume;
  * process 0 decides alone what the others must follow (a step's batch in RL, a decode call):
    ``broadcast``, ``tell`` / ``follow``; or does alone what the others then read from files (the
    main job's tasks and evaluations): ``on_primary``.
With one process every function here is the identity or a no-op.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from composer_jax.config import ConfigError


def is_primary() -> bool:
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Wait until every process reaches the same ``name`` (a no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def on_primary(key: str, fn, timeout_s: float = 7 * 24 * 3600) -> Any:
  """Process 0 runs ``fn`` (work whose files the others then read: generated tasks, an evaluation);
  every process returns its JSON-able result. The others wait on the coordination service's
  key-value store, not in a device collective, so a wait of hours meets no collective timeout; if
  process 0 dies, the service goes with it and the wait fails. ``key`` must be new in the job."""
  if jax.process_count() == 1:
    return fn()
  from jax._src import distributed
  client, key = distributed.global_state.client, f"composer_jax/on_primary/{key}"
  if is_primary():
    out = fn()
    client.key_value_set(key, json.dumps(out))
    return out
  return json.loads(client.blocking_key_value_get(key, int(timeout_s * 1000)))


def _gather_bytes(raw: bytes) -> list[bytes]:
  from jax.experimental import multihost_utils
  n = np.asarray(multihost_utils.process_allgather(np.array([len(raw)], np.int64))).reshape(-1)
  buf = np.zeros(max(int(n.max()), 1), np.uint8)
  buf[:len(raw)] = np.frombuffer(raw, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(n), -1)
  return [bytes(rows[i, :int(n[i])]) for i in range(len(n))]


def allgather_json(obj: Any) -> list:
  """Every process's JSON-able ``obj``, in process order, on every process."""
  if jax.process_count() == 1:
    return [obj]
  return [json.loads(b.decode()) for b in _gather_bytes(json.dumps(obj).encode())]


def broadcast_json(obj: Any) -> Any:
  """Process 0's JSON-able ``obj`` on every process (the others pass anything, e.g. None)."""
  if jax.process_count() == 1:
    return obj
  from jax.experimental import multihost_utils
  raw = json.dumps(obj).encode() if is_primary() else b""
  n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array([len(raw)], np.int64)))[0])
  buf = np.zeros(max(n, 1), np.uint8)
  if is_primary():
    buf[:n] = np.frombuffer(raw, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return json.loads(bytes(out[:n]).decode())


def broadcast_arrays(arrays: dict | None) -> dict:
  """Process 0's dict of NumPy arrays on every process; the others pass None. Names, shapes and
  dtypes travel first (as JSON), so the other processes need not know them."""
  if jax.process_count() == 1:
    return arrays
  from jax.experimental import multihost_utils
  spec = broadcast_json({k: [list(np.shape(v)), np.asarray(v).dtype.str] for k, v in arrays.items()}
                        if is_primary() else None)
  leaves = ([np.asarray(arrays[k]) for k in spec] if is_primary()
            else [np.zeros(s, np.dtype(d)) for s, d in spec.values()])
  out = multihost_utils.broadcast_one_to_all(leaves)
  return {k: np.asarray(v) for k, v in zip(spec, out)}


def tell(op: str, arrays: dict | None = None, **kw) -> dict | None:
  """Process 0 (the leader): name ``op`` to the processes in ``follow``, then broadcast its arrays;
  returns the arrays as every process now holds them. With one process: ``arrays``, nothing sent."""
  if jax.process_count() == 1:
    return arrays
  broadcast_json({"op": op, "arrays": arrays is not None, **kw})
  return broadcast_arrays(arrays) if arrays is not None else None


def follow(handlers: dict) -> None:
  """Every other process: run ``handlers[op](cmd, arrays)`` for each op the leader ``tell``s, in
  order, until it tells ``stop``. The leader's host-side work (episodes, files) is not repeated:
  only the calls that run over the global mesh are, with the leader's inputs."""
  while True:
    cmd = broadcast_json(None)
    if cmd["op"] == "stop":
      return
    arrays = broadcast_arrays(None) if cmd.get("arrays") else None
    handler = handlers.get(cmd["op"])
    if handler is None:
      raise RuntimeError(f"follower: unknown op {cmd['op']!r} from the leader")
    handler(cmd, arrays)


def gather_state(state: Any) -> Any:
  """A per-process state for a checkpoint: itself with one process, else one entry per process."""
  if jax.process_count() == 1:
    return state
  return {"process_count": jax.process_count(), "processes": allgather_json(state)}


def local_state(saved: Any, what: str) -> Any:
  """This process's entry of a ``gather_state`` value (one line if the process count changed)."""
  pc = jax.process_count()
  per_process = isinstance(saved, dict) and "processes" in saved and "process_count" in saved
  n = saved["process_count"] if per_process else 1
  if n != pc:
    raise ConfigError(f"the checkpoint's {what} was saved by {n} process(es) and this run has {pc}: "
                      "resume with the same number of processes, or start a new --out with "
                      "--init from this run (weights only)")
  return saved["processes"][jax.process_index()] if per_process else saved


def to_host(tree: Any) -> Any:
  """NumPy copies of a pytree of global arrays: a batch-sharded one is gathered from every process
  (all processes must call this together), a replicated one is read locally."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(one, tree)


def put_global(arrays: dict, sharding) -> dict:
  """A dict of whole (global) host arrays, the same on every process, onto ``sharding``."""
  if jax.process_count() == 1:
    return jax.device_put(arrays, sharding)
  return {k: jax.make_array_from_callback(np.shape(v), sharding, lambda idx, v=v: v[idx])
          for k, v in arrays.items()}

"""Rollout workers on Ray, the learner's ledger of handed-out work, and the weight broadcast.

Each ``RolloutWorker`` is a Ray actor (1 CPU and, with ``rl.worker_devices``, its own accelerators:
``rl/worker_devices.py``) holding its own sampler engine, on a mesh over its devices, and
environment pool (``RolloutRunner``, sandboxed: ``require_isolation`` as in the sync loop). It has
two concurrency groups: ``rollouts`` runs one unit of work at a time (a few task groups played with
continuous batching), ``weights`` takes broadcast messages while a unit runs. A message is the
``weights.Publisher`` chain of object-store refs (one put, many gets); the engine applies the newest
chain *between decode steps* (``_SwapEngine.step``), so an episode may span versions and every token
records the version that sampled it.

The learner side (``Orchestrator``) bounds the work in flight (trajectories reach it through the
ObjectRefs of finished units, at most ``max_units`` outstanding), notices a dead worker (SIGKILL:
its refs raise ``RayActorError``), hands that worker's units back for re-queueing, and replaces it.
``Ledger`` is the learner's record of which tasks are handed out but not yet trained on; it is what
the checkpoint carries, so a resumed run neither loses nor repeats a task.
"""

from __future__ import annotations

import collections
import os
import threading
import time

from composer_jax.config import Config
from composer_jax.rl.cpus import pin_process, split

# --------------------------------------------------------------------------------------------------
# The ledger (pure; no Ray)
# --------------------------------------------------------------------------------------------------


class Ledger:
  """Task groups handed out and not yet trained on. ``take`` serves re-queued tasks first, then the
  task stream; ``done`` retires a group once trained; ``requeue`` gives a group's task back (a dead
  worker, a stale trajectory). ``state()`` round-trips through a JSON checkpoint: on resume every
  pending task is re-queued, so a task taken before the crash is trained exactly once."""

  def __init__(self, stream):
    self.stream = stream
    self.pending: dict[int, int] = {}  # group id -> task index
    self.queue: collections.deque = collections.deque()  # task indices to hand out before the stream
    self.next_gid = 0

  def take(self, k: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(k):
      task = self.queue.popleft() if self.queue else self.stream.take(1)[0]
      gid, self.next_gid = self.next_gid, self.next_gid + 1
      self.pending[gid] = task
      out.append((gid, task))
    return out

  def requeue(self, gid: int) -> None:
    if gid in self.pending:
      self.queue.append(self.pending.pop(gid))

  def done(self, gid: int) -> int:
    """Retire a trained group; its task index."""
    return self.pending.pop(gid)

  def outstanding(self) -> int:
    return len(self.pending)

  def state(self) -> dict:
    return {"stream": self.stream.state(), "queue": list(self.queue) + list(self.pending.values()),
            "next_gid": self.next_gid}

  def set_state(self, st: dict) -> None:
    self.stream.set_state(st["stream"])
    self.pending, self.queue = {}, collections.deque(int(t) for t in st["queue"])
    self.next_gid = int(st["next_gid"])


# --------------------------------------------------------------------------------------------------
# The worker (runs inside a Ray actor process)
# --------------------------------------------------------------------------------------------------


def _swap_engine_class():
  from composer_jax.rl.sampler import Engine

  class _SwapEngine(Engine):
    """An Engine that takes the newest broadcast weights before each decode step."""

    def __init__(self, *a, swap, **kw):
      super().__init__(*a, **kw)
      self._swap = swap

    def step(self):
      self._swap()
      return super().step()

  return _SwapEngine


class RolloutWorker:
  """A sampler + environment pool. Built inside the actor from the learner's resolved config."""

  def __init__(self, cfg_dict: dict, tok_path: str, worker_id: int, seed: int, cpus=None):
    if cpus:  # before XLA starts its thread pool, which then sizes itself to these cores
      pin_process(set(cpus))
    import jax
    import ray
    from flax import nnx

    from composer_jax.config import from_dict
    from composer_jax.data.tokenizer import load_tokenizer
    from composer_jax.env.sandbox import require_isolation
    from composer_jax.model.build import abstract_model
    from composer_jax.rl import worker_devices
    from composer_jax.rl.agent import RolloutRunner
    from composer_jax.rl.loop import load_task_set
    from composer_jax.rl.weights import Receiver
    self.born = time.perf_counter()
    self.cfg = cfg = from_dict(cfg_dict)
    self.mode = require_isolation(cfg.env.sandbox, "model-driven episodes")
    self.tasks = load_task_set(cfg.rl.tasks, "rl.tasks")
    self.tok = load_tokenizer(tok_path)
    self.id, self.seed = worker_id, seed
    self.graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
    self.treedef = jax.tree_util.tree_structure((params, rest))
    # rl.worker_devices > 1: the sampler's mesh over this actor's devices, and each broadcast tensor's
    # sharding on it (every device receives only its slices).
    self.mesh, self.shardings = worker_devices.layout(cfg, (params, rest))
    # No host copy of a full update: _swap hands the store's read-only buffers to weights.to_device,
    # which on CPU aliases them (the workers share one copy; the engine donates only its caches).
    self.rx = Receiver(get=ray.get, copy=False)
    self.lock = threading.Lock()
    self.mailbox: list | None = None
    self.engine = self.runner = None
    self.busy_s = 0.0
    self.busy = False
    self.swaps = 0
    self._RolloutRunner = RolloutRunner

  # -- weights group ------------------------------------------------------------------------------

  def push(self, chain: list) -> None:
    with self.lock:
      self.mailbox = chain

  def info(self) -> dict:
    return {"pid": os.getpid(), "busy": self.busy, "version": self.rx.version}

  def devices(self) -> int:
    """Devices the sampler's weights are spread over (0 before the first weights arrive)."""
    import jax
    if self.engine is None:
      return 0
    return len(set().union(*(a.devices() for a in jax.tree.leaves(self.engine.params))))

  # -- rollouts group -----------------------------------------------------------------------------

  def _swap(self) -> None:
    import jax

    from composer_jax.rl.weights import to_device
    with self.lock:
      chain, self.mailbox = self.mailbox, None
    if chain is None or not self.rx.apply(chain):
      return
    params, rest = jax.tree_util.tree_unflatten(self.treedef, to_device(self.rx.arrays, self.shardings))
    if self.engine is None:
      rl = self.cfg.rl
      self.engine = _swap_engine_class()(self.graphdef, params, rest, self.cfg, n_slots=rl.decode_batch,
                                         max_len=rl.max_context, seed=self.seed,
                                         version=self.rx.version, mesh=self.mesh, swap=self._swap)
      self.runner = self._RolloutRunner(self.engine, self.tok, self.cfg, mode=self.mode)
    else:
      self.engine.set_weights(params, rest, self.rx.version)
      self.swaps += 1

  def run(self, unit: list[tuple[int, int]]) -> dict:
    """Play ``group_size`` episodes of each (group id, task index); the rollouts per group id."""
    from composer_jax.rl.agent import Job
    t0 = time.perf_counter()
    self.busy = True
    try:
      self._swap()
      deadline = time.perf_counter() + 600
      while self.engine is None:  # the first weights travel in the other concurrency group
        if time.perf_counter() > deadline:
          raise RuntimeError("rollout worker got work but no weights within 600 s")
        time.sleep(0.02)
        self._swap()
      g = self.cfg.rl.group_size
      jobs = [Job(self.tasks[t], gid, s) for gid, t in unit for s in range(g)]
      st = self.engine.stats
      tokens0, drafts0, kept0 = st["tokens_decoded"], st["drafts"], st["drafts_kept"]
      rollouts = self.runner.run(jobs)
      by_gid: dict[int, list] = {}
      for r in rollouts:
        by_gid.setdefault(r.group, []).append(r)
      tokens = st["tokens_decoded"] - tokens0
      drafts, kept = st["drafts"] - drafts0, st["drafts_kept"] - kept0
    finally:
      self.busy = False
      self.busy_s += time.perf_counter() - t0
    return {"groups": by_gid, "worker": self.id, "tokens": int(tokens), "drafts": int(drafts),
            "drafts_kept": int(kept),
            "busy_s": self.busy_s, "alive_s": time.perf_counter() - self.born,
            "full_copies": self.rx.full_copies, "checksum_failures": self.rx.checksum_failures,
            "swaps": self.swaps, "devices": self.devices()}


# --------------------------------------------------------------------------------------------------
# The learner's side
# --------------------------------------------------------------------------------------------------


MAX_UNIT_ERRORS = 3  # units that raise (not worker deaths) before the run stops on the error


def _local_ray(rl) -> dict:
  """ray.init arguments of a local Ray. A sized object store is preallocated: a weight broadcast then
  writes into pages already mapped (experiments/rl_broadcast.py: a 64 MiB put 9.4 ms vs 43 ms)."""
  out: dict = {"num_cpus": max(2, rl.num_workers)}
  if rl.object_store_mb > 0:
    out.update(object_store_memory=rl.object_store_mb * 2**20,
               _system_config={"preallocate_plasma_memory": True})
  return out


def _runtime_env(cfg: Config) -> dict:
  """JAX on the worker's platform inside actors (CPU by default, one thread pool each); the
  persistent compilation cache is shared so a second (or replacement) worker loads what the first
  compiled."""
  import jax

  from composer_jax.rl.worker_devices import actor_env
  env = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", **actor_env(cfg)}
  cache = jax.config.jax_compilation_cache_dir
  if cache:
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(
        jax.config.jax_persistent_cache_min_compile_time_secs)
  return {"env_vars": env}


class Orchestrator:
  """Starts Ray (or joins ``rl.ray_address``), spawns ``rl.num_workers`` workers, broadcasts weights,
  submits units and collects their results; replaces dead workers."""

  def __init__(self, cfg: Config, tok_path: str, log=print, worker_cls=None):
    import ray

    from composer_jax.rl.weights import Publisher
    from composer_jax.rl.worker_devices import actor_resources
    self.cfg, self.tok_path, self.log = cfg, tok_path, log
    rl = cfg.rl
    self.own_ray = not ray.is_initialized()
    if self.own_ray:
      ray.init(address=rl.ray_address or None, include_dashboard=False, log_to_driver=False,
               configure_logging=False, **({} if rl.ray_address else _local_ray(rl)))
    self.actor_cls = ray.remote(max_restarts=0, concurrency_groups={"weights": 1, "rollouts": 1},
                                **actor_resources(cfg))(
        worker_cls or RolloutWorker).options(runtime_env=_runtime_env(cfg))
    self.publisher = Publisher(rl.full_sync_every, rl.weight_delta, put=ray.put)
    # rl.worker_cpus: on a Ray of our own, the learner (this process) and the workers on their own cores.
    self.cpus = split(rl.worker_cpus) if self.own_ray and not rl.ray_address else None
    self.driver_cpus = pin_process(self.cpus[0]) if self.cpus else None
    if self.cpus:
      log(f"[rl] learner on cores {sorted(self.cpus[0])}, rollout workers on {sorted(self.cpus[1])}")
    self.cfg_dict = cfg.to_dict()
    self.workers: dict[int, object] = {}
    self.inflight: dict[object, tuple[int, list]] = {}  # ref -> (worker id, unit)
    self.spawned = 0
    self.counts = collections.Counter(worker_deaths=0, unit_errors=0, requeued=0)
    self.broadcast_s = 0.0
    for _ in range(rl.num_workers):
      self._spawn()

  def _spawn(self) -> int:
    wid = self.spawned
    self.spawned += 1
    seed = self.cfg.rl.seed * 1000 + 17 + wid
    self.workers[wid] = self.actor_cls.remote(self.cfg_dict, self.tok_path, wid, seed,
                                              **({"cpus": sorted(self.cpus[1])} if self.cpus else {}))
    if self.publisher.chain:
      self._push(self.workers[wid])
    return wid

  def _push(self, w) -> None:
    w.push.options(concurrency_group="weights").remote(self.publisher.chain)

  def broadcast(self, tree, version: int) -> dict:
    """One put per update, the chain to every worker; returns sizes and time."""
    t0 = time.perf_counter()
    chain = self.publisher.publish(tree, version)
    for w in self.workers.values():
      self._push(w)
    dt = time.perf_counter() - t0
    self.broadcast_s += dt
    return {"broadcast_s": dt, "broadcast_bytes": self.publisher.last_bytes, "broadcast_kind": chain[-1][1]}

  def load(self, wid: int) -> int:
    return sum(1 for w, _ in self.inflight.values() if w == wid)

  def submit(self, unit: list[tuple[int, int]]) -> None:
    wid = min(self.workers, key=self.load)
    ref = self.workers[wid].run.options(concurrency_group="rollouts").remote(unit)
    self.inflight[ref] = (wid, unit)

  def worker_info(self) -> dict:
    import ray
    return {wid: ray.get(w.info.options(concurrency_group="weights").remote())
            for wid, w in self.workers.items()}

  def wait(self, timeout: float) -> tuple[list[dict], list[list]]:
    """(results of finished units, units lost with their worker). A worker that died, or whose unit
    raised, is replaced and everything it held is lost (to be re-queued); after MAX_UNIT_ERRORS
    raising units the error is raised here, as a bug that repeats would only burn the run."""
    import ray
    if not self.inflight:
      return [], []
    ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=timeout)
    results, lost = [], []
    for ref in ready:
      if ref not in self.inflight:
        continue
      wid, unit = self.inflight.pop(ref)
      try:
        results.append(ray.get(ref))
      except ray.exceptions.RayActorError as e:
        self.counts["worker_deaths"] += 1
        lost += self._replace(wid, unit, f"died ({type(e).__name__})")
      except ray.exceptions.RayTaskError as e:
        self.counts["unit_errors"] += 1
        if self.counts["unit_errors"] > MAX_UNIT_ERRORS:
          raise
        # Killed, not reused: its engine may still hold the failed unit's cache slots.
        lost += self._replace(wid, unit, "raised " + str(e).strip().splitlines()[-1][:200])
    self.counts["requeued"] += sum(len(u) for u in lost)
    return results, lost

  def _replace(self, wid: int, unit: list, why: str) -> list[list]:
    """Units lost with worker ``wid`` (``unit`` and any queued behind it); a new worker replaces it."""
    import ray
    lost = [unit]
    if wid in self.workers:  # once per worker, however many of its units come back failed
      lost += [self.inflight.pop(r)[1] for r, (w, _) in list(self.inflight.items()) if w == wid]
      ray.kill(self.workers.pop(wid))
      new = self._spawn()
      self.log(f"[rl] rollout worker {wid} {why}; {len(lost)} unit(s) re-queued; worker {new} replaces it")
    return lost

  def shutdown(self) -> None:
    import ray
    for w in self.workers.values():
      ray.kill(w)
    self.workers, self.inflight = {}, {}
    if self.own_ray:
      ray.shutdown()
    if self.driver_cpus:  # the stages after RL (evaluation) get every core back
      pin_process(self.driver_cpus)
      self.driver_cpus = None

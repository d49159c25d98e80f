"""The learner's side of async RL on Ray: the ledger of handed-out work, the workers, the broadcast.

The learner (``Orchestrator``) starts Ray or joins ``rl.ray_address``, spawns ``rl.num_workers``
rollout workers (``rl/rollout_worker.py``), puts each weight update into the object store once and
sends every worker the chain of refs, and bounds the work in flight (trajectories reach it through the
ObjectRefs of finished units). It notices a dead worker (SIGKILL: its refs raise ``RayActorError``),
hands that worker's units back for re-queueing, and replaces it. With ``rl.worker_hosts`` > 1 a
worker is a gang of actors, one per host, under one placement group and one ``jax.distributed``
job: it is placed, fed (each member only its blocks of the broadcast, ``rl/weights.py``) and
replaced as one.
``Ledger`` is the learner's record of which tasks are handed out but not yet trained on; it is what
the checkpoint carries, so a resumed run neither loses nor repeats a task.
"""

from __future__ import annotations

import collections
import time

from composer_jax.config import Config
from composer_jax.rl.cpus import pin_process, split
from composer_jax.rl.rollout_worker import RolloutWorker

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
# The learner's side
# --------------------------------------------------------------------------------------------------


# Units one worker holds at once (each blocks a thread while the player plays it); more queue in Ray.
UNIT_THREADS = 32
MAX_UNIT_ERRORS = 3  # units that raise (not worker deaths) before the run stops on the error


def _local_ray(rl) -> dict:
  """ray.init arguments of a local Ray. A sized object store is preallocated: a weight broadcast then
  writes into pages already mapped (experiments/rl_broadcast.py: a 64 MiB put 9.4 ms vs 43 ms)."""
  out: dict = {"num_cpus": max(2, rl.num_workers * rl.worker_hosts)}
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


def _grids(cfg: Config) -> list | None:
  """The block grids of a gang's broadcast (``worker_devices.block_grids``); None without gangs."""
  if cfg.rl.worker_hosts <= 1:
    return None
  from flax import nnx

  from composer_jax.model.build import abstract_model
  from composer_jax.rl.worker_devices import block_grids
  return block_grids(cfg, nnx.split(abstract_model(cfg), nnx.Param, ...)[1:])


class Orchestrator:
  """Starts Ray (or joins ``rl.ray_address``), spawns ``rl.num_workers`` workers, broadcasts weights,
  submits units and collects their results; replaces dead workers."""

  def __init__(self, cfg: Config, tok_path: str, log=print, worker_cls=None):
    import ray

    from composer_jax.rl.preflight import ray_address
    from composer_jax.rl.weights import Publisher
    from composer_jax.rl.worker_devices import actor_resources
    self.cfg, self.tok_path, self.log = cfg, tok_path, log
    rl = cfg.rl
    self.own_ray = not ray.is_initialized()
    joined = ray_address(rl)  # RAY_ADDRESS counts: ray.init joins it whatever it is given
    if self.own_ray:
      # "local", not None: with no address ray.init joins the last `ray start` on this machine (its
      # record in /tmp/ray), and then refuses the local num_cpus and store size, 15 min into a main job.
      ray.init(address=joined or "local", include_dashboard=False, log_to_driver=False,
               configure_logging=False, **({} if joined else _local_ray(rl)))
    self.resources = actor_resources(cfg)
    self.actor_cls = ray.remote(max_restarts=0, concurrency_groups={"weights": 1, "rollouts": 1,
                                                                  "units": UNIT_THREADS},
                                **self.resources)(worker_cls or RolloutWorker)
    self.runtime_env = _runtime_env(cfg)
    # rl.broadcast_from=shards: the learner processes publish their own pieces (``send``).
    self.publisher = (Publisher(rl.full_sync_every, rl.weight_delta, put=ray.put, grids=_grids(cfg))
                      if rl.broadcast_from == "leader" else None)
    self.chain: list = []  # the newest broadcast chain, for every worker (and every one spawned later)
    # rl.worker_cpus: on a Ray of our own, the learner (this process) and the workers on their own cores.
    self.cpus = split(rl.worker_cpus) if self.own_ray and not joined else None
    self.driver_cpus = pin_process(self.cpus[0]) if self.cpus else None
    if self.cpus:
      log(f"[rl] learner on cores {sorted(self.cpus[0])}, rollout workers on {sorted(self.cpus[1])}")
    self.cfg_dict = cfg.to_dict()
    self.workers: dict[int, object] = {}  # worker id -> its actor (a gang's member 0)
    self.gangs: dict[int, tuple] = {}  # rl.worker_hosts > 1: worker id -> (placement group, followers)
    self.serving: dict[object, int] = {}  # a follower's ``serve`` ref -> its worker id
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
    kw = {"cpus": sorted(self.cpus[1])} if self.cpus else {}
    if self.cfg.rl.worker_hosts == 1:
      self.workers[wid] = self.actor_cls.options(runtime_env=self.runtime_env).remote(
          self.cfg_dict, self.tok_path, wid, seed, **kw)
    else:
      self._spawn_gang(wid, seed, kw)
    if self.chain:
      self._push(wid)
    return wid

  def _spawn_gang(self, wid: int, seed: int, kw: dict) -> None:
    """``rl.worker_hosts`` actors placed together (one placement group: all or none, spread over
    nodes where it can), joined into one jax.distributed job; the followers then ``serve``."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    hosts, res = self.cfg.rl.worker_hosts, self.resources
    bundle = {"CPU": res["num_cpus"], **({"GPU": res["num_gpus"]} if "num_gpus" in res else {}),
              **res.get("resources", {})}
    pg = ray.util.placement_group([dict(bundle) for _ in range(hosts)], strategy="SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=600)
    if not ready:
      ray.util.remove_placement_group(pg)
      raise RuntimeError(f"rl.worker_hosts={hosts}: Ray could not place {hosts} actors of {bundle} "
                         "within 600 s: check the cluster's resources or lower rl.worker_hosts")
    members = [self.actor_cls.options(
        runtime_env=self.runtime_env,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote(
            self.cfg_dict, self.tok_path, wid, seed, member=i, **kw) for i in range(hosts)]
    address = ray.get(members[0].coordinator.remote())
    for m in members:  # in the rollouts group, so that ``run`` and ``serve`` queue behind it
      m.join.options(concurrency_group="rollouts").remote(address)
    for m in members[1:]:
      self.serving[m.serve.options(concurrency_group="rollouts").remote()] = wid
    self.workers[wid], self.gangs[wid] = members[0], (pg, members[1:])

  def _push(self, wid: int) -> None:
    for w in [self.workers[wid], *self.gangs.get(wid, (None, []))[1]]:
      w.push.options(concurrency_group="weights").remote(self.chain)

  def broadcast(self, tree, version: int) -> dict:
    """One put per update, the chain to every worker; returns sizes and time."""
    t0 = time.perf_counter()
    chain = self.publisher.publish(tree, version)
    return self.send(chain, self.publisher.last_bytes, t0)

  def send(self, chain: list, nbytes: int, t0: float) -> dict:
    """A chain already in the store (``broadcast``, or the learner processes' merged one:
    rl.broadcast_from=shards) to every worker; ``t0``: when its publishing began."""
    self.chain = chain
    for wid in self.workers:
      self._push(wid)
    dt = time.perf_counter() - t0
    self.broadcast_s += dt
    return {"broadcast_s": dt, "broadcast_bytes": nbytes, "broadcast_kind": chain[-1][1]}

  def load(self, wid: int) -> int:
    return sum(1 for w, _ in self.inflight.values() if w == wid)

  def submit(self, unit: list[tuple[int, int]]) -> None:
    wid = min(self.workers, key=self.load)
    # Streaming workers take many units at once; otherwise units queue in Ray's order, one at a time.
    group = "units" if self.cfg.rl.worker_stream else "rollouts"
    ref = self.workers[wid].run.options(concurrency_group=group).remote(unit)
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
    # A gang follower's ``serve`` only returns by failing: its gang's job is over.
    ready, _ = ray.wait(list(self.inflight) + list(self.serving), num_returns=1, timeout=timeout)
    results, lost = [], []
    for ref in ready:
      if ref in self.serving:
        wid = self.serving.pop(ref)
        if wid in self.workers:
          self.counts["worker_deaths"] += 1
          lost += self._replace(wid, None, "lost a gang member")
        continue
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

  def _replace(self, wid: int, unit: list | None, why: str) -> list[list]:
    """Units lost with worker ``wid`` (``unit`` and any queued behind it); a new worker replaces it
    (a gang: all of its members, in a new placement group)."""
    lost = [unit] if unit is not None else []
    if wid in self.workers:  # once per worker, however many of its units come back failed
      lost += [self.inflight.pop(r)[1] for r, (w, _) in list(self.inflight.items()) if w == wid]
      self._kill(wid)
      new = self._spawn()
      self.log(f"[rl] rollout worker {wid} {why}; {len(lost)} unit(s) re-queued; worker {new} replaces it")
    return lost

  def _kill(self, wid: int) -> None:
    import ray
    ray.kill(self.workers.pop(wid))
    if wid in self.gangs:
      pg, followers = self.gangs.pop(wid)
      for m in followers:
        ray.kill(m)
      self.serving = {r: w for r, w in self.serving.items() if w != wid}
      ray.util.remove_placement_group(pg)

  def shutdown(self) -> None:
    import ray

    from composer_jax.env import scratch
    # The workers are killed mid-unit, so each one's episode workspaces are removed here once it is
    # gone (a worker on another host leaves its folder to the next sweep there).
    asked = [w.info.options(concurrency_group="weights").remote() for w in self.workers.values()]
    folders = {}
    for ref in asked:
      try:
        info = ray.get(ref, timeout=10)
      except (ray.exceptions.RayError, TimeoutError):  # dead or hung: the next sweep on its host
        continue
      if info.get("scratch"):
        folders[info["pid"]] = info["scratch"]
    for wid in list(self.workers):
      self._kill(wid)
    self.workers, self.inflight = {}, {}
    if self.own_ray:
      ray.shutdown()
    scratch.reclaim(folders)
    if self.driver_cpus:  # the stages after RL (evaluation) get every core back
      pin_process(self.driver_cpus)
      self.driver_cpus = None

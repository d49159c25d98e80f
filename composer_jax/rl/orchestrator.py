"""Rollout workers on Ray, the learner's ledger of handed-out work, and the weight broadcast.

Each ``RolloutWorker`` is a Ray actor (1 CPU and, with ``rl.worker_devices``, its own accelerators:
``rl/worker_devices.py``) holding its own sampler engine, on a mesh over its devices, and
environment pool (``RolloutRunner``, sandboxed: ``require_isolation`` as in the sync loop). Its
``rollouts`` concurrency group runs one unit of work at a time (a few task groups played with
continuous batching; also a gang's ``join`` and its followers' ``serve``). With ``rl.worker_stream``
units go to the ``units`` group instead, which takes many at once and feeds them all to one
``RolloutRunner.play`` on a thread of its own, so that a unit's episodes take the decode slots the
previous unit's stragglers leave; each ``run`` call returns when its own unit is done. ``weights``
takes broadcast messages meanwhile. A message is the
``weights.Publisher`` chain of object-store refs (one put, many gets); the engine applies the newest
chain *between decode steps* (``_SwapEngine.step``), so an episode may span versions and every token
records the version that sampled it.

The learner side (``Orchestrator``) bounds the work in flight (trajectories reach it through the
ObjectRefs of finished units, at most ``max_units`` outstanding), notices a dead worker (SIGKILL:
its refs raise ``RayActorError``), hands that worker's units back for re-queueing, and replaces it.
With ``rl.worker_hosts`` > 1 a worker is a gang of actors, one per host, under one placement group
and one ``jax.distributed`` job (``RolloutWorker``): it is placed, fed (each member only its blocks of
the broadcast, ``rl/weights.py``) and replaced as one.
``Ledger`` is the learner's record of which tasks are handed out but not yet trained on; it is what
the checkpoint carries, so a resumed run neither loses nor repeats a task.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import queue
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
  """A sampler + environment pool. Built inside the actor from the learner's resolved config.

  With ``rl.worker_hosts=H > 1`` one worker is H actors (``member`` 0..H-1, one per host) that join
  one ``jax.distributed`` job (``join``) and hold their shards of one engine on a mesh over all their
  devices. Member 0 plays the episodes as a one-actor worker does; before each model call it tells
  the others the call's host inputs and its weight version (``multihost.tell``), and they replay the
  call on their shards (``serve``), each first taking that version from its own copy of the
  broadcast chain."""

  def __init__(self, cfg_dict: dict, tok_path: str, worker_id: int, seed: int, cpus=None,
               member: int = 0):
    if cpus:  # before XLA starts its thread pool, which then sizes itself to these cores
      pin_process(set(cpus))
    from composer_jax.config import from_dict
    self.born = time.perf_counter()
    self.cfg = from_dict(cfg_dict)
    self.tok_path, self.id, self.seed, self.member = tok_path, worker_id, seed, member
    self.lock = threading.Lock()
    self.mailbox: list | None = None
    self.chains: dict[int, list] = {}  # a gang follower's chains by last version (``_weights_at``)
    self.engine = self.runner = None
    self.swaps = 0
    self.ready = threading.Event()  # set when _setup is done (a gang member: after ``join``)
    self.start_lock = threading.Lock()
    self.feed: queue.Queue = queue.Queue()  # units' (jobs, on_done) for the player thread
    self.pending: set = set()  # futures of the units handed to the player and not yet returned
    self.player = None
    self.failed: BaseException | None = None
    self.reported = (0, 0, 0)  # engine (tokens, drafts, kept) already attributed to a unit
    self.scratch = None
    if member == 0:  # the episodes' files, in one folder a replacement sweeps if we are killed
      from composer_jax.env import scratch
      self.scratch, _ = scratch.claim()
    if self.cfg.rl.worker_hosts == 1:
      self._setup()
    # else: nothing may touch a JAX backend before ``join`` has initialized jax.distributed

  def coordinator(self) -> str:
    """Member 0: a free address on this node for the gang's ``jax.distributed`` coordinator."""
    import socket

    import ray
    with socket.socket() as sk:
      sk.bind(("", 0))
      port = sk.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"

  def join(self, address: str) -> None:
    """Every member of a gang, together: one jax.distributed job, then the sampler's layout on it."""
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    jax.distributed.initialize(address, num_processes=self.cfg.rl.worker_hosts, process_id=self.member)
    self._setup()

  def _setup(self) -> None:
    import jax
    import ray
    from flax import nnx

    from composer_jax.data.tokenizer import load_tokenizer
    from composer_jax.env.sandbox import require_isolation
    from composer_jax.model.build import abstract_model
    from composer_jax.rl import worker_devices
    from composer_jax.rl.agent import RolloutRunner
    from composer_jax.rl.loop import load_task_set
    from composer_jax.rl.weights import Receiver, wants
    cfg = self.cfg
    if self.member == 0:  # followers play no episodes: no sandbox, tasks or tokenizer
      self.mode = require_isolation(cfg.env.sandbox, "model-driven episodes")
      self.tasks = load_task_set(cfg.rl.tasks, "rl.tasks")
      self.tok = load_tokenizer(self.tok_path)
    self.graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
    self.treedef = jax.tree_util.tree_structure((params, rest))
    # rl.worker_devices > 1: the sampler's mesh over this actor's devices (a gang's: over every
    # member's), and each broadcast tensor's sharding on it (every device receives only its slices).
    self.mesh, self.shardings = worker_devices.layout(cfg, (params, rest))
    # Pieces (rl/weights.py: a gang's blocks, or the learner processes' own shards) are rebuilt into
    # the tensors by name; a gang member fetches only those overlapping its devices' slices.
    leaves = jax.tree_util.tree_flatten_with_path((params, rest))[0]
    self.leaf_names = [jax.tree_util.keystr(k) for k, _ in leaves]
    self.leaf_shapes = [v.shape for _, v in leaves]
    want = (wants(self.leaf_names, self.leaf_shapes, self.shardings) if cfg.rl.worker_hosts > 1
            else None)
    # No host copy of a full update: _swap hands the store's read-only buffers to weights.to_device,
    # which on CPU aliases them (the workers share one copy; the engine donates only its caches).
    self.rx = Receiver(get=ray.get, copy=False, want=want)
    self._RolloutRunner = RolloutRunner
    self.ready.set()

  # -- weights group ------------------------------------------------------------------------------

  def push(self, chain: list) -> None:
    with self.lock:
      if self.member:  # a follower takes the version member 0 names, not the newest
        self.chains[chain[-1][0]] = chain
      else:
        self.mailbox = chain

  @property
  def busy(self) -> bool:
    return bool(self.pending)

  def info(self) -> dict:
    rx = getattr(self, "rx", None)  # a gang member before ``join`` has none yet
    return {"pid": os.getpid(), "busy": self.busy, "version": rx.version if rx else -1,
            "fetched_bytes": rx.fetched_bytes if rx else 0, "scratch": self.scratch}

  def devices(self) -> int:
    """Devices the sampler's weights are spread over (0 before the first weights arrive)."""
    import jax
    if self.engine is None:
      return 0
    return len(set().union(*(a.devices() for a in jax.tree.leaves(self.engine.params))))

  # -- rollouts group -----------------------------------------------------------------------------

  def _swap(self) -> None:
    import jax

    from composer_jax.rl.weights import assemble, to_device
    with self.lock:
      chain, self.mailbox = self.mailbox, None
    if chain is None or not self.rx.apply(chain):
      return
    if not self.rx.blocked:  # whole tensors in leaf order
      arrays = to_device(self.rx.arrays, self.shardings)
    else:
      arrays = assemble(self.leaf_names, self.leaf_shapes,
                        dict(zip(self.rx.names, self.rx.arrays, strict=True)), self.shardings)
      arrays = to_device(arrays) if self.shardings is None else arrays
    params, rest = jax.tree_util.tree_unflatten(self.treedef, arrays)
    if self.engine is None:
      from composer_jax.rl.sampler import Engine
      rl = self.cfg.rl
      cls = _swap_engine_class() if self.member == 0 else Engine
      kw = {"swap": self._swap} if self.member == 0 else {}
      if self.member == 0 and rl.worker_hosts > 1:
        kw["tell"] = self._tell
      self.engine = cls(self.graphdef, params, rest, self.cfg, n_slots=rl.decode_batch,
                        max_len=rl.max_context, seed=self.seed, version=self.rx.version,
                        mesh=self.mesh, **kw)
      if self.member == 0:
        self.runner = self._RolloutRunner(self.engine, self.tok, self.cfg, mode=self.mode)
    else:
      self.engine.set_weights(params, rest, self.rx.version)
      self.swaps += 1

  # -- a gang (rl.worker_hosts > 1) -------------------------------------------------------------------

  def _tell(self, op: str, arrays: dict | None = None, **kw):
    """Member 0's engine: each model call's inputs and weight version to the other members."""
    from composer_jax.parallel.multihost import tell
    return tell(op, arrays, version=self.engine.version, **kw)

  def _weights_at(self, version: int) -> None:
    """A follower: take ``version`` (the chain that member 0 swapped to; it may still be on its way)."""
    deadline = time.perf_counter() + 600
    while getattr(self.rx, "version", -1) != version:
      with self.lock:
        chain = self.chains.get(version)
      if chain is not None:
        with self.lock:
          self.mailbox, self.chains = chain, {v: c for v, c in self.chains.items() if v > version}
        self._swap()
        break
      if time.perf_counter() > deadline:
        raise RuntimeError(f"gang member {self.member}: weights version {version} never arrived")
      time.sleep(0.01)

  def serve(self) -> None:
    """A follower's whole life after ``join``: replay member 0's model calls until it is killed
    (with its gang: one member's death ends the gang's jax.distributed job)."""
    from composer_jax.parallel.multihost import follow

    def replay(cmd, arrays):
      self._weights_at(cmd["version"])
      self.engine.replay(arrays, cmd["view"])
    follow({"engine": replay})

  def _newest_weights(self) -> None:
    """Swap in the newest weights; before the first ones (they travel in the other concurrency
    group), wait for them."""
    deadline = time.perf_counter() + 600
    self._swap()
    while self.engine is None:
      if time.perf_counter() > deadline:
        raise RuntimeError("rollout worker got work but no weights within 600 s")
      time.sleep(0.02)
      self._swap()

  def _start_player(self) -> None:
    """Once: the first weights, then the thread that plays every unit. Only that thread touches the
    engine from then on (it swaps weights between decode steps)."""
    with self.start_lock:
      if self.player is not None:
        return
      self._newest_weights()
      self.player = threading.Thread(target=self._play, name="rollouts", daemon=True)
      self.player.start()

  def _play(self) -> None:
    def pull(idle: bool) -> list:
      got = []
      try:
        got.append(self.feed.get(timeout=0.1) if idle else self.feed.get_nowait())
        while True:
          got.append(self.feed.get_nowait())
      except queue.Empty:
        return got

    try:
      self.runner.play(pull)
    except BaseException as e:  # noqa: BLE001 -- every waiting unit raises it (the worker is replaced)
      with self.start_lock:
        self.failed = e
        for f in list(self.pending):
          if not f.done():
            f.set_exception(e)

  def _stream(self, jobs: list) -> list:
    """The unit's jobs to the player thread (started on the first unit); its rollouts when done."""
    self._start_player()
    box: cf.Future = cf.Future()
    with self.start_lock:
      if self.failed is not None:
        raise self.failed
      self.pending.add(box)
    try:
      self.feed.put((jobs, box.set_result))
      return box.result()
    finally:
      self.pending.discard(box)

  def _alone(self, jobs: list) -> list:
    """rl.worker_stream=false: the unit by itself (the ``rollouts`` group runs one at a time), on the
    newest weights at its start."""
    box = cf.Future()  # counted in ``pending`` (busy) while it plays
    self.pending.add(box)
    try:
      self._newest_weights()
      return self.runner.run(jobs)
    finally:
      self.pending.discard(box)

  def run(self, unit: list[tuple[int, int]]) -> dict:
    """Play ``group_size`` episodes of each (group id, task index); the rollouts per group id."""
    from composer_jax.rl.agent import Job
    if not self.ready.wait(600):
      raise RuntimeError("rollout worker got work but was not set up within 600 s")
    g = self.cfg.rl.group_size
    jobs = [Job(self.tasks[t], gid, s) for gid, t in unit for s in range(g)]
    rollouts = self._stream(jobs) if self.cfg.rl.worker_stream else self._alone(jobs)
    by_gid: dict[int, list] = {}
    for r in rollouts:
      by_gid.setdefault(r.group, []).append(r)
    # The engine's counts since the last unit returned (units overlap: the sum over units is exact).
    with self.lock:
      st = self.engine.stats
      now = (st["tokens_decoded"], st["drafts"], st["drafts_kept"])
      tokens, drafts, kept = (a - b for a, b in zip(now, self.reported, strict=True))
      self.reported = now
    return {"groups": by_gid, "worker": self.id, "tokens": int(tokens), "drafts": int(drafts),
            "drafts_kept": int(kept),
            "busy_s": self.runner.stats["seconds"], "alive_s": time.perf_counter() - self.born,
            "full_copies": self.rx.full_copies, "checksum_failures": self.rx.checksum_failures,
            "swaps": self.swaps, "devices": self.devices()}


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

    from composer_jax.rl.weights import Publisher
    from composer_jax.rl.worker_devices import actor_resources
    self.cfg, self.tok_path, self.log = cfg, tok_path, log
    rl = cfg.rl
    self.own_ray = not ray.is_initialized()
    if self.own_ray:
      ray.init(address=rl.ray_address or None, include_dashboard=False, log_to_driver=False,
               configure_logging=False, **({} if rl.ray_address else _local_ray(rl)))
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
    self.cpus = split(rl.worker_cpus) if self.own_ray and not rl.ray_address else None
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

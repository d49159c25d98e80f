"""A rollout worker: one Ray actor holding a sampler engine and an environment pool.

Each ``RolloutWorker`` is a Ray actor (1 CPU and, with ``rl.worker_devices``, its own accelerators:
``rl/worker_devices.py``) holding its own sampler engine, on a mesh over its devices, and
environment pool (``RolloutRunner``, sandboxed: ``require_isolation`` as in the sync loop). Its
``rollouts`` concurrency group runs one unit of work at a time (a few task groups played with
continuous batching; also a gang's ``join`` and its followers' ``serve``). With ``rl.worker_stream``
units go to the ``units`` group instead, which takes many at once and feeds them all to one
``RolloutRunner.play`` on a thread of its own, so that a unit's episodes take the decode slots the
previous unit's stragglers leave; each ``run`` call returns when its own unit is done. ``weights``
takes broadcast messages meanwhile. A message is the ``weights.Publisher`` chain of object-store
refs (one put, many gets); the engine applies the newest chain *between decode steps*
(``_SwapEngine.step``), so an episode may span versions and every token records the version that
sampled it. The learner's side is ``rl/orchestrator.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading
import time

from composer_jax.rl.cpus import lower_priority, pin_process


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
    lower_priority(self.cfg.rl.worker_priority)  # before XLA's threads, which inherit it
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

"""The RL learner as several JAX processes (``mesh.distributed=true``), with Ray beside it.

One process, the leader (process 0), does everything host-side: it holds the task stream and the
ledger, drives the Ray rollout workers (or, with ``rl.async=false``, its own sampler engine), scores
the rollouts, builds each learner batch and writes the run directory. The other processes, the
followers, hold their shards of the policy and optimizer state and join only the work that runs
over the global mesh. ``LearnerGroup`` is that work:

  * ``train(mb)``: one optimizer update on a learner batch;
  * ``logp(which, batch)`` / ``teacher(which, batch)``: trainer log-probs (old or reference policy)
    and the feedback teacher's targets, on the current or the frozen initial weights;
  * ``weights()``: the whole policy as host arrays, for the sampler engine and the broadcast;
  * ``pieces(version)``: the broadcast without a gather (rl.broadcast_from=shards): every process
    puts its own shards into the Ray object store;
  * ``save(step, data, meta)``: an Orbax checkpoint (every process writes its shards).

The leader calls these; each call first tells the followers which one it is (a JSON command, then
the batch's arrays, broadcast from process 0), then every process runs it. Followers sit in
``follow()`` until the leader's ``stop()``. With one process nothing is broadcast and every method
is the plain single-process call, so the single-host path is unchanged.

Gathering the whole policy onto the leader (``weights``, a tensor at a time; the followers keep
none of it) suits a policy that fits one host. One that does not is never gathered: the learner
job's own sampler runs on the trainer's mesh (``rl.learner_sampler=mesh``: every process holds its
shards of the engine, and each decode call is one more op here, ``engine``, the leader's inputs
replayed by the followers, ``Engine.replay``), and the broadcast comes from every process
(``rl.broadcast_from=shards``, ``pieces``): each joins the leader's Ray, puts the distinct shards it
holds (``weights.local_pieces``, deltas against its own previous ones) and posts its chain of refs to
a mailbox actor, from which the leader merges the chains for the workers. Each worker fetches the
pieces that overlap its devices' slices and rebuilds them (``weights.assemble``).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.multihost import follow, put_global, tell, to_host

FORWARD_KEYS = ("tokens", "segment_ids", "positions", "experts")  # what a forward of a batch reads


class LearnerGroup:

  def __init__(self, run):
    self.run = run  # an RLRun: its trainer (tr), checkpointer (ck), frozen weights, jitted fns
    self.multi = jax.process_count() > 1
    self._host_weights = None  # (version, weights) of the last gather
    self.publisher = None  # rl.broadcast_from=shards: this process's pieces (``pieces``)
    self.mailbox = None  # the leader's: where the followers post their chains

  # -- the leader's calls -----------------------------------------------------------------------------

  def _tell(self, op: str, arrays: dict | None = None, **kw) -> dict | None:
    """Leader: name the op to the followers, then broadcast its arrays. Returns the arrays."""
    return tell(op, arrays, **kw) if self.multi else arrays

  def train(self, mb: dict) -> dict:
    return self._train(self._tell("train", mb))

  def logp(self, which: str, batch: dict) -> np.ndarray:
    sub = {k: batch[k] for k in FORWARD_KEYS}
    return self._logp(which, self._tell("logp", sub, which=which))

  def teacher(self, which: str, tb: dict) -> dict:
    sub = {k: tb[k] for k in FORWARD_KEYS}
    return self._teacher(which, self._tell("teacher", sub, which=which))

  def weights(self, version: int):
    """(params, rest) for the sampler: the trainer's arrays with one process, host copies (gathered
    from every process) with several."""
    if not self.multi:
      return self.run.tr.state["params"], self.run.tr.state["rest"]
    if self._host_weights is None or self._host_weights[0] != version:
      self._tell("weights", version=version)
      self._host_weights = (version, self._weights())
    return self._host_weights[1]

  def pieces(self, version: int) -> tuple[list, int]:
    """rl.broadcast_from=shards: every process puts its own shards of the policy, nothing is
    gathered. Returns the merged chain (``weights.merge_chains``) and the payload bytes put."""
    import ray

    from composer_jax.rl.weights import merge_chains
    if not self.multi:
      return self._pieces(version, {})
    if self.mailbox is None:
      ctx = ray.get_runtime_context()
      self.box_name = f"composer_jax_pieces_{ctx.get_job_id()}"
      self.mailbox = ray.remote(num_cpus=0)(_Mailbox).options(name=self.box_name).remote()
      self.where = {"ray": ctx.gcs_address, "namespace": ctx.namespace, "box": self.box_name,
                    **_ray_auth()}
    self._tell("pieces", version=version, **self.where)
    chain, nbytes = self._pieces(version, {})
    deadline = time.perf_counter() + 600
    while (posted := ray.get(self.mailbox.take.remote(version, jax.process_count() - 1))) is None:
      if time.perf_counter() > deadline:
        raise RuntimeError(f"learner processes did not post their shards of version {version} in 600 s")
      time.sleep(0.005)
    return merge_chains([chain, *(c for c, _ in posted)]), nbytes + sum(n for _, n in posted)

  def gather_initial(self, version: int) -> None:
    """Every process, at start-up (before the followers enter ``follow``): the leader's first host
    copy."""
    if self.multi:
      self._host_weights = (version, self._weights())

  def save(self, step: int, data: dict, meta: dict) -> None:
    self._tell("save", step=step, meta=meta)
    self._save(step, data, meta)

  def stop(self) -> None:
    self._tell("stop")

  # -- what every process runs --------------------------------------------------------------------------

  def _params(self, which: str):
    st = self.run.tr.state
    return self.run.frozen if which == "frozen" else (st["params"], st["rest"])

  def _inputs(self, arrays: dict) -> dict:
    if not self.multi:  # as before: host arrays straight into the jitted call
      return arrays
    return put_global(arrays, NamedSharding(self.run.tr.mesh, P()))

  def _train(self, mb: dict) -> dict:
    tr = self.run.tr
    from composer_jax.train.loop import put_batch
    batch = put_global(mb, tr.batch_sharding) if self.multi else put_batch(tr, mb)
    tr.state, out = tr.step_fn(tr.state, batch)
    return to_host(out)

  def _logp(self, which: str, batch: dict) -> np.ndarray:
    return np.asarray(to_host(self.run.logp_fn(*self._params(which), self._inputs(batch))))

  def _teacher(self, which: str, tb: dict) -> dict:
    x = self._inputs(tb)
    return to_host(self.run.teacher_fn(*self._params(which), x["tokens"], x["segment_ids"],
                                       x["positions"], x["experts"]))

  def _weights(self):
    """The leader's host copy of the policy. Gathered a tensor at a time (every process takes part
    in each gather); a follower drops each tensor at once, so no follower holds more than one
    (it has no use for a copy: its engine, if any, holds the trainer's own arrays)."""
    st = self.run.tr.state
    if not self.multi:
      return to_host((st["params"], st["rest"]))
    leaves, treedef = jax.tree.flatten((st["params"], st["rest"]))
    keep = jax.process_index() == 0
    out = [h if keep else None for h in map(to_host, leaves)]
    return jax.tree.unflatten(treedef, out) if keep else None

  def _pieces(self, version: int, cmd: dict) -> tuple[list, int]:
    """Every process: put this process's shards (deltas against its previous ones); a follower
    posts its chain to the leader's mailbox (joining the leader's Ray on its first call)."""
    import ray

    from composer_jax.rl.weights import Publisher, local_pieces
    rl = self.run.cfg.rl
    if self.publisher is None:
      if not ray.is_initialized():  # a follower: the leader's Ray, as one more driver
        _join_ray(cmd)
      self.publisher = Publisher(rl.full_sync_every, rl.weight_delta, put=ray.put)
    st = self.run.tr.state
    chain = self.publisher.publish_arrays(*local_pieces((st["params"], st["rest"])), version)
    if cmd:  # a follower: the refs travel inside an actor call, so Ray counts the leader's borrow
      box = ray.get_actor(cmd["box"])
      ray.get(box.post.remote(version, jax.process_index(), chain, self.publisher.last_bytes))
    return chain, self.publisher.last_bytes

  def _save(self, step: int, data: dict, meta: dict) -> None:
    r = self.run
    r.ck.save(step, r._items(r.tr.state), data, meta)

  def follow(self) -> None:
    """A follower's loop: run what the leader names, until it says stop."""
    follow({"train": lambda cmd, a: self._train(a),
            "logp": lambda cmd, a: self._logp(cmd["which"], a),
            "teacher": lambda cmd, a: self._teacher(cmd["which"], a),
            "weights": lambda cmd, a: self._weights(),
            "save": lambda cmd, a: self._save(cmd["step"], {}, cmd["meta"]),
            "pieces": lambda cmd, a: self._pieces(cmd["version"], cmd),
            "engine": lambda cmd, a: self._engine(cmd, a)})
    if self.publisher is not None:  # this follower joined the leader's Ray: leave it before it ends
      import ray
      ray.shutdown()

  def _engine(self, cmd: dict, arrays: dict) -> None:
    """A follower's share of one decode call of the sampler on the trainer's mesh
    (``rl.learner_sampler=mesh``): the leader's inputs, the current weights (the leader's engine
    always holds those: it is published right after each update)."""
    eng = self.run.engine
    eng.set_weights(*self._params("current"), eng.version)
    eng.replay(arrays, cmd["view"])


def _ray_auth() -> dict:
  """The leader's Ray authentication, for the followers (one job, one trust domain). A local Ray
  turns token auth on by setting RAY_AUTH_MODE in the process that starts it, and its token lives in
  that host's ~/.ray/auth_token: a follower on another host has neither."""
  mode = os.environ.get("RAY_AUTH_MODE", "")
  token = ""
  if mode == "token":
    from ray._raylet import AuthenticationTokenLoader
    token = AuthenticationTokenLoader.instance().get_raw_token()
  return {"auth": mode, "token": token}


def _join_ray(cmd: dict) -> None:
  """A follower joins the leader's Ray by address with the leader's auth. Ray reads its auth mode
  once per process, so after setting it the config is re-read (what Ray's own token set-up does);
  without that the join fails with InvalidAuthToken."""
  import ray
  if cmd["auth"]:
    os.environ["RAY_AUTH_MODE"] = cmd["auth"]
    if cmd["token"]:
      os.environ["RAY_AUTH_TOKEN"] = cmd["token"]
    from ray._raylet import AuthenticationTokenLoader, Config
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
  ray.init(address=cmd["ray"], namespace=cmd["namespace"], log_to_driver=False,
           configure_logging=False)


class _Mailbox:
  """A Ray actor: the followers' chains of pieces for each version, until the leader takes them."""

  def __init__(self):
    self.box: dict = {}

  def post(self, version: int, process: int, chain: list, nbytes: int) -> None:
    self.box[(version, process)] = (chain, nbytes)

  def take(self, version: int, n: int) -> list | None:
    """The ``n`` followers' (chain, bytes) of ``version`` in process order, once all have posted."""
    keys = sorted(k for k in self.box if k[0] == version)
    if len(keys) < n:
      return None
    return [self.box.pop(k) for k in keys]

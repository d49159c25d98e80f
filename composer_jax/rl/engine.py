"""The rollout engine: continuous batching over a fixed number of cache slots, token in, token out.

Every model call is one *mixed* batch over all ``n_slots`` rows: a row that is prefilling feeds its
next chunk of turn tokens (up to ``prefill_chunk``), a generating row feeds its last sampled token, an
idle row (waiting on tools, or free) feeds nothing. Rows are ragged (composer_jax.model.cache): each
writes only its own valid tokens at its own length, so one call serves every live episode and a
freed slot is refilled while the others keep decoding. Shapes are static per bucket: tokens
[n_slots, S] with S = 1 (pure decode) or a power of two >= 16, and attention reads a power-of-two
``view`` >= the longest filled row. Only the changed row lengths travel host -> device; the cache
buffers are donated and updated in place.

With ``rl.prefill_rows`` = P > 0 (the default, 1) a step makes that mixed call for the decoding rows
only (S = 1), and reads the turns of the prefilling rows in calls of their own over P rows: the
slots' cache rows are gathered, run at [P, S] and scattered back. In one mixed call every decoding
row is padded to the widest prefill: on the tiny config's RL rollouts (2 CPU cores, 32 episodes of
training tasks) that padding was ~10x the useful tokens, and the batch took 107 s instead of 13 s.

An episode (``Request.key``) keeps its slot and cache between turns. The last token of a turn is
sampled but never fed; the next turn feeds it first, then its ``new_tokens`` (so an episode's
``context_tokens``, concatenated over its turns, plus the last turn's final token, are exactly the
sequence the model read and wrote; a turn refused with finish="context" feeds and generates
nothing, so the final token is then the previous turn's). Per fed token the engine records the routed experts of every
MoE layer (router replay); per generated token its log-prob (see composer_jax.rl.sampling) and the
weight version that produced it.

With ``rl.speculative_mtp`` the first MTP depth drafts one token per generating row, over a latent
cache of its own: a decoding row feeds its last token and the draft (S = 2), the main model verifies
the draft by speculative sampling (``sampling.speculative_verify``: the emitted ids are distributed as
without drafts) and, when it is kept, samples a bonus token from the draft's position, so a call
emits one or two tokens per row. A rejected draft's cache slot lies past the row's length and is
overwritten by the next feed; a kept draft on which the turn ends is rolled back the same way, so it
is fed again at the next turn like any final token. ``stats`` count drafts and kept drafts.

On a mesh the cache rows are split over the batch axes (``act_batch``), and an engine may span
several processes (``rl.learner_sampler=mesh``: a policy larger than one host). The bookkeeping
above then runs in the leader's engine alone; each model call's host inputs go through ``tell``
to the other processes' engines, which ``replay`` the same call on their shards.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.config import Config, ConfigError
from composer_jax.model.cache import (
  Cache,
  LayerCache,
  bucket,
  check_room,
  init_cache,
  init_layer_cache,
)
from composer_jax.parallel.multihost import to_host
from composer_jax.rl.sampling import sample, speculative_verify

MIN_VIEW = 64  # smallest attention bucket (fewer traces for short contexts)


@dataclasses.dataclass
class Request:
  """One assistant turn of one episode."""
  key: Hashable  # episode id; the first request for a key claims a free slot
  new_tokens: list[int]  # appended to the episode's context before generating
  max_new_tokens: int
  stop_ids: tuple[int, ...]


@dataclasses.dataclass
class Generation:
  key: Hashable
  tokens: np.ndarray  # int32 [n] generated ids, the stop token included when it stopped
  logprobs: np.ndarray  # float32 [n] log_softmax(logits / T)[id] over the full vocabulary
  context_experts: np.ndarray  # [len(context_tokens), n_moe_layers, k] int8 (E <= 128) or int16
  context_tokens: np.ndarray  # int32: the tokens fed to the model during this request, in order
  version: int  # weight version of this turn (the oldest, if weights changed mid-turn)
  finish: str  # "stop" | "length" | "context" (cache full)
  token_versions: np.ndarray | None = None  # int32 [n] version that produced each generated id


def expert_dtype(n_experts: int):
  """Smallest signed int holding every expert id and -1 (= no route): int8 up to 128 experts."""
  return np.int8 if n_experts <= 128 else np.int16


_STEP_FNS: dict = {}  # (graphdef structure, id(mesh), sampling rule...) -> (mesh, jitted call)


def _step_fn(graphdef, mesh, *rule, rows: bool = False):
  """The jitted mixed call, shared by every engine of one model structure, mesh and sampling rule.

  Keyed by the graphdef's repr (a GraphDef holding the model config is not hashable, and two loads
  of one run give equal but distinct objects): every eval or RL engine of the same model in a
  process reuses the compiled buckets. Keyed by id on the graphdef, each eval_run_dir recompiled
  all of them (16 buckets, ~18 s on 2 CPU cores, more than the rollouts of a small eval).
  """
  key = (repr(graphdef), id(mesh), rows) + rule
  got = _STEP_FNS.get(key)
  if got is None or got[0] is not mesh:
    if len(_STEP_FNS) >= 16:
      _STEP_FNS.clear()
    got = _STEP_FNS[key] = (mesh, _make_step_fn(graphdef, *rule, rows=rows))
  return got[1]


def _make_step_fn(graphdef, temperature: float, top_k: int, top_p: float, n_moe: int, k: int,
                  edtype: str, speculative: bool = False, rows: bool = False):
  """Rows feed counts[b] tokens; returns the cache buffers (donated, updated in place), a sampled id
  and its log-prob at each row's last fed token, and the routed experts of every fed position.
  ``speculative``: the drafting variant (``_make_spec_fn``). ``rows``: the call over some slots only
  (``_on_rows``)."""
  if speculative:
    return _make_spec_fn(graphdef, temperature, top_k, top_p, n_moe, k, edtype, rows)

  def forward(params, rest, bufs, index, tokens, counts, key, *, view):
    model = nnx.merge(graphdef, params, rest)
    out = model(tokens, segment_ids=_valid(tokens, counts), cache=_cache(bufs, index, view),
                return_routing=n_moe > 0, mtp=False, logit_positions=jnp.maximum(counts - 1, 0))
    ids, logp = sample(out.logits[:, 0], key, temperature, top_k, top_p)
    return _bufs(out.cache), ids, logp, _routed(out, tokens, n_moe, k, edtype)

  return jax.jit(_on_rows(forward, 1) if rows else forward, static_argnames=("view",), donate_argnums=(2,))


def _on_rows(forward, n_bufs: int):
  """``forward`` over some slots: its first ``n_bufs`` arguments (per-slot buffers, donated) are
  followed by ``rows`` [P], the slots to run; their rows are gathered, passed on, and the returned
  ones scattered back, so a prefill costs P rows of its width, not every slot's."""
  def compact(params, rest, *args, view):
    bufs, rows, more = args[:n_bufs], args[n_bufs], args[n_bufs + 1:]
    out = forward(params, rest, *_take(bufs, rows), *more, view=view)
    return (*_put(bufs, rows, out[:n_bufs]), *out[n_bufs:])
  return compact


def _row_axis(a) -> int:
  return 1 if a.ndim == 4 else 0  # stacked MoE caches are [L, slots, T, r] (model.scan_layers)


def _take(tree, rows):
  return jax.tree.map(lambda a: jnp.take(a, rows, axis=_row_axis(a)), tree)


def _put(tree, rows, sub):
  return jax.tree.map(lambda a, s: a.at[(slice(None),) * _row_axis(a) + (rows,)].set(s), tree, sub)


def _cache(bufs, index, view) -> Cache:
  return Cache(tuple(LayerCache(c=c, k_pe=kpe, index=index, view=view) for c, kpe in bufs))


def _bufs(cache: Cache) -> tuple:
  return tuple((lc.c, lc.k_pe) for lc in cache.layers)


def _valid(tokens, counts):
  return (jnp.arange(tokens.shape[1])[None] < counts[:, None]).astype(jnp.int32)


def _routed(out, tokens, n_moe: int, k: int, edtype: str):
  return out.routed_experts.astype(edtype) if n_moe else jnp.zeros((0,) + tokens.shape + (k,), edtype)


def _make_spec_fn(graphdef, temperature: float, top_k: int, top_p: float, n_moe: int, k: int,
                  edtype: str, rows: bool = False):
  """The mixed call with MTP drafts. A row with ``has_draft`` fed [last token, draft]; the main
  model's logits at both positions verify the draft (and give the bonus token); then the first MTP
  depth reads the main stack's hidden states over the kept positions (each paired with the token
  after it: the next fed token, the token just emitted, or for a row still prefilling the first
  token of its next chunk, ``next_tok``) and drafts the token after the one just emitted.

  Returns (cache buffers, MTP cache buffers, draft logits [b, V], ids [b, 2], logprobs [b, 2],
  emitted count [b], next draft [b], routed experts); the three buffers are donated.
  """

  def forward(params, rest, bufs, mtp_buf, draft_logits, index, tokens, counts, has_draft, next_tok,
              samples, key, *, view):
    model = nnx.merge(graphdef, params, rest)
    b, s = tokens.shape
    rows = jnp.arange(b)
    last = jnp.maximum(counts - 1, 0)
    answered = jnp.where(has_draft, jnp.maximum(counts - 2, 0), last)  # logits judging the draft
    out = model(tokens, segment_ids=_valid(tokens, counts), cache=_cache(bufs, index, view),
                return_routing=n_moe > 0, mtp=False, return_hidden=True,
                logit_positions=jnp.stack([answered, last], axis=1))
    k_verify, k_draft = jax.random.split(key)
    ids, logp, n = speculative_verify(out.logits, draft_logits, tokens[rows, last], has_draft,
                                      k_verify, temperature, top_k, top_p)
    kept = jnp.where(n == 2, last, answered)  # the last fed position the row keeps
    after = jnp.where(samples, ids[rows, n - 1], next_tok)
    ahead = jnp.roll(tokens, -1, axis=1).at[rows, kept].set(after)
    pairs = ((jnp.arange(s)[None] <= kept[:, None]) & (counts[:, None] > 0)).astype(jnp.int32)
    positions = index[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    mcache = LayerCache(c=mtp_buf[0], k_pe=mtp_buf[1], index=index, view=view)
    dlog, mcache = model.mtp_draft_logits(out.hidden, ahead, positions, pairs, mcache, kept)
    draft, _ = sample(dlog, k_draft, temperature, top_k, top_p)
    return (_bufs(out.cache), (mcache.c, mcache.k_pe), dlog.astype(jnp.float32), ids, logp, n, draft,
            _routed(out, tokens, n_moe, k, edtype))

  return jax.jit(_on_rows(forward, 3) if rows else forward, static_argnames=("view",),
                 donate_argnums=(2, 3, 4))


@dataclasses.dataclass
class _Slot:
  key: Hashable | None = None
  filled: int = 0  # tokens in this slot's cache
  carry: int | None = None  # the previous turn's final token, sampled but not yet fed
  req: Request | None = None
  order: int = 0  # submission number of the active request
  todo: list = dataclasses.field(default_factory=list)  # turn tokens still to prefill
  fed: list = dataclasses.field(default_factory=list)
  experts: list = dataclasses.field(default_factory=list)  # [n_fed_in_call, n_moe, k] per call
  out: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  vers: list = dataclasses.field(default_factory=list)
  draft: int | None = None  # the MTP's guess at the token after out[-1] (rl.speculative_mtp)


class Engine:
  """Batched prefill + decode over the latent cache for many episodes (see the module docstring)."""

  def __init__(self, graphdef, params, rest, cfg: Config, *, n_slots: int, max_len: int,
               seed: int = 0, version: int = 0, mesh=None, prefill_chunk: int = 512,
               prefill_rows: int | None = None, tell=None):
    m = cfg.model
    if n_slots < 1:
      raise ConfigError(f"rl.decode_batch={n_slots}: the engine needs at least one slot")
    if max_len < 2:
      raise ConfigError(f"rl.max_context={max_len}: too short to hold a prompt and a token")
    if cfg.rl.top_p <= 0 or cfg.rl.top_p > 1:
      raise ConfigError(f"rl.top_p={cfg.rl.top_p} must be in (0, 1]")
    if cfg.rl.top_k < 0:
      raise ConfigError(f"rl.top_k={cfg.rl.top_k} must be >= 0 (0 = whole vocabulary)")
    self.speculative = bool(cfg.rl.speculative_mtp)
    if self.speculative and m.mtp_depths < 1:
      raise ConfigError("rl.speculative_mtp=true drafts with the MTP head, but model.mtp_depths=0: "
                        "set model.mtp_depths >= 1 or rl.speculative_mtp=false")
    self.cfg, self.n_slots, self.max_len = cfg, n_slots, max_len
    self.prefill_chunk = max(16, min(prefill_chunk, max_len))
    rows = cfg.rl.prefill_rows if prefill_rows is None else prefill_rows
    if rows < 0:
      raise ConfigError(f"rl.prefill_rows={rows} must be >= 0 (0 = one mixed call)")
    self.prefill_rows = min(rows, n_slots)  # 0: prefills ride in the mixed call
    self.graphdef, self.params, self.rest, self.version = graphdef, params, rest, version
    self.mesh = mesh
    self._tell = tell  # (op, arrays, **kw) -> arrays: the model call's inputs, to the followers
    self.n_moe, self.k = m.n_moe_layers, m.n_experts_per_tok
    self.edtype = expert_dtype(m.n_routed_experts)
    self._key = jax.random.PRNGKey(seed)
    self._slots = [_Slot() for _ in range(n_slots)]
    self._slot_of: dict = {}
    self._pending: collections.deque = collections.deque()
    self._submitted = 0
    self._done: list[Generation] = []
    self._bufs = self._zeros(lambda: _bufs(init_cache(m, n_slots, max_len)))
    if self.speculative:
      self._mtp_buf = self._zeros(lambda: _bufs(Cache((init_layer_cache(m, n_slots, max_len),)))[0])
      self._draft_logits = self._zeros(lambda: jnp.zeros((n_slots, m.vocab_size), jnp.float32))
    rl = cfg.rl
    rule = (float(rl.temperature), int(rl.top_k), float(rl.top_p), self.n_moe, self.k,
            np.dtype(self.edtype).name, self.speculative)
    self._fn = _step_fn(graphdef, mesh, *rule)
    self._fn_rows = _step_fn(graphdef, mesh, *rule, rows=True) if self.prefill_rows else None
    self.stats = collections.Counter(tokens_decoded=0, prefill_tokens=0, steps=0, seconds=0.0,
                                     generations=0, drafts=0, drafts_kept=0)

  def _zeros(self, make):
    """Per-slot buffers, made on the mesh with their slot rows split over the batch axes (never
    whole on one device: a pod-scale cache is larger than a host)."""
    if self.mesh is None or self.mesh.size == 1:
      return make()
    from jax.sharding import NamedSharding

    from composer_jax.parallel.rules import make_rules, spec_for
    rules = make_rules(self.cfg.mesh.rules)

    def sharding(a):
      axes = [None] * a.ndim
      axes[_row_axis(a)] = "act_batch"
      return NamedSharding(self.mesh, spec_for(axes, a.shape, self.mesh, rules, strict=False))
    return jax.jit(make, out_shardings=jax.tree.map(sharding, jax.eval_shape(make)))()

  def _context(self):
    if self.mesh is None or self.mesh.size == 1:
      return contextlib.nullcontext()
    from composer_jax.parallel.rules import activate, make_rules
    return activate(self.mesh, make_rules(self.cfg.mesh.rules), ep_strategy=self.cfg.mesh.ep_strategy)

  # -- public API ---------------------------------------------------------------------------------

  def set_weights(self, params, rest, version: int) -> None:
    """New weights from the next model call on (caches built by older weights are kept)."""
    self.params, self.rest, self.version = params, rest, version

  def submit(self, req: Request) -> None:
    if req.max_new_tokens < 1:
      raise ValueError(f"request {req.key!r}: max_new_tokens={req.max_new_tokens} must be >= 1")
    if req.key not in self._slot_of and not req.new_tokens:
      raise ValueError(f"request {req.key!r}: the first turn of an episode needs new_tokens")
    self._pending.append((self._submitted, req))
    self._submitted += 1

  def release(self, key) -> None:
    """The episode is over: its slot (and cache) becomes free."""
    if any(r.key == key for _, r in self._pending):
      raise ValueError(f"release({key!r}) with a turn of it still waiting: step until it finishes")
    i = self._slot_of.pop(key, None)
    if i is None:
      return
    if self._slots[i].req is not None:
      raise ValueError(f"release({key!r}) while its turn is still generating")
    self._slots[i] = _Slot()

  def acceptance_rate(self) -> float:
    """Kept MTP drafts / drafts proposed so far (0 without drafts)."""
    return self.stats["drafts_kept"] / max(self.stats["drafts"], 1)

  def free_slots(self) -> int:
    return sum(s.key is None for s in self._slots)

  def busy(self) -> bool:
    return bool(self._pending) or any(s.req is not None for s in self._slots)

  def run(self, requests: list[Request]) -> list[Generation]:
    """Submit all, step until all finish; generations in submission order."""
    first = self._submitted
    for r in requests:
      self.submit(r)
    got: dict[int, Generation] = {}
    while len(got) < len(requests):
      before = len(got)
      for order, g in self._step_ordered():
        if order >= first:
          got[order] = g
      if len(got) == before and not self.busy():
        raise RuntimeError("engine idle with requests unfinished")
      if len(got) == before and not any(s.req is not None for s in self._slots) and self._pending:
        raise RuntimeError("every slot is held by an episode that is not generating: release some")
    return [got[o] for o in sorted(got)]

  def step(self) -> list[Generation]:
    """Admit pending turns, then one model call for every row with tokens to feed."""
    return [g for _, g in self._step_ordered()]

  # -- internals ----------------------------------------------------------------------------------

  def _admit(self) -> None:
    waiting = collections.deque()
    while self._pending:
      order, req = self._pending.popleft()
      i = self._slot_of.get(req.key)
      if i is None:
        free = [j for j, s in enumerate(self._slots) if s.key is None]
        if not free:
          waiting.append((order, req))
          continue
        i = free[0]
        self._slots[i].key = req.key
        self._slot_of[req.key] = i
      slot = self._slots[i]
      if slot.req is not None:  # the episode's previous turn is still generating
        waiting.append((order, req))
        continue
      todo = ([slot.carry] if slot.carry is not None else []) + [int(t) for t in req.new_tokens]
      slot.req, slot.order = req, order
      slot.fed, slot.experts, slot.out, slot.logp, slot.vers = [], [], [], [], []
      if slot.filled + len(todo) > self.max_len:  # the turn cannot be read: the episode is cut
        self._finish(slot, "context")
        continue
      slot.carry, slot.todo = None, todo
    self._pending = waiting

  def _finish(self, slot: _Slot, reason: str) -> None:
    n_fed = len(slot.fed)
    experts = (np.concatenate(slot.experts, 0) if slot.experts
               else np.zeros((0, self.n_moe, self.k), self.edtype))
    assert experts.shape[0] == n_fed
    vers = np.asarray(slot.vers, np.int32)
    gen = Generation(key=slot.req.key, tokens=np.asarray(slot.out, np.int32),
                     logprobs=np.asarray(slot.logp, np.float32), context_experts=experts,
                     context_tokens=np.asarray(slot.fed, np.int32),
                     version=int(vers.min()) if vers.size else self.version, finish=reason,
                     token_versions=vers)
    if slot.out:
      slot.carry = slot.out[-1]
    self._done.append((slot.order, gen))
    slot.req, slot.todo, slot.experts, slot.draft = None, [], [], None
    self.stats["generations"] += 1

  def _step_ordered(self) -> list[tuple[int, Generation]]:
    t0 = time.perf_counter()
    self._admit()
    feeds = []
    for s in self._slots:
      if s.req is None:
        feeds.append([])
      elif s.todo:
        feeds.append(s.todo[: self.prefill_chunk])
      elif s.draft is not None and s.filled + 2 <= self.max_len:
        feeds.append([s.out[-1], s.draft])
      else:
        feeds.append([s.out[-1]])
    if any(feeds):
      if not self.prefill_rows:  # one mixed call: every row padded to the widest feed
        self._call(feeds)
      else:  # decoding rows in one call over all slots, the rows reading a turn in compact calls
        reading = [r for r, s in enumerate(self._slots) if s.req is not None and s.todo]
        if len(reading) < sum(map(bool, feeds)):
          skip = set(reading)
          self._call([[] if r in skip else f for r, f in enumerate(feeds)])
        for i in range(0, len(reading), self.prefill_rows):
          self._call(feeds, reading[i: i + self.prefill_rows])
      self.stats["seconds"] += time.perf_counter() - t0
    done, self._done = self._done, []
    return done

  def _call(self, feeds: list[list[int]], rows: list[int] | None = None) -> None:
    """One model call: over every slot, or (``rows``) over those slots only, padded to
    ``prefill_rows`` rows with other slots that feed nothing (their cache rows come back unchanged)."""
    if rows is None:
      sel = list(range(self.n_slots))
    else:
      taken = set(rows)
      sel = list(rows) + [r for r in range(self.n_slots) if r not in taken][: self.prefill_rows - len(rows)]
      feeds = [feeds[r] if j < len(rows) else [] for j, r in enumerate(sel)]
    slots = [self._slots[r] for r in sel]
    width = max(len(f) for f in feeds)
    s = width if width <= 2 else bucket(width, self.prefill_chunk)
    counts = np.array([len(f) for f in feeds], np.int32)
    index = np.array([sl.filled for sl in slots], np.int32)
    check_room(index, counts, self.max_len)
    tokens = np.zeros((len(sel), s), np.int32)
    for r, f in enumerate(feeds):
      tokens[r, : len(f)] = f
    view = bucket(int((index + counts).max()), self.max_len, MIN_VIEW)
    self._key, sub = jax.random.split(self._key)
    args = {"index": index, "tokens": tokens, "counts": counts, "key": np.asarray(sub)}
    if rows is not None:
      args["rows"] = np.asarray(sel, np.int32)
    if self.speculative:
      return self._call_spec(slots, feeds, args, view)
    ids, logp, routed = self._device(args, view)
    self.stats["steps"] += 1
    for r, (slot, f) in enumerate(zip(slots, feeds)):
      if f and self._feed(slot, f, routed[:, r]):
        self._append(slot, int(ids[r]), float(logp[r]))

  def _device(self, args: dict, view: int) -> tuple:
    """One model call on host inputs; its outputs as host arrays. With followers (``tell``) the
    inputs are broadcast first, so that every process makes the call."""
    if self._tell is not None:
      args = self._tell("engine", args, view=view)
    return self.replay(args, view)

  def replay(self, args: dict, view: int) -> tuple:
    """The model call of ``_device``: what a follower's engine runs for each of the leader's, which
    keeps its cache shards where the leader's are."""
    a = [args[k] for k in ("index", "tokens", "counts")]
    at = (args["rows"],) if "rows" in args else ()
    fn = self._fn_rows if at else self._fn
    with self._context():
      if self.speculative:
        (self._bufs, self._mtp_buf, self._draft_logits, *out) = fn(
            self.params, self.rest, self._bufs, self._mtp_buf, self._draft_logits, *at, *a,
            args["drafted"], args["next_tok"], args["samples"], args["key"], view=view)
      else:
        self._bufs, *out = fn(self.params, self.rest, self._bufs, *at, *a, args["key"], view=view)
    return to_host(tuple(out))

  def _feed(self, slot: _Slot, f: list[int], routed) -> bool:
    """Record the tokens ``f`` kept in the slot's cache (``routed`` [n_moe, >= len(f), k]); whether
    the row's sample counts (False while a prefill has chunks to go)."""
    n = len(f)
    slot.fed += f
    slot.experts.append(routed[:, :n].transpose(1, 0, 2))
    slot.filled += n
    if slot.todo:  # prefilling: the turn's tokens
      slot.todo = slot.todo[n:]
      self.stats["prefill_tokens"] += n
      return not slot.todo  # more chunks to come: this row's sample is meaningless
    return True

  def _call_spec(self, slots, feeds, args, view) -> None:
    drafted = np.array([bool(sl.req is not None and not sl.todo and len(f) == 2)
                        for sl, f in zip(slots, feeds)])
    samples = np.array([bool(f) and len(sl.todo) <= len(f) for sl, f in zip(slots, feeds)])
    next_tok = np.array([sl.todo[len(f)] if len(sl.todo) > len(f) else 0
                         for sl, f in zip(slots, feeds)], np.int32)
    ids, logp, n_out, draft, routed = self._device(
        {**args, "drafted": drafted, "next_tok": next_tok, "samples": samples}, view)
    self.stats["steps"] += 1
    for r, (slot, f) in enumerate(zip(slots, feeds)):
      if not f:
        continue
      req = slot.req
      if drafted[r]:
        self.stats["drafts"] += 1
        kept = n_out[r] == 2
        self.stats["drafts_kept"] += int(kept)
        # a kept draft the turn ends on is not fed: it is the turn's final token (fed next turn)
        ends = kept and (f[1] in req.stop_ids or len(slot.out) + 1 >= req.max_new_tokens)
        if kept and not ends:
          self._feed(slot, f, routed[:, r])
          self._record(slot, f[1], float(logp[r, 0]))
          self._append(slot, int(ids[r, 1]), float(logp[r, 1]))
        else:
          self._feed(slot, f[:1], routed[:, r])
          self._append(slot, int(ids[r, 0]), float(logp[r, 0]))
      elif self._feed(slot, f, routed[:, r]):
        self._append(slot, int(ids[r, 0]), float(logp[r, 0]))
      if slot.req is not None and samples[r]:
        slot.draft = int(draft[r])

  def _record(self, slot: _Slot, tok: int, lp: float) -> None:
    slot.out.append(tok)
    slot.logp.append(lp)
    slot.vers.append(self.version)
    self.stats["tokens_decoded"] += 1

  def _append(self, slot: _Slot, tok: int, lp: float) -> None:
    self._record(slot, tok, lp)
    req = slot.req
    if tok in req.stop_ids:
      self._finish(slot, "stop")
    elif len(slot.out) >= req.max_new_tokens:
      self._finish(slot, "length")
    elif slot.filled >= self.max_len:  # no room to feed this token: the episode is cut
      self._finish(slot, "context")

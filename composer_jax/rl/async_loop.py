"""Asynchronous RL (``rl.async=true``): Ray rollout workers sample while the learner trains.

``AsyncRLRun`` is ``RLRun`` (trainer, scoring, learner batch, metrics, checkpoints, eval) with a
different source of rollouts: ``step()`` keeps the workers fed with task groups from the ``Ledger``
(at most ``tasks_per_step x (max_staleness + 1)`` groups outstanding: more would only go stale),
waits until ``tasks_per_step`` fresh groups have arrived, drops any group whose oldest token lags the
learner by more than ``rl.max_staleness`` versions (its task is re-queued and re-sampled; counted in
``dropped_stale``), trains on the oldest fresh groups, and broadcasts the new weights. Staleness
within the bound is corrected by the loss's importance weights (``rl.is_clip``), as in the seeds.

The workers are topped up *before* the update, so sampling of the next groups overlaps learning.
Metrics beyond the sync loop's: ``rollout_s`` is the time the learner waited for rollouts
(``learner_idle_frac`` = that / step time), ``rollout_idle_frac`` (workers' time outside units),
``rollout_tokens_per_s`` (tokens the workers sampled per second of wall time, dropped ones included),
``staleness_mean/max`` (of the groups taken this step); run totals so far, not per step:
``dropped_stale``, ``worker_deaths``, ``unit_errors``, ``requeued``, ``full_copies``,
``checksum_failures``, ``weight_swaps``; ``worker_devices`` (the fewest devices a worker's sampler
spans: rl.worker_devices), ``broadcast_s/bytes/kind``.
The checkpoint carries the ledger (task stream, re-queued and pending tasks) next to the version and
the trainer's RNG; a resumed run re-queues every task that was handed out but not trained on.
"""

from __future__ import annotations

import collections
import os
import time

import numpy as np

from composer_jax.rl import learner as L
from composer_jax.rl.loop import RLRun, draft_metrics
from composer_jax.rl.orchestrator import Ledger, Orchestrator


class AsyncRLRun(RLRun):

  def __init__(self, cfg, out_dir: str, *, init: str | None = None, resume: bool = False, log=print):
    super().__init__(cfg, out_dir, init=init, resume=resume, log=log)
    self.orch = None
    if not self.leader:  # a follower process of a multi-host learner: no Ray, no ledger
      return
    rl = cfg.rl
    self.ledger = Ledger(self.stream)
    if self.resumed_data and "ledger" in self.resumed_data:
      self.ledger.set_state(self.resumed_data["ledger"])
      if self.ledger.queue:
        log(f"[rl] re-queued {len(self.ledger.queue)} task(s) pending at the checkpoint")
    self.version = self.start
    self.buffer: list[tuple[int, list]] = []  # (group id, rollouts), arrival order
    self.counts = collections.Counter(dropped_stale=0)
    # rl.worker_stream: one group a unit (a worker plays all of its units in one decode batch, so
    # bigger units would only hold finished groups back until their unit's last one is graded); else
    # enough groups to fill the decode batch.
    self.per_unit = (1 if rl.worker_stream else
                     max(1, min(rl.tasks_per_step, rl.decode_batch // rl.group_size)))
    self.max_outstanding = rl.tasks_per_step * (rl.max_staleness + 1)
    self.worker_stats: dict[int, dict] = {}
    self.tokens_since, self.drafts_since = 0, [0, 0]  # drafts proposed, kept (rl.speculative_mtp)
    self.t_last = time.perf_counter()
    self.orch = Orchestrator(cfg, os.path.join(out_dir, "tokenizer.json"), log=log)
    self.last_broadcast = self._broadcast(self.version)

  # -- work in flight -------------------------------------------------------------------------------

  def top_up(self) -> None:
    """Hand out units until the outstanding groups reach the staleness-derived bound."""
    while (n := min(self.per_unit, self.max_outstanding - self.ledger.outstanding())) > 0:
      self.orch.submit(self.ledger.take(n))

  def _collect(self, timeout: float) -> None:
    results, lost = self.orch.wait(timeout)
    for unit in lost:
      for gid, _ in unit:
        self.ledger.requeue(gid)
    for res in results:
      self.tokens_since += res["tokens"]
      self.drafts_since[0] += res.get("drafts", 0)
      self.drafts_since[1] += res.get("drafts_kept", 0)
      self.worker_stats[res["worker"]] = res
      for gid, rollouts in sorted(res["groups"].items()):
        self.buffer.append((gid, rollouts))

  def staleness(self, rollouts: list) -> int:
    """Learner version minus the oldest version that sampled a token of the group."""
    vs = [int(s.versions[s.loss_mask > 0].min()) for r in rollouts for s in r.segments
          if s.generated]
    return self.version - min(vs) if vs else 0

  def _drop_stale(self) -> None:
    keep = []
    for gid, rollouts in self.buffer:
      if self.staleness(rollouts) > self.cfg.rl.max_staleness:
        self.ledger.requeue(gid)  # re-sampled with fresher weights
        self.counts["dropped_stale"] += 1
      else:
        keep.append((gid, rollouts))
    self.buffer = keep

  # -- one learner step -------------------------------------------------------------------------------

  def step(self, step: int) -> dict:
    rl = self.cfg.rl
    t0 = time.perf_counter()
    self.top_up()
    self._drop_stale()
    # Oldest fresh groups first; with rl.dynamic_sampling, groups that all scored alike are retired
    # untrained and more are taken, up to dynamic_max_rounds x tasks_per_step in all.
    limit = rl.tasks_per_step * (rl.dynamic_max_rounds if rl.dynamic_sampling else 1)
    drawn, flags = [], []
    while sum(flags) < rl.tasks_per_step and len(drawn) < limit:
      while not self.buffer:
        self._collect(timeout=1.0)
        self._drop_stale()
        self.top_up()
      gid, rs = self.buffer.pop(0)
      drawn.append(rs)
      flags.append((not rl.dynamic_sampling) or L.informative(rs, self.cfg))
      self.observe(self.ledger.done(gid), [r.resolved for r in rs])
    waited = time.perf_counter() - t0
    stale = [self.staleness(rs) for rs in drawn]
    if rl.max_staleness > 0:  # the workers sample the next groups while the learner updates (with
      self.top_up()  # max_staleness=0 they would be stale before they are trained on)
    keep, report, untrained = self._select(drawn, flags)
    rec = self.learn(step, keep, report, waited, untrained)
    now = time.perf_counter()
    ws = list(self.worker_stats.values())
    busy, alive = sum(w["busy_s"] for w in ws), sum(w["alive_s"] for w in ws)
    rec.update({
        "staleness_mean": float(np.mean(stale)), "staleness_max": int(max(stale)),
        "dropped_stale": self.counts["dropped_stale"], **self.orch.counts,
        "full_copies": int(sum(w["full_copies"] for w in ws)),
        "checksum_failures": int(sum(w["checksum_failures"] for w in ws)),
        "weight_swaps": int(sum(w["swaps"] for w in ws)),
        "worker_devices": int(min(w["devices"] for w in ws)),
        "learner_idle_frac": waited / max(now - t0, 1e-9),
        "rollout_idle_frac": 1.0 - busy / alive if alive else 0.0,
        "rollout_tokens_per_s": self.tokens_since / max(now - self.t_last, 1e-9),
        **self.last_broadcast})
    if rl.speculative_mtp:
      rec.update(draft_metrics(*self.drafts_since))
    self.tokens_since, self.t_last, self.drafts_since = 0, now, [0, 0]
    return rec

  def publish(self, version: int) -> None:
    super().publish(version)  # the local engine (end-of-run eval) follows the learner too
    self.version = version
    self.last_broadcast = self._broadcast(version)

  def _broadcast(self, version: int) -> dict:
    """The weights of ``version`` to the workers: gathered onto the leader and put from there, or
    (rl.broadcast_from=shards) put by every learner process, each its own shards."""
    if self.cfg.rl.broadcast_from == "shards":
      t0 = time.perf_counter()
      return self.orch.send(*self.group.pieces(version), t0)
    return self.orch.broadcast(self.group.weights(version), version)

  def checkpoint_data(self, step: int) -> dict:
    return {**super().checkpoint_data(step), "ledger": self.ledger.state()}

  def run(self) -> dict:
    try:
      return super().run()
    finally:
      if self.orch is not None:
        self.orch.shutdown()

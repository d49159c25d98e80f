"""A scripted stand-in for the sampler engine (same API and token-in-token-out contract)."""

from __future__ import annotations

import numpy as np

from composer_jax.rl.sampler import Generation

N_MOE, K = 2, 2


class ScriptedEngine:
  """The Engine API, answering each request with the next scripted text of its episode.

  It honours the sampler's contract: ``context_tokens`` are exactly the tokens fed (the previous
  turn's last token first, then the new tokens, then all generated tokens but the last)."""

  def __init__(self, tok, script, n_slots, n_moe=N_MOE, k=K):
    self.tok, self.script, self.n_slots, self.n_moe, self.k = tok, script, n_slots, n_moe, k
    self.pending, self.carry, self.turn = [], {}, {}
    self.held, self.max_held, self.released = set(), 0, []

  def submit(self, req):
    assert req.key in self.held or len(self.held) < self.n_slots, "more live episodes than slots"
    self.held.add(req.key)
    self.max_held = max(self.max_held, len(self.held))
    self.pending.append(req)

  def release(self, key):
    self.held.discard(key)
    self.carry.pop(key, None)
    self.released.append(key)

  def busy(self):
    return bool(self.pending)

  def step(self):
    out = []
    for req in self.pending:
      n = self.turn.get(req.key[0], 0)
      self.turn[req.key[0]] = n + 1
      text = self.script(req, n)
      ids = self.tok.encode(text)[: req.max_new_tokens - 1] + [req.stop_ids[0]]
      fed = self.carry.get(req.key, []) + list(req.new_tokens) + ids[:-1]
      self.carry[req.key] = ids[-1:]
      rng = np.random.default_rng(len(fed))
      out.append(Generation(key=req.key, tokens=np.asarray(ids, np.int32),
                            logprobs=-rng.random(len(ids)).astype(np.float32),
                            context_experts=rng.integers(0, 4, (len(fed), self.n_moe, self.k)).astype(np.int16),
                            context_tokens=np.asarray(fed, np.int32), version=7, finish="stop"))
    self.pending = []
    return out

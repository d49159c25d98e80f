"""Which RL tasks to draw: in a seeded permutation (``TaskStream``), or by family (``FamilyStream``).

A group teaches the policy something only when some of its episodes resolve the task and some do
not (``learner.informative``). On a task set where whole families (a template at a difficulty
level) are never or always solved, most drawn groups teach nothing; dynamic sampling then draws
more and throws them away. ``FamilyStream`` (``rl.curriculum=family``) draws a family with
probability proportional to the chance that a group of it has both outcomes, estimated from that
family's recent groups, then the family's next task. Filters by pass rate per prompt (DAPO's
dynamic sampling, Kimi k1.5's prioritised sampling) need prompts that come back; the main job's RL
tasks are fresh (each drawn about once a run), so the family is what comes back.

Both streams share one interface: ``take(k)`` task indices, ``observe(task, resolved)`` after a
group is graded (the plain stream ignores it), and ``state``/``set_state`` for the checkpoint, so a
resumed run neither repeats nor skips a task and keeps its estimates.
"""

from __future__ import annotations

import numpy as np

from composer_jax.config import ConfigError


class TaskStream:
  """Tasks in a fresh seeded permutation per epoch; its state (epoch, position) is checkpointed so a
  resumed run neither repeats nor skips a task."""

  def __init__(self, n: int, seed: int | tuple):
    self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

  def _order(self) -> np.ndarray:
    return np.random.default_rng([*np.atleast_1d(self.seed), self.epoch]).permutation(self.n)

  def take(self, k: int) -> list[int]:
    out = []
    while len(out) < k:
      if self.pos >= self.n:
        self.epoch, self.pos = self.epoch + 1, 0
      out.append(int(self._order()[self.pos]))
      self.pos += 1
    return out

  def observe(self, task: int, resolved: list) -> None:
    del task, resolved  # the order does not depend on outcomes

  def state(self) -> dict:
    return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

  def set_state(self, st: dict) -> None:
    if st.get("kind", "permutation") != "permutation":
      raise ConfigError(f"--resume: the checkpoint drew tasks with rl.curriculum={st['kind']}: resume "
                        "with the same rl.curriculum")
    if st.get("n") != self.n:
      raise ConfigError(f"--resume: the checkpoint's task stream has {st.get('n')} tasks, rl.tasks "
                        f"has {self.n}: resume with the same rl.tasks")
    self.epoch, self.pos = int(st["epoch"]), int(st["pos"])


def family_of(task) -> str:
  """A task's family: its template and level where the task says them (synthetic tasks), else its
  repository."""
  d = getattr(task, "difficulty", None) or {}
  if "kind" in d and "level" in d:
    return f"{d['kind']}-d{d['level']}"
  return task.repo


def mixed_outcome_prob(wins: np.ndarray, tries: np.ndarray, group_size: int) -> np.ndarray:
  """P(a group of ``group_size`` episodes has both outcomes) at each family's posterior-mean pass
  rate under a uniform Beta(1, 1) prior: 1 - p^G - (1 - p)^G. An unseen family gets p = 1/2, the
  highest weight, so every family is tried; a family that never resolves keeps p >= 1/(tries + 2)."""
  p = (np.asarray(wins, np.float64) + 1.0) / (np.asarray(tries, np.float64) + 2.0)
  return 1.0 - p ** group_size - (1.0 - p) ** group_size


class FamilyStream:
  """Draws a family by ``mixed_outcome_prob``, then that family's next task (a ``TaskStream`` per
  family). Outcomes decay by ``decay`` per group observed in the family, so the estimate follows
  a policy that improves (an effective window of ~1/(1 - decay) groups)."""

  def __init__(self, families: list[str], seed: int, group_size: int, decay: float = 0.8):
    self.names = sorted(set(families))
    idx = {f: i for i, f in enumerate(self.names)}
    self.family = np.array([idx[f] for f in families], np.int64)
    self.members = [np.flatnonzero(self.family == i) for i in range(len(self.names))]
    self.seed, self.group_size, self.decay = seed, group_size, decay
    self.wins = np.zeros(len(self.names))
    self.tries = np.zeros(len(self.names))
    self.within = [TaskStream(len(m), (seed, f)) for f, m in enumerate(self.members)]
    self.draws = 0

  @property
  def n(self) -> int:
    return len(self.family)

  def weights(self) -> np.ndarray:
    w = mixed_outcome_prob(self.wins, self.tries, self.group_size)
    return w / w.sum()

  def take(self, k: int) -> list[int]:
    out = []
    for _ in range(k):
      rng = np.random.default_rng([self.seed, 1 << 20, self.draws])  # one seed per draw: resumable
      self.draws += 1
      f = int(rng.choice(len(self.names), p=self.weights()))
      out.append(int(self.members[f][self.within[f].take(1)[0]]))
    return out

  def observe(self, task: int, resolved: list) -> None:
    f = self.family[task]
    self.wins[f] = self.decay * self.wins[f] + float(sum(bool(r) for r in resolved))
    self.tries[f] = self.decay * self.tries[f] + float(len(resolved))

  def state(self) -> dict:
    return {"kind": "family", "n": self.n, "families": self.names, "wins": self.wins.tolist(),
            "tries": self.tries.tolist(), "within": [w.state() for w in self.within],
            "draws": self.draws}

  def set_state(self, st: dict) -> None:
    if st.get("kind") != "family" or st.get("n") != self.n or st.get("families") != self.names:
      raise ConfigError("--resume: the checkpoint's task stream does not match rl.tasks and "
                        "rl.curriculum=family: resume with the same rl.tasks and rl.curriculum")
    self.wins, self.tries = np.asarray(st["wins"], np.float64), np.asarray(st["tries"], np.float64)
    for w, ws in zip(self.within, st["within"], strict=True):
      w.set_state(ws)
    self.draws = int(st["draws"])


def make_stream(tasks: list, cfg):
  """The task stream ``rl.curriculum`` names."""
  rl = cfg.rl
  if rl.curriculum == "family":
    return FamilyStream([family_of(t) for t in tasks], rl.seed, rl.group_size, rl.curriculum_decay)
  return TaskStream(len(tasks), rl.seed)

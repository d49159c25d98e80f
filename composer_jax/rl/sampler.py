"""The RL sampler: the rollout ``Engine`` (composer_jax.rl.engine) and the sampling rule
(composer_jax.rl.sampling), under the name the agent and the loop import."""

from __future__ import annotations

from composer_jax.rl.engine import Engine, Generation, Request, expert_dtype
from composer_jax.rl.sampling import sample, truncate

__all__ = ["Engine", "Generation", "Request", "expert_dtype", "sample", "truncate"]

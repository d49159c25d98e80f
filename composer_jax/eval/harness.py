"""The benchmark harness: every task N times with a policy → trajectories, summary.json, a PNG."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from collections.abc import Callable

from composer_jax.env.episode import NullPolicy, OraclePolicy, run_episode
from composer_jax.env.guards import Flag, is_hack
from composer_jax.env.sandbox import Limits
from composer_jax.env.tasks import Task
from composer_jax.eval.bench import summarize
from composer_jax.eval.plots import plot_score_vs_tokens

SCRIPTED = {"oracle": OraclePolicy, "null": NullPolicy}


class PolicyError(ValueError):
  pass


def make_policy_factory(spec: str) -> Callable[[], object]:
  """``oracle`` | ``null`` (model policies run batched through ``rl.loop.eval_run_dir``)."""
  if spec in SCRIPTED:
    return SCRIPTED[spec]
  raise PolicyError(f"--policy {spec!r}: scripted policies are {sorted(SCRIPTED)}; a model policy "
                    "(a run directory) runs through composer_jax.rl.loop.eval_run_dir")


def run_eval(tasks: list[Task], make_policy: Callable[[], object], samples: int, out_dir: str,
             ks: list[int] = (1,), limits: Limits = Limits(), mode: str = "auto",
             max_turns: int = 30, workers: int = 2, verbose_prompt: bool = False,
             log=print) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  t0 = time.perf_counter()
  jobs = [(t, s) for t in tasks for s in range(samples)]
  results: dict[str, list[dict]] = {t.instance_id: [] for t in tasks}
  probe = make_policy()
  policy_name = getattr(probe, "name", "policy")
  # Anything but a scripted policy is driven by a model and never runs unisolated.
  model_driven = getattr(probe, "model_driven", not isinstance(probe, tuple(SCRIPTED.values())))

  def one(job):
    task, _ = job
    return task, run_episode(task, make_policy(), limits, mode, max_turns, verbose_prompt,
                             model_driven=model_driven)

  with open(os.path.join(out_dir, "trajectories.jsonl"), "w") as traj_file, \
      cf.ThreadPoolExecutor(max(1, workers)) as pool:
    for i, (task, traj) in enumerate(pool.map(one, jobs), 1):
      hack = is_hack([Flag(**f) for f in traj.flags])
      results[task.instance_id].append({
          "reward": traj.reward, "resolved": traj.resolved, "completion_tokens": traj.completion_tokens,
          "tool_calls": traj.tool_calls, "format_errors": traj.format_errors, "wall_s": traj.wall_s,
          "hack": hack})
      traj_file.write(json.dumps(traj.to_json()) + "\n")
      if i % 10 == 0 or i == len(jobs):
        log(f"[eval] {i}/{len(jobs)} episodes, {time.perf_counter() - t0:.0f} s")
  summary = {"policy": policy_name, **summarize(results, list(ks)),
             "elapsed_s": round(time.perf_counter() - t0, 2)}
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  plot_score_vs_tokens(summary, os.path.join(out_dir, "score_vs_tokens.png"),
                       f"{policy_name}: {summary['tasks']} tasks x {samples}")
  return summary

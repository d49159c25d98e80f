"""Async vs sync RL on the same work: wall time of S learner steps (each tasks_per_step x group_size
episodes of synthetic tasks on the tests' tiny MoE), after one warm-up step that compiles everything,
run by the synchronous loop and by the asynchronous loop (Ray workers, rl.max_staleness). Reports
async / sync speed (sync wall / async wall), the learner's idle fraction (waiting for rollouts), the
rollout workers' idle fraction and rollout tokens/s, and what bounds the ratio on this machine: the
share of all cores busy during each loop (every process: Ray workers, sandboxes, XLA threads), the
ceiling 1 / (sync's share) that overlap cannot pass while the CPU work stays the same, and async's CPU
work per step against sync's.

  python experiments/rl_async.py [--steps 4] [--workers 1] [--staleness 1] [--worker-cpus 1]
      [--worker-xla-flags=--xla_cpu_multi_thread_eigen=false] [--worker-priority idle,normal,low] [--note "..."]

``--worker-cpus N`` times the async loop a second time with its workers pinned to N cores and the
learner to the rest (``rl.worker_cpus``), against the same sync run, and writes ``..._pinned.json``;
``--worker-xla-flags`` gives the async run's workers XLA flags of their own (``rl.worker_xla_flags``)
and writes ``..._worker_xla.json``; ``--worker-priority`` (a comma list of normal, low and idle) times one
async run per value against the same sync run (``rl.worker_priority``) and adds ``_low`` / ``_idle``
to the name.

With ``--run DIR`` (a `composer-jax run` directory) it times the main job's RL instead: DIR's SFT
policy, DIR's RL tasks and DIR's config with its ``run.rl_overrides``, but without dynamic sampling
and the family curriculum, so that both loops sample the same number of episodes of the same tasks
a step -> results/rl_async_main_job.json.

Both loops use JAX's persistent compilation cache, as every `composer-jax` command does
(``cli.compile_cache_env``), so a length bucket first met in a timed step costs what it costs in the
main job; ``--cold`` turns the cache off (before stop 54 the benchmark ran without it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import CpuMeter, write_result

MODEL = ["model.vocab_size=640", "model.d_model=48", "model.n_layers=4", "model.n_dense_layers=1",
         "model.dense_ffn_dim=96", "model.n_heads=2", "model.q_lora_rank=0", "model.kv_lora_rank=16",
         "model.qk_nope_dim=8", "model.qk_rope_dim=8", "model.v_head_dim=8",
         "model.n_routed_experts=8", "model.moe_ffn_dim=16", "model.n_group=2", "model.topk_group=2",
         "model.mtp_depths=0", "model.max_seq_len=2048", "mesh.data=1"]
RL = ["rl.group_size=2", "rl.max_new_tokens=24", "rl.decode_batch=4", "rl.max_context=2048",
      "env.max_turns=3", "env.tool_docs=brief", "env.timeout_s=10", "checkpoint.every=0",
      "checkpoint.async_save=false", "train.progress=false", "optim.warmup_steps=0", "optim.lr=1e-3"]


def _world(root: str) -> tuple[str, str]:
  from composer_jax.config import load_config
  from composer_jax.env import synthetic
  from composer_jax.train.loop import run
  corpus = os.path.join(root, "corpus")
  os.makedirs(corpus)
  for i, f in enumerate(("templates.py", "__init__.py")):
    with open(os.path.join(os.path.dirname(synthetic.__file__), f)) as src, \
         open(os.path.join(corpus, f"{i}.txt"), "w") as out:
      out.write(src.read())
  init = os.path.join(root, "init")
  run(load_config(None, MODEL + ["train.steps=1", "data.seq_len=64", "data.batch_size=2",
                                 f"data.sources=[{corpus}]", "data.tokenizer_train_mb=1",
                                 "data.heldout_fraction=0", "checkpoint.async_save=false",
                                 "train.progress=false"]), init)
  tasks = os.path.join(root, "tasks")
  synthetic.generate(16, seed=5, out=tasks, split="train")
  return init, tasks


def _slots(recs) -> int:
  """Token slots the learner computed over these steps (rows x row length, padding included)."""
  return sum(r["learner_rows"] * r["learner_row_length"] for r in recs)


def cfg_episodes(make) -> int:
  rl = make([]).rl
  return rl.tasks_per_step * rl.group_size


def _timed(run, steps: int) -> tuple[float, list[dict], dict]:
  """Wall seconds of ``steps`` steps after a warm-up, their records, and the machine's CPU use."""
  run.step(1)  # warm-up: compiles the engine and the train step
  t0 = time.perf_counter()
  recs = []
  with CpuMeter() as cpu:
    for s in range(2, steps + 2):
      t = time.perf_counter()
      recs.append(run.step(s))
      recs[-1]["wall_s"] = time.perf_counter() - t
  use = {"busy_frac": cpu.busy_frac, "busy_core_s_per_step": cpu.busy_core_s / steps,
         "learner_core_s_per_step": cpu.own_core_s / steps, "steal_frac": cpu.steal_frac}
  return time.perf_counter() - t0, recs, use


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--tasks-per-step", type=int, default=2)
  ap.add_argument("--workers", type=int, default=1)
  ap.add_argument("--staleness", type=int, default=1)
  ap.add_argument("--worker-cpus", type=int, default=0,
                  help="rl.worker_cpus of the async run: workers and learner on cores of their own")
  ap.add_argument("--worker-xla-flags", default="",
                  help="rl.worker_xla_flags of the async run, e.g. "
                       "--worker-xla-flags=--xla_cpu_multi_thread_eigen=false")
  ap.add_argument("--worker-priority", default="normal",
                  help="rl.worker_priority of the async run (normal, low or idle); a comma list "
                       "times one async run per value against the same sync run")
  ap.add_argument("--cold", action="store_true", help="no persistent compilation cache")
  ap.add_argument("--note", default="")
  ap.add_argument("--run", default="", help="time the RL stage of this `composer-jax run` directory")
  a = ap.parse_args(argv)
  prios = a.worker_priority.split(",")
  if not set(prios) <= {"normal", "low", "idle"}:
    ap.error(f"--worker-priority={a.worker_priority}: each value must be normal, low or idle")
  from composer_jax.cli import compile_cache_env
  if a.cold:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = ""
  compile_cache_env(os.environ)  # before jax is imported; the Ray workers inherit it
  from composer_jax.config import load_config
  from composer_jax.recipe import Recipe, sft_policy
  from composer_jax.rl.async_loop import AsyncRLRun
  from composer_jax.rl.loop import RLRun
  root = tempfile.mkdtemp(prefix="rl_async_")
  if a.run:
    base = load_config(os.path.join(a.run, "config.yaml"))
    init = os.path.join(a.run, sft_policy(base))
    over = ["rl.dynamic_sampling=false", "rl.curriculum=none", f"rl.steps={a.steps + 1}",
            "checkpoint.every=0", "train.progress=false"]
    recipe = Recipe(base, a.run, resume=True, log=lambda m: None)
    make = lambda extra: recipe.rl_config(over + extra)  # as the main job builds its RL stage
  else:
    init, tasks = _world(root)
    over = MODEL + RL + [f"rl.tasks={tasks}", f"rl.tasks_per_step={a.tasks_per_step}",
                         f"rl.steps={a.steps + 1}"]
    make = lambda extra: load_config(None, over + extra)
  quiet = lambda m: None
  sync = RLRun(make(["rl.async=false"]), os.path.join(root, "sync"), init=init, log=quiet)
  sync_s, sync_recs, sync_cpu = _timed(sync, a.steps)
  sync.rollout_file.close()
  sync_tok = sum(r["completion_tokens_mean"] * cfg_episodes(make) for r in sync_recs)
  res = {"run": a.run or None, "steps": a.steps, "workers": a.workers, "max_staleness": a.staleness,
         "worker_xla_flags": a.worker_xla_flags, "worker_priority": prios,
         "compile_cache": os.environ["JAX_COMPILATION_CACHE_DIR"] or None,
         "goal": ">= 1.3", "sync_wall_s": sync_s,
         "sync": {"rollout_s_frac": float(np.sum([r["rollout_s"] for r in sync_recs]) / sync_s),
                  "learn_s_frac": float(np.sum([r["learn_s"] for r in sync_recs]) / sync_s),
                  "trained_tokens_per_s": sync_tok / sync_s,
                  "wall_s": [round(r["wall_s"], 2) for r in sync_recs],
                  "rollout_s": [round(r["rollout_s"], 2) for r in sync_recs],
                  "learn_s": [round(r["learn_s"], 2) for r in sync_recs],
                  "row_length": [r["learner_row_length"] for r in sync_recs],
                  "learner_slots_per_s": _slots(sync_recs) / sync_s, "cpu": sync_cpu},
         # What limits async on this machine: it can only fill the cores the sync loop leaves idle.
         # Doing the same CPU work, it cannot beat sync by more than 1 / sync's busy fraction.
         "cpu_ceiling_speedup": 1.0 / max(sync_cpu["busy_frac"], 1e-9),
         "note": a.note}
  # The async run with every process on every core at each priority, then (--worker-cpus N) pinned.
  variants = [(0, p) for p in prios] + ([(a.worker_cpus, prios[0])] if a.worker_cpus else [])
  for i, (pin, prio) in enumerate(variants):
    cfg = make(["rl.async=true", f"rl.num_workers={a.workers}", f"rl.max_staleness={a.staleness}",
                f"rl.worker_cpus={pin}", f"rl.worker_xla_flags={a.worker_xla_flags}",
                f"rl.worker_priority={prio}"])
    run = AsyncRLRun(cfg, os.path.join(root, f"async{i}"), init=init, log=quiet)
    try:
      async_s, recs, cpu = _timed(run, a.steps)
    finally:
      run.orch.shutdown()
    res.update(tasks_per_step=cfg.rl.tasks_per_step, group_size=cfg.rl.group_size, epochs=cfg.rl.epochs)
    key = "async" if i == 0 else f"async_worker_cpus_{pin}" if pin else f"async_{prio}"
    res[key] = {
        "wall_s": async_s, "speedup": sync_s / async_s,
        # Without the first timed step: the sync engine's first rollout after a weight update
        # recompiles (trainer-placed params), which the workers' host-copied weights never trigger.
        "speedup_steady": (sum(r["wall_s"] for r in sync_recs[1:])
                           / max(sum(r["wall_s"] for r in recs[1:]), 1e-9)),
        "learner_idle_frac": float(np.mean([r["learner_idle_frac"] for r in recs])),
        "rollout_idle_frac": float(recs[-1]["rollout_idle_frac"]),
        "rollout_tokens_per_s": float(np.mean([r["rollout_tokens_per_s"] for r in recs])),
        "trained_tokens_per_s": sum(r["completion_tokens_mean"] for r in recs) * cfg_episodes(make) / async_s,
        "staleness_mean": float(np.mean([r["staleness_mean"] for r in recs])),
        "dropped_stale": int(recs[-1]["dropped_stale"]),
        "step_wall_s": [round(r["wall_s"], 2) for r in recs],
        "wait_s": [round(r["rollout_s"], 2) for r in recs],
        "learn_s": [round(r["learn_s"], 2) for r in recs],
        # The learner's work follows its rows' length bucket (768-1536 tokens: 12-44 s a step on the
        # main job), which each loop's own samples set; slots/s compares the work actually done.
        "row_length": [r["learner_row_length"] for r in recs],
        "learner_slots_per_s": _slots(recs) / async_s,
        "slots_speedup": (_slots(recs) / async_s) / max(_slots(sync_recs) / sync_s, 1e-9), "cpu": cpu,
        # > 1: the overlapped processes did more CPU work for the same steps (contention, spinning)
        "cpu_work_vs_sync": cpu["busy_core_s_per_step"] / max(sync_cpu["busy_core_s_per_step"], 1e-9)}
    r = res[key]
    print(f"{key}: sync {sync_s:.1f} s, async {async_s:.1f} s -> {r['speedup']:.2f}x "
          f"(steady {r['speedup_steady']:.2f}x); learner idle {r['learner_idle_frac']:.2f}, rollout idle "
          f"{r['rollout_idle_frac']:.2f}, rollout {r['rollout_tokens_per_s']:.1f} tok/s; cores busy: "
          f"sync {sync_cpu['busy_frac']:.2f} (ceiling {res['cpu_ceiling_speedup']:.2f}x), async "
          f"{cpu['busy_frac']:.2f}; async CPU work / sync {r['cpu_work_vs_sync']:.2f}; learner "
          f"token slots/s async / sync {r['slots_speedup']:.2f}x (row lengths: sync "
          f"{res['sync']['row_length']}, async {r['row_length']})")
  res["speedup"] = res["async"]["speedup"]
  write_result(("rl_async_main_job" if a.run else "rl_async") + ("_pinned" if a.worker_cpus else "")
               + ("_worker_xla" if a.worker_xla_flags else "")
               + "".join("" if p == "normal" else "_" + p for p in prios), res)
  return 0


if __name__ == "__main__":
  sys.exit(main())

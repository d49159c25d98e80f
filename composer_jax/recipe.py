"""``composer-jax run CONFIG --out DIR``: the whole recipe in one command.

  1. tokenizer + continued pretraining on the code corpus        DIR/pretrain
     (from ``run.base`` and its tokenizer when set, else from random weights)
  2. synthetic coding tasks: SFT's, RL's own (none of SFT's),     DIR/tasks/{train,rl,heldout,unseen}
     held-out instances of the training templates, and templates
     no stage trains on
  3. scripted-expert trajectories through the real tools          DIR/sft/trajectories.jsonl
  4. SFT on them (with drills)                                    DIR/sft
     then, when run.anneal_steps > 0, SFT on the expert chats alone  DIR/anneal
     (the SFT policy from here on)
  5. evaluation of the SFT policy on the held-out sets            DIR/eval/sft-{heldout,unseen}
  6. RL from it on its tasks (rl.async_ picks the Ray loop)       DIR/rl
  7. evaluation of the RL policy                                  DIR/eval/rl-{heldout,unseen}

Each stage runs with the config plus its ``run.<stage>_overrides`` and leaves ``DONE.json``; with
``--resume`` finished stages are skipped and an interrupted training stage resumes from its newest
checkpoint. The closing table (pass@1 with a 95 % bootstrap interval over tasks, pass@k, mean
completion tokens, wall time per stage) is printed and written to DIR/summary.json, with the plots
of every stage and a score-vs-tokens plot comparing the SFT and RL policies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from composer_jax.config import Config, ConfigError, apply_overrides, from_dict
from composer_jax.eval.bench import pass_at_k
from composer_jax.parallel.multihost import (
  barrier,
  broadcast_json,
  is_primary,
  on_primary,
)

STAGES = ("pretrain", "tasks", "expert", "sft", "anneal", "eval_sft", "rl", "eval_rl")


def sft_policy(cfg: Config) -> str:
  """The stage folder holding the SFT policy that is evaluated and that RL starts from."""
  return "anneal" if cfg.run.anneal_steps > 0 else "sft"


def stage_config(cfg: Config, overrides: list[str]) -> Config:
  return from_dict(apply_overrides(cfg.to_dict(), list(overrides)))


def bootstrap_ci(per_task: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
  """95 % percentile interval of the mean over tasks, resampling tasks with replacement."""
  x = np.asarray(per_task, np.float64)
  if x.size == 0:
    return (float("nan"), float("nan"))
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, x.size, (n_boot, x.size))].mean(1)
  return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired_difference(before: dict, after: dict, k: int = 1) -> dict:
  """RL minus SFT on the tasks both evaluated (``per_task`` of eval summaries: {id: {"c", "n"}}):
  the mean per-task difference of pass@k (unbiased, from each task's c of n samples; c / n at k = 1)
  and its paired 95 % interval. Pairing removes the spread between tasks (a hard task is hard for
  both policies), so the interval is narrower than the two policies' own intervals suggest."""
  return pooled_difference([(before, after)], k)


def pooled_difference(pairs: list[tuple[dict, dict]], k: int = 1) -> dict:
  """``paired_difference`` over several (before, after) pairs scored on the same tasks, such as
  seed-matched runs of two settings: each task's difference is averaged over the pairs, then the
  mean over tasks and its 95 % interval, resampling tasks (the pairs share them)."""
  ids = sorted(set.intersection(*(set(b) & set(a) for b, a in pairs)))
  d = [float(np.mean([pass_at_k(a[i]["n"], a[i]["c"], k) - pass_at_k(b[i]["n"], b[i]["c"], k)
                      for b, a in pairs])) for i in ids]
  lo, hi = bootstrap_ci(d)
  return {"mean": float(np.mean(d)) if d else float("nan"), "ci95": [lo, hi], "tasks": len(ids)}


class Recipe:
  def __init__(self, cfg: Config, out: str, resume: bool = False, log=print):
    self.cfg, self.out, self.resume, self.log = cfg, os.path.abspath(out), resume, log
    self.times: dict[str, float] = {}
    check_run_out(cfg, out, resume)  # `run` checked already; here for every other caller
    barrier("recipe_out_checked")  # several processes: each looked before any of them wrote
    if is_primary():
      os.makedirs(self.out, exist_ok=True)
    barrier("recipe_out_made")

  def path(self, *parts) -> str:
    return os.path.join(self.out, *parts)

  def _done(self, stage: str) -> dict | None:
    p = self.path(".stages", f"{stage}.json")
    return json.load(open(p)) if os.path.exists(p) else None

  def _mark(self, stage: str, info: dict) -> None:
    os.makedirs(self.path(".stages"), exist_ok=True)
    with open(self.path(".stages", f"{stage}.json"), "w") as f:
      json.dump(info, f, indent=1)

  def stage(self, name: str, fn, policy: str | None = None, primary_only: bool = False) -> dict:
    """Run stage ``name`` unless it is done. ``policy``: the stage folder it reads weights from,
    recorded, and checked on --resume (a stage done from another SFT policy is not reused).
    Several processes (``mesh.distributed``): the training stages run on all of them, a
    ``primary_only`` stage (files the others read: tasks, expert chats, evaluations) on process 0
    while the others wait; process 0's record of the stage is everyone's."""
    done = broadcast_json(self._done(name))  # process 0's view: every process skips or runs alike
    if done is not None and policy is not None and done.get("policy", "sft") != policy:
      raise ConfigError(f"--resume: stage {name} was done from the {done.get('policy', 'sft')} policy, but "
                        f"this config's SFT policy is {policy} (run.anneal_steps): use a new --out")
    if done is not None:
      self.log(f"== {name}: done earlier, skipped")
      self.times[name] = done.get("wall_s", 0.0)
      return done
    self.log(f"== {name}")
    t0 = time.perf_counter()
    info = on_primary(f"stage_{name}", fn) if primary_only else fn()
    info = dict(broadcast_json(info or {}))
    if policy is not None:
      info["policy"] = policy
    info["wall_s"] = round(broadcast_json(time.perf_counter() - t0), 1)
    self.times[name] = info["wall_s"]
    if is_primary():
      self._mark(name, info)
    barrier(f"recipe_{name}_marked")
    return info

  # -- stages ---------------------------------------------------------------------------------------

  def _train(self, stage: str, overrides: list[str], init: str | None, kind: str | None = None) -> dict:
    """Train into DIR/stage; ``kind`` is the training loop's stage (its data: "sft" reads chats,
    "pretrain" the corpus), the folder's name when not given."""
    from composer_jax.train.loop import run
    cfg = stage_config(self.cfg, overrides)
    d = self.path(stage)
    resume = os.path.isdir(os.path.join(d, "checkpoints")) and bool(os.listdir(os.path.join(d, "checkpoints")))
    last = run(cfg, d, stage=kind or stage, resume=resume, init=None if resume else init)
    return {"final": {k: v for k, v in last.items() if isinstance(v, (int, float))}}

  def _tasks(self) -> dict:
    from composer_jax.env import synthetic
    r, t = self.cfg.run, self.path("tasks")
    train = synthetic.generate(r.train_tasks, r.task_seed, os.path.join(t, "train"), split="train")
    held = synthetic.generate(r.heldout_tasks, r.task_seed + 1, os.path.join(t, "heldout"),
                              split="heldout", templates=r.train_templates)
    unseen = synthetic.generate(r.unseen_tasks, r.task_seed + 2, os.path.join(t, "unseen"),
                                split="heldout", templates=r.unseen_templates)
    out = {k: v["n"] for k, v in (("train", train), ("heldout", held), ("unseen", unseen))}
    if r.rl_tasks:
      out["rl"] = self._make_rl_tasks()["n"]
    return out

  def _make_rl_tasks(self) -> dict:
    """RL's tasks: the training templates' split under a seed of its own, minus SFT's instances."""
    from composer_jax.env import synthetic
    r = self.cfg.run
    with open(self.path("tasks", "train", "synthetic_report.json")) as f:
      sft_ids = json.load(f)["instance_ids"]
    return synthetic.generate(r.rl_tasks, r.task_seed + 3, self.path("tasks", "rl"), split="train",
                              templates=r.train_templates,
                              exclude={i.rsplit("-", 1)[1] for i in sft_ids})

  def _rl_tasks_dir(self) -> str:
    if not self.cfg.run.rl_tasks:
      return self.path("tasks", "train")
    d = self.path("tasks", "rl")
    if not broadcast_json(os.path.exists(os.path.join(d, "synthetic_report.json"))):
      on_primary("rl_tasks", self._make_rl_tasks)  # a run dir from before rl_tasks
    return d

  def _expert(self) -> dict:
    from composer_jax.data.tokenizer import load_tokenizer
    from composer_jax.env.expert import expert_trajectories
    from composer_jax.env.tasks import load_tasks
    tok = load_tokenizer(self.path("pretrain", "tokenizer.json"))
    rep = expert_trajectories(load_tasks(self.path("tasks", "train")), self.path("sft", "trajectories.jsonl"),
                              tokenizer=tok, tool_docs=self.cfg.env.tool_docs, mode=self.cfg.env.sandbox,
                              recover=self.cfg.run.expert_recover,
                              recover_by=self.cfg.run.expert_recover_by, log=self.log)
    if not rep["kept"]:
      raise RuntimeError("the scripted expert solved no training task: check the sandbox (bubblewrap)")
    return {"kept": rep["kept"], "recovered": rep["recovered"], "tasks": rep["tasks"], **rep["summary"]}

  def _eval(self, policy_run: str, tag: str) -> dict:
    from composer_jax.env.tasks import load_tasks
    from composer_jax.rl.loop import eval_run_dir
    r = self.cfg.run
    out = {}
    for split in ("heldout", "unseen"):
      tasks = load_tasks(self.path("tasks", split))
      s = eval_run_dir(self.path(policy_run), tasks, r.eval_samples,
                       self.path("eval", f"{tag}-{split}"),
                       [f"rl.learner_sampler={self.cfg.rl.learner_sampler}", *r.eval_overrides],
                       log=self.log)
      if not is_primary():  # rl.learner_sampler=mesh: this process replayed process 0's engine
        continue
      per_task = [v["c"] / v["n"] for v in s["per_task"].values()]
      lo, hi = bootstrap_ci(per_task)
      out[split] = {"pass@1": s["pass@1"], "ci95": [lo, hi], "tasks": s["tasks"],
                    "by_family": by_family(tasks, s["per_task"]),
                    "samples": s["samples_per_task"],
                    f"pass@{s['samples_per_task']}": s.get(f"pass@{s['samples_per_task']}"),
                    "mean_completion_tokens": s["mean_completion_tokens"],
                    "mean_reward": s["mean_reward"]}
    return out

  def _rl(self) -> dict:
    from composer_jax.rl.loop import run_rl
    cfg = self.rl_config()
    d = self.path("rl")
    resume = os.path.isdir(os.path.join(d, "checkpoints")) and bool(os.listdir(os.path.join(d, "checkpoints")))
    last = run_rl(cfg, d, init=None if resume else self.path(sft_policy(self.cfg)), resume=resume,
                  log=self.log)
    return {"final": {k: v for k, v in last.items() if isinstance(v, (int, float))}}

  def rl_config(self, extra=()) -> Config:
    """The RL stage's config: this run's RL tasks and SFT trajectories (for rl.sft_mix_coef), then
    run.rl_overrides (which win), then ``extra``."""
    return stage_config(self.cfg, [f"rl.tasks={self._rl_tasks_dir()}",
                                   f"rl.sft_mix_path={self.path('sft', 'trajectories.jsonl')}",
                                   *self.cfg.run.rl_overrides, *extra])

  # -- the job --------------------------------------------------------------------------------------

  def run(self) -> dict:
    r = self.cfg.run
    from composer_jax.config import dump_config
    if is_primary():
      dump_config(self.cfg, self.path("config.yaml"))
    self.stage("pretrain", lambda: self._train("pretrain", r.pretrain_overrides, r.base or None))
    self.stage("tasks", self._tasks, primary_only=True)
    self.stage("expert", self._expert, primary_only=True)
    sft = [f"data.sft_path={self.path('sft', 'trajectories.jsonl')}", *r.sft_overrides]
    self.stage("sft", lambda: self._train("sft", sft, self.path("pretrain")))
    if r.anneal_steps > 0:
      self.stage("anneal", lambda: self._train("anneal", anneal_overrides(self.cfg, sft), self.path("sft"),
                                               kind="sft"))
    policy = sft_policy(self.cfg)
    # The evaluations run on process 0, unless their sampler spans every process (rl.learner_sampler).
    alone = self.cfg.rl.learner_sampler != "mesh"
    ev_sft = self.stage("eval_sft", lambda: self._eval(policy, "sft"), policy=policy, primary_only=alone)
    self.stage("rl", self._rl, policy=policy)
    ev_rl = self.stage("eval_rl", lambda: self._eval("rl", "rl"), primary_only=alone)
    mix_coef = self.rl_config().rl.sft_mix_coef  # every process: it may take a collective
    if not is_primary():  # the summary, its plots and the table are process 0's files
      return {}
    summary = {"sft": ev_sft["heldout"], "rl": ev_rl["heldout"],
               "unseen_templates": {"sft": ev_sft["unseen"], "rl": ev_rl["unseen"]},
               "wall_s": dict(self.times), "total_wall_s": round(sum(self.times.values()), 1)}
    summary["rl_minus_sft_pass@1"] = summary["rl"]["pass@1"] - summary["sft"]["pass@1"]
    per_task = {}
    for tag in ("sft", "rl"):
      with open(self.path("eval", f"{tag}-heldout", "summary.json")) as f:
        per_task[tag] = json.load(f)["per_task"]
    summary["rl_minus_sft_paired"] = paired_difference(per_task["sft"], per_task["rl"])
    summary["rl_sft_mix_coef"] = mix_coef
    summary["sft_policy"] = policy
    summary["anneal_steps"] = r.anneal_steps
    with open(self.path("summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    self._plot(summary)
    self.log(table(summary))
    self.log(family_table(summary))
    return summary

  def _plot(self, summary: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for split, marker in (("heldout", "o"), ("unseen", "s")):
      pts = [(self._done(f"eval_{s}")[split], s) for s in ("sft", "rl")]
      ax.plot([p["mean_completion_tokens"] for p, _ in pts], [p["pass@1"] for p, _ in pts],
              marker=marker, label=split)
      for p, s in pts:
        ax.annotate(s, (p["mean_completion_tokens"], p["pass@1"]))
    ax.set_xlabel("mean completion tokens")
    ax.set_ylabel("pass@1")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(self.path("score_vs_tokens.png"), dpi=90)
    plt.close(fig)


def anneal_overrides(cfg: Config, sft: list[str]) -> list[str]:
  """The anneal stage: the SFT stage's overrides, then the expert chats alone (no drills) for
  run.anneal_steps steps, then run.anneal_overrides (which win)."""
  return [*sft, "data.sft_copy_share=0.0", "data.sft_spec_share=0.0", "data.sft_word_share=0.0",
          f"train.steps={cfg.run.anneal_steps}", *cfg.run.anneal_overrides]


def by_family(tasks: list, per_task: dict) -> dict:
  """pass@1 per task family (template and level): where a stage's gains and losses are."""
  from composer_jax.rl.curriculum import family_of
  fam: dict = {}
  for t in tasks:
    v = per_task.get(t.instance_id)
    if v:
      f = fam.setdefault(family_of(t), {"tasks": 0, "c": 0, "n": 0})
      f["tasks"], f["c"], f["n"] = f["tasks"] + 1, f["c"] + v["c"], f["n"] + v["n"]
  return {k: {"tasks": f["tasks"], "pass@1": f["c"] / f["n"]} for k, f in sorted(fam.items())}


def family_table(summary: dict) -> str:
  """Held-out pass@1 per family, after SFT and after RL."""
  sft, rl = summary["sft"].get("by_family", {}), summary["rl"].get("by_family", {})
  lines = [f"{'held-out family':<17} {'tasks':>5} {'SFT':>6} {'RL':>6}"]
  for k in sorted(set(sft) | set(rl)):
    n = (sft.get(k) or rl.get(k))["tasks"]
    cell = [f"{d[k]['pass@1']:>6.3f}" if k in d else f"{'n/a':>6}" for d in (sft, rl)]
    lines.append(f"{k:<17} {n:>5} {cell[0]} {cell[1]}")
  return "\n".join(lines)


def table(summary: dict) -> str:
  rows = [("SFT", "held-out", summary["sft"]), ("RL", "held-out", summary["rl"]),
          ("SFT", "unseen templates", summary["unseen_templates"]["sft"]),
          ("RL", "unseen templates", summary["unseen_templates"]["rl"])]
  lines = [(f"{'policy':<6} {'tasks':<17} {'n':>4} {'pass@1':>7} {'95% CI':>15} {'pass@k':>10} "
            f"{'tokens':>7}")]
  for pol, split, s in rows:
    k = s["samples"]
    at_k = s.get(f"pass@{k}")
    at_k = f"{at_k:>6.3f}" if at_k is not None else f"{'n/a':>6}"
    lines.append(f"{pol:<6} {split:<17} {s['tasks']:>4} {s['pass@1']:>7.3f} "
                 f"[{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]{'':>2} {at_k} (k={k}) "
                 f"{s['mean_completion_tokens']:>7.1f}")
  line = f"RL - SFT held-out pass@1: {summary['rl_minus_sft_pass@1']:+.3f}"
  paired = summary.get("rl_minus_sft_paired")
  if paired:
    line += (f", paired 95% CI [{paired['ci95'][0]:+.3f}, {paired['ci95'][1]:+.3f}] over "
             f"{paired['tasks']} tasks")
  lines.append(line)
  if summary.get("anneal_steps"):
    lines.append(f"  (SFT: the SFT stage then {summary['anneal_steps']} steps on the expert chats alone, "
                 "run.anneal_steps)")
  if summary.get("rl_sft_mix_coef"):
    # The RL stage's SFT rows are continued SFT: say so where the difference is read.
    lines.append(f"  (the RL stage also trains on SFT chats, rl.sft_mix_coef={summary['rl_sft_mix_coef']:g}; "
                 "RL - SFT includes their effect, measured apart in docs/rl_gain.md, \"Stop 38\")")
  lines.append("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in summary["wall_s"].items())
               + f" (total {summary['total_wall_s']:.0f}s)")
  return "\n".join(lines)


def register(sub) -> None:
  p = sub.add_parser("run", help="the whole recipe: pretrain, tasks, expert SFT, RL, evaluation")
  p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
  p.add_argument("overrides", nargs="*", help="section.key=value overrides")
  p.add_argument("--out", required=True, help="run directory (one folder per stage, summary.json)")
  p.add_argument("--resume", action="store_true", help="skip finished stages, resume the current one")
  p.set_defaults(func=_main)


def resolve_beside(path: str, config_path: str | None) -> str:
  """A relative path from a config file: as given where it exists from the current directory, else
  beside the config file (``run.base: tiny-base`` in configs/tiny.yaml works from any directory)."""
  if os.path.isabs(path) or os.path.exists(path) or not config_path:
    return path
  beside = os.path.join(os.path.dirname(os.path.abspath(config_path)), path)
  return beside if os.path.exists(beside) else path


def checked_stage(cfg: Config, name: str, overrides: list[str]) -> Config:
  """``stage_config``, its one-line error naming the run.* list the bad override came from."""
  try:
    return stage_config(cfg, overrides)
  except ConfigError as e:
    raise ConfigError(f"run.{name}: {e}") from None


def check_stage_models(stages: dict[str, Config]) -> None:
  """Each stage starts from the one before it, so every stage's model must be the pretraining
  stage's: a model.* override in one stage's list would fail when its weights are read, minutes in."""
  from composer_jax.train.init import ARCH_FIELDS
  first = stages["pretrain_overrides"].model
  for name, c in stages.items():
    for k in ARCH_FIELDS:
      if getattr(c.model, k) != getattr(first, k):
        raise ConfigError(f"run.{name}: model.{k}={getattr(c.model, k)!r} differs from the pretraining "
                          f"stage's {getattr(first, k)!r}, whose weights it starts from: set model.{k} "
                          "for every stage (the config's model section), not in one stage's list")


def check_run_out(cfg: Config, out: str, resume: bool) -> None:
  """--out: new or empty; with --resume, a run of this job (its config.yaml) of the same model. Other
  fields may change on --resume (re-running a later stage with new overrides), the model may not:
  the finished stages' weights are of the saved one."""
  from composer_jax.config_check import check_out
  check_out(out, runs=False)
  if not os.path.isdir(out) or not os.listdir(out):
    return
  if not resume:
    raise ConfigError(f"--out {out} is not empty: pass --resume to continue it, or choose a new --out")
  saved = os.path.join(out, "config.yaml")
  if not os.path.isfile(saved):
    raise ConfigError(f"--resume: --out {out} holds files but is not a run of `composer-jax run` (no "
                      "config.yaml): choose a new or empty --out")
  from composer_jax.config import load_config
  from composer_jax.train.init import ARCH_FIELDS
  there = load_config(saved).model
  for k in ARCH_FIELDS:
    if getattr(there, k) != getattr(cfg.model, k):
      raise ConfigError(f"--resume: {saved} has model.{k}={getattr(there, k)!r} but this config has "
                        f"{getattr(cfg.model, k)!r}: set model.{k}={getattr(there, k)} or choose a new --out")


def _main(args) -> int:
  from composer_jax.config import load_config
  from composer_jax.parallel.mesh import maybe_initialize_distributed
  cfg = load_config(args.config, args.overrides)
  stages = {name: checked_stage(cfg, name, getattr(cfg.run, name))  # a bad stage override: one line now
            for name in ("pretrain_overrides", "sft_overrides", "eval_overrides")}
  stages["anneal_overrides"] = checked_stage(cfg, "anneal_overrides",
                                             anneal_overrides(cfg, list(cfg.run.sft_overrides)))
  from composer_jax.rl import preflight
  from composer_jax.train import fit
  rl_cfg = checked_stage(cfg, "rl_overrides",
                         ["rl.sft_mix_path=sft/trajectories.jsonl"] + list(cfg.run.rl_overrides))
  check_stage_models({**{k: v for k, v in stages.items() if k != "eval_overrides"}, "rl_overrides": rl_cfg})
  check_run_out(cfg, args.out, args.resume)
  # The RL stage's Ray (cluster address, object store, pinned cores), now rather than 15 min in.
  preflight.check(rl_cfg)
  if cfg.run.base:  # before any stage: a wrong base is one line, not a failed pretraining stage
    from composer_jax.train.init import check_base
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, base=resolve_beside(
        cfg.run.base, args.config)))
    # the pretraining stage's model: run.pretrain_overrides may change it (check_stage_models
    # then holds the later stages to it)
    check_base(cfg.run.base, stages["pretrain_overrides"].model)
  from composer_jax.env.sandbox import SandboxError, require_isolation
  try:
    require_isolation(cfg.env.sandbox, "the main job (model-driven evaluation and RL)")
  except SandboxError as e:
    raise ConfigError(str(e)) from None
  maybe_initialize_distributed(cfg.mesh)  # mesh.distributed: one job for every stage
  # Every training stage's step fits the devices, before the first stage spends its minutes. These
  # read the devices, so they follow jax.distributed (which must come before any device is read).
  for name in ("pretrain_overrides", "sft_overrides"):
    fit.check_training(stage_config(cfg, getattr(cfg.run, name)), f"run.{name}: ")
  preflight.check_learner(rl_cfg, "run.rl_overrides: ")
  Recipe(cfg, args.out, args.resume).run()
  return 0

"""``composer-jax pretrain | extend | sft``: the training stages.

  composer-jax pretrain CONFIG --out DIR [key=value ...] [--resume] [--cpu-devices N]
  composer-jax extend   CONFIG --out DIR --init CKPT --seq-len N [--yarn-factor F] [key=value ...]
  composer-jax sft      CONFIG --out DIR --init CKPT [data.sft_path=FILE] [key=value ...]

``extend`` is the long-context stage: it continues from a checkpoint at a longer ``data.seq_len``,
raising ``model.max_seq_len`` and turning on YaRN with factor new/old length (or ``--yarn-factor``)
over the original context of the run it starts from.
"""

from __future__ import annotations

import os

import yaml

from composer_jax.config import ConfigError


def _common(p, init_required: bool) -> None:
  p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
  p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=20")
  p.add_argument("--out", required=True, help="run directory (config, metrics, checkpoints, plots)")
  p.add_argument("--init", required=init_required, default=None,
                 help="start from the weights of a run directory, a checkpoint step directory, a "
                      "`convert --from-hf` folder or an HF folder (optimizer state starts fresh)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the newest readable checkpoint in --out (exact resume)")
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="run on N fake CPU devices (for trying meshes on one machine)")


def register(sub) -> None:
  p = sub.add_parser("pretrain", help="(continued) pretraining on the code-dominated mixture")
  _common(p, init_required=False)
  p.set_defaults(func=pretrain)
  p = sub.add_parser("extend", help="long-context stage: longer seq_len + YaRN, from a checkpoint")
  _common(p, init_required=True)
  p.add_argument("--seq-len", type=int, required=True, help="the new training sequence length")
  p.add_argument("--yarn-factor", type=float, default=0.0,
                 help="YaRN factor (default: new seq_len / the init run's seq_len)")
  p.set_defaults(func=extend)
  p = sub.add_parser("sft", help="supervised fine-tuning on JSONL chat / tool-call trajectories")
  _common(p, init_required=True)
  p.set_defaults(func=sft)


def _prepare(args, extra: list[str] = ()):
  from composer_jax.config import apply_overrides, from_dict, load_config
  from composer_jax.config_check import check_out
  overrides = list(args.overrides) + list(extra)
  cfg = load_config(args.config, overrides)
  check_out(args.out)
  if args.cpu_devices < 0:
    raise ConfigError(f"--cpu-devices {args.cpu_devices} must be >= 0 (0 = the real devices)")
  if args.init:
    # A converted or HF folder carries its architecture: it replaces the YAML's model section,
    # and the command line's model.* overrides (dtypes, remat, ...) apply on top.
    from composer_jax.train.init import init_kind, model_section
    kind = init_kind(args.init)
    model = model_section(args.init, kind)
    if model is not None:
      data = cfg.to_dict()
      if data["rl"]["max_context"] == data["model"]["max_seq_len"]:
        data["rl"]["max_context"] = 0  # derived from the model: derive it again from the new one
      data["model"] = model
      cfg = from_dict(apply_overrides(data, [o for o in overrides if o.startswith("model.")]))
      print(f"--init {args.init} ({kind}): model section from the checkpoint, then "
            "model.* overrides", flush=True)
  ck = os.path.join(args.out, "checkpoints")
  if not args.resume and os.path.isdir(ck) and any(n.isdigit() for n in os.listdir(ck)):
    raise ConfigError(f"--out {args.out} already holds checkpoints: pass --resume to continue, "
                      "or choose a new --out")
  if args.init and init_kind(args.init) == "run":
    from composer_jax.train.init import check_run_init_model
    check_run_init_model(args.init, cfg.model)
  if args.cpu_devices:
    from composer_jax.parallel.mesh import set_cpu_devices
    set_cpu_devices(args.cpu_devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  return cfg


def _run(cfg, args, stage: str) -> int:
  from composer_jax.parallel.mesh import maybe_initialize_distributed
  from composer_jax.train.loop import run
  maybe_initialize_distributed(cfg.mesh)
  run(cfg, args.out, stage=stage, resume=args.resume, init=args.init)
  return 0


def pretrain(args) -> int:
  return _run(_prepare(args), args, "pretrain")


def _init_run_config(init: str) -> dict:
  from composer_jax.train.checkpoint import find_checkpoint
  from composer_jax.train.init import init_kind, model_section
  kind = init_kind(init)
  if kind == "run":
    from composer_jax.train.init import check_run_init
    check_run_init(init)
  if kind != "run":  # converted / HF: the length the checkpoint supports is the one to extend
    model = model_section(init, kind)
    return {"data": {"seq_len": model["max_seq_len"]}, "model": model}
  run_dir = os.path.dirname(find_checkpoint(init)[0])
  path = os.path.join(run_dir, "config.yaml")
  if not os.path.exists(path):
    raise ConfigError(f"--init {init!r}: no config.yaml in {run_dir} to read the original seq_len")
  with open(path) as f:
    return yaml.safe_load(f)


def extend_overrides(old: dict, seq_len: int, yarn_factor: float = 0.0) -> list[str]:
  """Overrides turning the init run's config into the long-context stage's."""
  old_len = int(old["data"]["seq_len"])
  if seq_len <= old_len:
    raise ConfigError(f"--seq-len {seq_len} must exceed the init run's data.seq_len={old_len}")
  # YaRN stretches the positions the checkpoint was trained on; an already-extended model keeps
  # its original window, and the factor is relative to that window (not to the extended length).
  orig = old_len if float(old["model"].get("yarn_factor", 1.0)) == 1.0 else int(
      old["model"]["yarn_original_max_position"])
  factor = yarn_factor or seq_len / orig
  if factor < 1:
    raise ConfigError(f"--yarn-factor {factor} must be >= 1")
  return [f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}",
          f"model.yarn_factor={factor}", f"model.yarn_original_max_position={orig}"]


def extend(args) -> int:
  extra = extend_overrides(_init_run_config(args.init), args.seq_len, args.yarn_factor)
  # The stage's own key=value overrides come last and win.
  args.overrides = extra + list(args.overrides)
  return _run(_prepare(args), args, "extend")


def sft(args) -> int:
  cfg = _prepare(args)
  if not cfg.data.sft_path or not os.path.isfile(cfg.data.sft_path):
    raise ConfigError(f"data.sft_path={cfg.data.sft_path!r} is not a file: pass "
                      "data.sft_path=FILE.jsonl (chat trajectories)")
  from composer_jax.data.sft import read_trajectories
  read_trajectories(cfg.data.sft_path)  # format errors surface before anything compiles
  return _run(cfg, args, "sft")

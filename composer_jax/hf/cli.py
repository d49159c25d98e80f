"""``composer-jax convert``: HF checkpoint folders <-> Orbax checkpoints of the model parameters.

``--from-hf HF_DIR --out DIR`` writes ``DIR/params`` (an Orbax ``StandardCheckpointer`` checkpoint
of ``nnx.state(model)``, the parameters and router biases only: no optimizer state or step, which
the training checkpoint of a later issue owns) and ``DIR/config.yaml`` (a full composer config whose
``model`` section describes the checkpoint, usable as a training config base).

``--to-hf DIR --out HF_DIR`` reads ``DIR/params``, or the newest readable training checkpoint when
DIR is a run directory (``checkpoints/``) or one of its step folders, with the model section of
``--config`` (a composer YAML or an HF config.json; default ``DIR/config.yaml``, the run's) and
writes an HF folder in the released per-expert layout.

Both kinds of folder also feed training: ``pretrain | sft | extend --init DIR`` (train/init.py).
"""

from __future__ import annotations

import os

from composer_jax.config import ConfigError

PARAMS, CONFIG = "params", "config.yaml"


def register(sub) -> None:
  p = sub.add_parser("convert", help="convert HF checkpoints to/from Orbax parameter checkpoints")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--from-hf", metavar="HF_DIR", help="HF folder (config.json + safetensors)")
  src.add_argument("--to-hf", metavar="DIR", help="folder written by --from-hf (holds params/)")
  p.add_argument("--out", required=True, help="output folder")
  p.add_argument("--config", help="--to-hf: composer YAML or HF config.json (default DIR/config.yaml)")
  p.add_argument("--dtype", choices=["float32", "bfloat16"],
                 help="parameter dtype: --from-hf default the checkpoint's torch_dtype; --to-hf "
                      "default the run's model.param_dtype (bfloat16 halves a float32 run's files)")
  p.add_argument("--max-shard-gb", type=float, default=5.0, help="--to-hf: safetensors shard size")
  p.set_defaults(func=run)


def _run_dir(path: str) -> tuple[str, str, int | None] | None:
  """(run dir, checkpoints dir, step or None) when ``path`` is a training run or step folder."""
  from composer_jax.train.checkpoint import find_checkpoint
  ck, step = find_checkpoint(path)
  if os.path.basename(ck) == "checkpoints" and os.path.isdir(ck):
    return os.path.dirname(ck), ck, step
  return None


def _model_config(args, base: str):
  from composer_jax.config import load_config
  from composer_jax.hf import config_from_hf
  path = args.config or os.path.join(base, CONFIG)
  if not os.path.exists(path):
    raise ConfigError(f"--config {path!r} does not exist: pass the YAML written by --from-hf or "
                      "an HF config.json")
  if path.endswith(".json"):
    import json
    with open(path) as f:
      return config_from_hf(json.load(f))
  return load_config(path).model


def run(args) -> int:
  if args.max_shard_gb <= 0:
    raise ConfigError(f"--max-shard-gb={args.max_shard_gb} must be positive")
  if args.from_hf:
    if not os.path.exists(os.path.join(args.from_hf, "config.json")):
      raise ConfigError(f"--from-hf {args.from_hf!r} has no config.json: pass an HF checkpoint folder")
    return from_hf(args.from_hf, args.out, args.dtype)
  shard = int(args.max_shard_gb * 1024**3)
  run = _run_dir(args.to_hf)
  if run is not None:
    return run_to_hf(run[1], run[2], _model_config(args, run[0]), args.out, shard, args.dtype)
  params = os.path.join(args.to_hf, PARAMS)
  if not os.path.isdir(params):
    raise ConfigError(f"--to-hf {args.to_hf!r} has no {PARAMS}/ folder: pass a folder written by "
                      "`composer-jax convert --from-hf` or a training run directory")
  return to_hf(params, _model_config(args, args.to_hf), args.out, shard, args.dtype)


def _save(cfg, graphdef, params, rest, out: str, max_shard_bytes: int, dtype: str | None) -> None:
  """Write the HF folder; with ``dtype`` the parameters (not the float32 router biases) are cast
  and config.json's torch_dtype says so."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from composer_jax.hf import save_pretrained
  from composer_jax.model import abstract_model
  if dtype and dtype != cfg.param_dtype:
    params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          params)
    graphdef = nnx.split(abstract_model(dataclasses.replace(cfg, param_dtype=dtype)), nnx.Param, ...)[0]
  save_pretrained(nnx.merge(graphdef, params, rest), out, max_shard_bytes=max_shard_bytes)


def from_hf(hf_dir: str, out: str, dtype: str | None = None) -> int:
  import orbax.checkpoint as ocp
  from flax import nnx

  from composer_jax.config import Config, DataConfig, dump_config
  from composer_jax.hf import from_pretrained
  model = from_pretrained(hf_dir, dtype=dtype)
  os.makedirs(out, exist_ok=True)
  target = os.path.join(os.path.abspath(out), PARAMS)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(target, nnx.state(model), force=True)
  data = DataConfig(seq_len=min(DataConfig.seq_len, model.cfg.max_seq_len))  # keep it loadable
  dump_config(Config(model=model.cfg, data=data), os.path.join(out, CONFIG))
  print(f"wrote {target} and {os.path.join(out, CONFIG)}")
  return 0


def to_hf(params: str, cfg, out: str, max_shard_bytes: int, dtype: str | None = None) -> int:
  import orbax.checkpoint as ocp
  from flax import nnx

  from composer_jax.model import abstract_model
  graphdef, abstract = nnx.split(abstract_model(cfg))
  with ocp.StandardCheckpointer() as ckptr:
    try:
      state = ckptr.restore(os.path.abspath(params), abstract)
    except ValueError as e:  # shapes or tree structure disagree with the config
      raise ConfigError(f"{params} does not match the model config: {str(e).splitlines()[0]}") from None
  graphdef, params_, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
  _save(cfg, graphdef, params_, rest, out, max_shard_bytes, dtype)
  print(f"wrote {out}")
  return 0


def run_to_hf(ck_dir: str, step: int | None, cfg, out: str, max_shard_bytes: int,
              dtype: str | None = None) -> int:
  """A training checkpoint's weights (params + router biases; not the optimizer) to an HF folder."""
  from flax import nnx

  from composer_jax.model import abstract_model
  from composer_jax.train.checkpoint import Checkpointer
  graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
  src = Checkpointer(ck_dir, keep=1000, async_save=False)
  targets = {"params": params, "rest": rest}
  try:
    if step is None:
      got = src.restore_latest(targets, json_items=())
    else:
      src.check_compatible(step, targets)
      got = (step, src.restore(step, targets, json_items=()))
  finally:
    src.close()
  if got is None:
    raise ConfigError(f"{ck_dir} holds no readable checkpoint")
  _save(cfg, graphdef, got[1]["params"], got[1]["rest"], out, max_shard_bytes, dtype)
  print(f"wrote {out} from {ck_dir}/{got[0]}")
  return 0

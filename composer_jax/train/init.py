"""Where ``--init`` weights come from: a training run, a ``convert --from-hf`` folder, or an HF folder.

  run        a run directory, its ``checkpoints/`` folder or one step folder inside it (the params
             and router biases of the training checkpoint; the optimizer starts fresh)
  converted  a folder written by ``composer-jax convert --from-hf`` (``params/`` + ``config.yaml``)
  hf         an HF DeepseekV3 / KimiK2 folder (``config.json`` + safetensors), streamed onto the
             mesh one parameter at a time by ``hf.from_pretrained``

For ``converted`` and ``hf`` the architecture is the checkpoint's: ``model_section`` gives the model
config that replaces the YAML's (command-line ``model.*`` overrides still apply on top, e.g. dtypes
or remat). Weights are read straight into the run's shardings; no random model is built first.
Arrays whose shapes disagree with the run's model stop with one line naming the first of them.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

from composer_jax.config import ConfigError

CONVERTED_PARAMS, CONVERTED_CONFIG = "params", "config.yaml"


def init_kind(path: str) -> str:
  """'hf', 'converted' or 'run' (the last also for paths that do not exist: callers check)."""
  if os.path.exists(os.path.join(path, "config.json")) and glob.glob(os.path.join(path, "*.safetensors")):
    return "hf"
  # A training step folder also holds params/, but no config.yaml; a run folder holds checkpoints/.
  if (os.path.isdir(os.path.join(path, CONVERTED_PARAMS))
      and os.path.exists(os.path.join(path, CONVERTED_CONFIG))
      and not os.path.isdir(os.path.join(path, "checkpoints"))):
    return "converted"
  return "run"


def check_run_init(path: str, flag: str = "--init") -> None:
  """A run-kind ``--init`` holds a checkpoint step: one line now, not a failed restore after the
  output folder has its tokenizer and an empty checkpoints/ (train/loop.py builds those first)."""
  from composer_jax.train.checkpoint import find_checkpoint
  d, step = find_checkpoint(path)
  if not os.path.isdir(d):
    raise ConfigError(f"{flag} {path!r} is not a run, checkpoint step, converted (convert --from-hf) "
                      "or HF directory")
  if step is None and os.path.basename(d) != "checkpoints":
    raise ConfigError(f"{flag} {path!r} is not a run directory (no checkpoints/): give a trained run "
                      "or one of its checkpoint step folders")
  if step is None and not any(n.isdigit() for n in os.listdir(d)):
    raise ConfigError(f"{flag} {path!r} holds no checkpoint step yet ({d} is empty of steps): give a "
                      "run that has saved one, or one of its step folders")


def check_run_init_model(path: str, model_cfg, flag: str = "--init") -> None:
  """``check_run_init``, then the run's saved model against ``model_cfg`` on the fields that fix
  the arrays: one line naming the field, not a shape mismatch at restore."""
  check_run_init(path, flag)
  check_base(path, model_cfg, field=flag, fields=SHAPE_FIELDS)


def model_section(path: str, kind: str) -> dict | None:
  """The model config (as a dict) of a converted / HF folder; None for a run."""
  if kind == "hf":
    from composer_jax.hf import config_from_hf, read_hf_config
    return dataclasses.asdict(config_from_hf(read_hf_config(path)))
  if kind == "converted":
    from composer_jax.config import load_config
    return dataclasses.asdict(load_config(os.path.join(path, CONVERTED_CONFIG)).model)
  return None


# The fields that fix a model's arrays and its function: a base must agree on all of them.
ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_dense_layers", "dense_ffn_dim", "n_heads",
               "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim",
               "n_routed_experts", "n_experts_per_tok", "n_shared_experts", "moe_ffn_dim", "scoring",
               "selection_bias", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
               "rope_theta", "yarn_factor", "tie_embeddings", "mtp_depths")


# The fields that fix the arrays' names and shapes: a run's --init must agree on these, or its
# restore fails. The others (rope_theta, scoring, ...) change the function, not the arrays, and a
# stage may change them on purpose (a larger RoPE base for longer context).
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_dense_layers", "dense_ffn_dim", "n_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim",
                "n_routed_experts", "n_shared_experts", "moe_ffn_dim", "selection_bias",
                "tie_embeddings", "mtp_depths")


def check_base(path: str, model_cfg, field: str = "run.base", fields: tuple = ARCH_FIELDS) -> str:
  """The kind of a base checkpoint whose ``fields`` are ``model_cfg``'s, or one ConfigError line
  naming the first model field that differs (read from the folder's config; no weights are read)."""
  if not os.path.isdir(path):
    raise ConfigError(f"{field}={path!r} does not exist: give an HF folder, a `convert --from-hf` "
                      "folder or a training run directory, or '' to start from random weights")
  kind = init_kind(path)
  there = model_section(path, kind)
  if there is None:  # a run directory (or a step folder inside one) carries its config.yaml
    from composer_jax.config import load_config
    from composer_jax.train.checkpoint import find_checkpoint
    ck, _ = find_checkpoint(path)
    run_dir = os.path.dirname(ck) if os.path.basename(ck) == "checkpoints" else path
    if not os.path.isdir(ck) or not os.path.exists(os.path.join(run_dir, "config.yaml")):
      raise ConfigError(f"{field}={path!r} is not an HF, converted or run directory (no "
                        "config.json + safetensors, params/ + config.yaml, or checkpoints/)")
    there = dataclasses.asdict(load_config(os.path.join(run_dir, "config.yaml")).model)
  for k in fields:
    if there[k] != getattr(model_cfg, k):
      raise ConfigError(f"{field}={path!r} has model.{k}={there[k]!r} but this config has "
                        f"{getattr(model_cfg, k)!r}: set model.{k}={there[k]} or choose another base")
  return kind


def _check_shapes(what: str, there: dict, here: dict) -> None:
  from composer_jax.train.checkpoint import layout_mismatch
  if layout := layout_mismatch(there, here):
    raise ConfigError(f"--init {what}: {layout}")
  for k in sorted(set(there) | set(here)):
    if k not in there or k not in here or there[k][0] != here[k][0]:
      got = f"{list(there[k][0])}" if k in there else "absent"
      want = f"{list(here[k][0])}" if k in here else "absent"
      raise ConfigError(f"--init {what}: array {k} is {got} there but {want} in this run's model; "
                        "the checkpoint is of another architecture (check the model section)")


def load_weights(path: str, kind: str, cfg, graphdef, abstract: dict, mesh, rules,
                 log=print) -> tuple[Any, Any, str]:
  """(params, rest, description) for ``--init path`` on the shardings of ``abstract``
  (``{"params": ..., "rest": ...}`` of ShapeDtypeStructs with shardings)."""
  from flax import nnx

  from composer_jax.train import checkpoint as ckpt_lib
  if kind == "hf":
    from composer_jax.hf import from_pretrained
    model = from_pretrained(path, mesh=mesh, rules=rules, cfg=cfg.model)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    here = ckpt_lib._leaves({"params": abstract["params"], "rest": abstract["rest"]})
    _check_shapes(path, ckpt_lib._leaves({"params": params, "rest": rest}), here)
    return _cast_like(params, abstract["params"]), _cast_like(rest, abstract["rest"]), path
  if kind == "converted":
    import orbax.checkpoint as ocp
    from etils import epath
    src = os.path.join(os.path.abspath(path), CONVERTED_PARAMS)
    full = nnx.merge(graphdef, abstract["params"], abstract["rest"])
    target = nnx.state(full)  # one tree, as convert --from-hf saved it
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(src)).tree
    _check_shapes(src, ckpt_lib._leaves(meta), ckpt_lib._leaves(ckpt_lib._abstract(target)))
    with ocp.StandardCheckpointer() as ckptr:
      state = ckptr.restore(src, ckpt_lib._abstract(target))
    _, params, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    return params, rest, src
  ck_dir, step = ckpt_lib.find_checkpoint(path)
  if not os.path.isdir(ck_dir):
    raise ConfigError(f"--init {path!r} is not a run, checkpoint, converted or HF directory")
  src = ckpt_lib.Checkpointer(ck_dir, keep=1000, async_save=False)
  targets = {"params": abstract["params"], "rest": abstract["rest"]}
  try:
    if step is None:
      got = src.restore_latest(targets, json_items=(), log=log, exact_dtype=False)
    else:
      src.check_compatible(step, targets, exact_dtype=False)
      got = (step, src.restore(step, targets, json_items=()))
  finally:
    src.close()
  if got is None:
    raise ConfigError(f"--init {path!r} holds no readable checkpoint")
  return got[1]["params"], got[1]["rest"], f"{ck_dir}/{got[0]}"


def _cast_like(tree, abstract):
  import jax
  return jax.tree.map(lambda x, a: x.astype(a.dtype) if x.dtype != a.dtype else x, tree, abstract)

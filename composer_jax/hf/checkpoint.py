"""``from_pretrained`` / ``save_pretrained``: HF DeepseekV3 / KimiK2 checkpoints <-> our model.

Loading starts from ``abstract_model(cfg)`` (shapes only) and fills one parameter at a time: each is
assembled on the host from its HF tensors (stacked experts one layer at a time), cast, and placed on
its sharding, so the host never holds more than one parameter beyond the model itself. Every HF
tensor the model needs is checked to exist (and every tensor in the folder to be used) before any
weight is read. A stacked parameter (``model.scan_layers``) is read one layer at a time into the
slices its devices hold, and written one layer at a time: the host holds one layer of it beyond
the local shards, never the whole stack.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from composer_jax.config import ConfigError, ModelConfig
from composer_jax.hf.config import config_from_hf, config_to_hf, fp8_block_size
from composer_jax.hf.names import (
  IGNORED_SUFFIXES,
  LeafMap,
  dump_leaf,
  expert_names,
  fused_name,
  hf_shape,
  layer_maps,
  load_leaf,
  mtp_copies,
)
from composer_jax.hf.tensors import Reader, ShardedWriter
from composer_jax.model.build import abstract_model
from composer_jax.model.transformer import Transformer
from composer_jax.parallel.rules import make_rules, spec_for, variable_axes

DEFAULT_SHARD_BYTES = 5 * 1024**3


def read_hf_config(path: str) -> dict:
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise ConfigError(f"{path} has no config.json: pass an HF checkpoint folder")
  with open(file) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{file}: not valid JSON ({e})") from None


def _dtype_name(dtype) -> str | None:
  if dtype is None:
    return None
  name = jnp.dtype(dtype).name
  if name not in ("float32", "bfloat16"):
    raise ConfigError(f"from_pretrained dtype={name!r}: use float32 or bfloat16")
  return name


def _flat(state):
  return [(tuple(p), v) for p, v in nnx.to_flat_state(state)]


def _sources(m: LeafMap, shape: tuple, cfg: ModelConfig, reader: Reader) -> list[str] | None:
  """HF tensor names this parameter reads; None = absent but allowed (zero router bias)."""
  if m.kind == "experts":
    per_expert = expert_names(m, shape[0])
    if not reader.has(per_expert[0]) and reader.has(fused_name(m)):
      return [fused_name(m)]
    names = per_expert
  else:
    names = [m.name]
  missing = [n for n in names if not reader.has(n)]
  if missing and m.path[-1] == "router_bias" and not cfg.selection_bias:
    return None  # checkpoints without selection bias (DeepSeek-V2 style) do not store it
  what = "/".join(map(str, m.path))
  if missing:
    raise ConfigError(f"{reader.path}: tensor {missing[0]!r} is missing (needed for parameter "
                      f"{what}); the checkpoint does not match its config.json")
  for n in names:
    want, got = hf_shape(m, shape, n), reader.shape(n)
    if want != got:
      raise ConfigError(f"{reader.path}: tensor {n!r} has shape {got}, parameter {what} needs {want}; "
                        "the checkpoint does not match its config.json")
  return names


def _mtp_depths_present(cfg: ModelConfig, reader: Reader) -> int:
  k = 0
  while k < cfg.mtp_depths and reader.has(f"model.layers.{cfg.n_layers + k}.eh_proj.weight"):
    k += 1
  return k


def _place(arr: np.ndarray, sharding):
  if sharding is None:
    return jnp.asarray(arr)
  return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def from_pretrained(path: str, mesh: Mesh | None = None, dtype=None, rules: dict | None = None,
                    cfg: ModelConfig | None = None) -> Transformer:
  """Load an HF DeepseekV3 / KimiK2 checkpoint folder into a ``Transformer``.

  ``dtype`` (float32 / bfloat16) overrides the parameter and compute dtype; by default it follows
  config.json's torch_dtype (bfloat16 stays bfloat16, anything else loads as float32; FP8 weights
  are dequantized first). With ``mesh`` every parameter is placed on its sharding from ``rules``.
  ``cfg`` replaces the config derived from config.json (e.g. to set training-only fields).
  """
  hf = read_hf_config(path)
  cfg = cfg or config_from_hf(hf)
  if (name := _dtype_name(dtype)) is not None:
    cfg = dataclasses.replace(cfg, param_dtype=name, compute_dtype=name)
  block = fp8_block_size(hf) if hf.get("quantization_config") else (128, 128)
  reader = Reader(path, block)
  try:
    return _load(reader, cfg, mesh, rules)
  finally:
    reader.close()


def _load(reader: Reader, cfg: ModelConfig, mesh: Mesh | None, rules: dict | None) -> Transformer:
  path = reader.path
  present = _mtp_depths_present(cfg, reader)
  if present < cfg.mtp_depths:
    warnings.warn(f"{path}: config.json declares {cfg.mtp_depths} MTP layer(s) but the checkpoint "
                  f"holds weights for {present}; loading {present}", stacklevel=3)
    cfg = dataclasses.replace(cfg, mtp_depths=present)

  graphdef, state = nnx.split(abstract_model(cfg))
  flat = _flat(state)
  plan = []  # (per-layer LeafMaps, variable, stacked)
  for p, v in flat:
    maps, stacked = layer_maps(p, cfg)
    plan.append((maps, v, stacked))
  used = set()
  sources = []
  for maps, var, stacked in plan:
    shape = var.shape[1:] if stacked else var.shape
    names = [_sources(m, shape, cfg, reader) for m in maps]
    sources.append(names)
    for n in names:
      used.update(n or ())
  used.update(n + "_scale_inv" for n in list(used) if reader.has(n + "_scale_inv"))
  ignorable = set(mtp_copies(cfg)) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
  extra = sorted(n for n in reader.keys() - used - ignorable if not n.endswith(IGNORED_SUFFIXES))
  if extra:
    raise ConfigError(f"{path}: {len(extra)} tensor(s) are not used by the model its config.json "
                      f"describes, e.g. {extra[0]!r}; check num_hidden_layers / the checkpoint format")

  rules = rules if rules is not None else make_rules()

  def sharding(p, var):
    if mesh is None:
      return None
    what = f"param {'/'.join(map(str, p))}"
    return NamedSharding(mesh, spec_for(variable_axes(var), var.shape, mesh, rules, what=what))

  shardings = [sharding(p, var) for (p, _), (_, var, _) in zip(flat, plan)]  # layout errors first
  for (maps, var, stacked), names, shard in zip(plan, sources, shardings):
    dt = np.dtype(var.dtype)
    shape = tuple(var.shape[1:] if stacked else var.shape)

    def layer(j, maps=maps, names=names, shape=shape, dt=dt):
      arr = (np.zeros(shape, dt) if names[j] is None
             else load_leaf(maps[j], shape, reader.read, reader.has, dt))
      if arr.shape != shape:
        raise ConfigError(f"{path}: {maps[j].name} gives shape {arr.shape} for parameter "
                          f"{'/'.join(map(str, maps[j].path))}, expected {shape}")
      return arr

    if stacked:
      var.set_value(_place_stacked(layer, tuple(var.shape), dt, shard))
    else:
      arr = layer(0)
      var.set_value(_place(arr, shard))
      del arr
  return nnx.merge(graphdef, state)


def _place_stacked(layer, shape: tuple, dtype, sharding):
  """A stacked parameter [n, ...] from ``layer(j)`` host arrays, read one layer at a time: each
  goes into the slices of it that this process's devices hold (or into one host buffer without a
  mesh), then is dropped."""
  if sharding is None:
    out = np.empty(shape, dtype)
    for j in range(shape[0]):
      out[j] = layer(j)
    return jnp.asarray(out)
  index = sharding.addressable_devices_indices_map(shape)
  span = lambda s, n: range(*s.indices(n))
  bufs = {d: np.empty(tuple(len(span(s, n)) for s, n in zip(idx, shape)), dtype)
          for d, idx in index.items()}
  for j in range(shape[0]):
    arr = layer(j)
    for d, idx in index.items():
      rows = span(idx[0], shape[0])
      if j in rows:
        bufs[d][rows.index(j)] = arr[idx[1:]]
    del arr
  return jax.make_array_from_single_device_arrays(
      shape, sharding, [jax.device_put(b, d) for d, b in bufs.items()])


def _host_array(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def save_pretrained(model: Transformer, path: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    model_type: str = "deepseek_v3") -> str:
  """Write config.json and safetensors (sharded with an index above ``max_shard_bytes``) in the
  released DeepSeek-V3 layout: per-expert weights, MTP depths as extra layers. Returns ``path``.

  Tensors keep the model's dtypes, so ``from_pretrained(save_pretrained(m, p))`` is bit-exact.
  On several hosts every host gathers each parameter and only process 0 writes.
  """
  cfg = model.cfg
  writer = ShardedWriter(path, max_shard_bytes) if jax.process_index() == 0 else None
  copies = mtp_copies(cfg)
  for p, var in _flat(nnx.state(model)):
    maps, stacked = layer_maps(p, cfg)
    for j, m in enumerate(maps):  # a stacked parameter one layer at a time
      value = _host_array(var.get_value()[j] if stacked else var.get_value())
      if writer is None:
        continue
      for name, arr in dump_leaf(m, value):
        writer.add(name, arr)
        for copy, source in copies.items():
          if source == name:
            writer.add(copy, arr)
  if writer is not None:
    writer.finish()
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config_to_hf(cfg, model_type), f, indent=2)
  return path

"""Reading and writing safetensors checkpoints one tensor at a time, with FP8 block dequantization.

Reading goes through ``safetensors.safe_open`` (memory-mapped, so only the tensor asked for is
read). Its NumPy backend cannot build float8 arrays (it looks for ``numpy.float8_e4m3fn``), so FP8
tensors are read straight from the file's documented layout (8-byte header length, JSON header with
byte offsets, raw data) and viewed as ``ml_dtypes`` float8.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from composer_jax.config import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray,
                   block: tuple[int, int] = (128, 128)) -> np.ndarray:
  """float32 ``w * scale_inv`` with one scale per ``block`` of ``w`` (edge blocks may be ragged).

  w: [rows, cols] float8; scale_inv: [ceil(rows / block[0]), ceil(cols / block[1])].
  """
  rows, cols = w.shape
  br, bc = block
  want = (math.ceil(rows / br), math.ceil(cols / bc))
  if tuple(scale_inv.shape) != want:
    raise ConfigError(f"FP8 weight of shape {w.shape} needs weight_scale_inv of shape {want} for "
                      f"{br}x{bc} blocks, got {tuple(scale_inv.shape)}: check weight_block_size")
  scale = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=0), bc, axis=1)[:rows, :cols]
  return w.astype(np.float32) * scale


class Reader:
  """Tensors of a checkpoint folder: sharded (``model.safetensors.index.json``), a single
  ``model.safetensors``, or any ``*.safetensors`` files."""

  def __init__(self, path: str, fp8_block: tuple[int, int] = (128, 128)):
    self.path, self.fp8_block = path, fp8_block
    self._handles: dict[str, object] = {}
    self._headers: dict[str, tuple[int, dict]] = {}
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ConfigError(f"{index}: no 'weight_map' object; re-save the checkpoint")
      self.where = {name: os.path.join(path, file) for name, file in weight_map.items()}
      for file in set(self.where.values()):
        if not os.path.exists(file):
          raise ConfigError(f"{index} names {os.path.basename(file)}, which is not in {path}")
    else:
      files = [os.path.join(path, SINGLE)] if os.path.exists(os.path.join(path, SINGLE)) else \
          sorted(glob.glob(os.path.join(path, "*.safetensors")))
      if not files:
        raise ConfigError(f"{path} holds no *.safetensors files: pass an HF checkpoint folder")
      self.where = {name: file for file in files for name in self._handle(file).keys()}  # noqa: SIM118 (not a dict)

  def _handle(self, file: str):
    if file not in self._handles:
      self._handles[file] = safe_open(file, framework="np")
    return self._handles[file]

  def keys(self) -> set[str]:
    return set(self.where)

  def has(self, name: str) -> bool:
    return name in self.where

  def dtype(self, name: str) -> str:
    return self._handle(self.where[name]).get_slice(name).get_dtype()

  def shape(self, name: str) -> tuple:
    return tuple(self._handle(self.where[name]).get_slice(name).get_shape())

  def raw(self, name: str) -> np.ndarray:
    """The stored array, in its stored dtype."""
    file = self.where[name]
    kind = self.dtype(name)
    if kind not in FP8_DTYPES:
      return self._handle(file).get_tensor(name)
    if file not in self._headers:
      with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        self._headers[file] = (8 + n, json.loads(f.read(n)))
    start, header = self._headers[file]
    begin, end = header[name]["data_offsets"]
    data = np.fromfile(file, dtype=np.uint8, count=end - begin, offset=start + begin)
    return data.view(FP8_DTYPES[kind]).reshape(header[name]["shape"])

  def read(self, name: str) -> np.ndarray:
    """The tensor as a float array; FP8 weights are dequantized with their ``weight_scale_inv``."""
    if self.dtype(name) not in FP8_DTYPES:
      return self.raw(name)
    scale = name + "_scale_inv"
    if not self.has(scale):
      raise ConfigError(f"FP8 tensor {name!r} has no {scale!r} in {self.path}: cannot dequantize it")
    return dequantize_fp8(self.raw(name), self.raw(scale), self.fp8_block)

  def close(self) -> None:
    self._handles.clear()


class ShardedWriter:
  """Buffers tensors and writes shards of at most ``max_bytes`` (one tensor may exceed it alone);
  ``finish`` names them like HF does and writes the index (or a single ``model.safetensors``)."""

  def __init__(self, path: str, max_bytes: int):
    self.path, self.max_bytes = path, max_bytes
    self.buf: dict[str, np.ndarray] = {}
    self.size = self.total = 0
    self.shards: list[tuple[str, list[str]]] = []
    os.makedirs(path, exist_ok=True)
    # Stale shards of an earlier save would otherwise mix into this checkpoint.
    for old in glob.glob(os.path.join(path, "model*.safetensors")) + [os.path.join(path, INDEX)]:
      if os.path.exists(old):
        os.remove(old)

  def add(self, name: str, arr: np.ndarray) -> None:
    if self.buf and self.size + arr.nbytes > self.max_bytes:
      self._flush()
    self.buf[name] = np.ascontiguousarray(arr)
    self.size += arr.nbytes
    self.total += arr.nbytes

  def _flush(self) -> None:
    file = os.path.join(self.path, f"model-part{len(self.shards) + 1:05d}.safetensors.tmp")
    save_file(self.buf, file, metadata={"format": "pt"})
    self.shards.append((file, list(self.buf)))
    self.buf, self.size = {}, 0

  def finish(self) -> list[str]:
    if self.buf or not self.shards:
      self._flush()
    n = len(self.shards)
    if n == 1:
      os.replace(self.shards[0][0], os.path.join(self.path, SINGLE))
      return [SINGLE]
    weight_map, names = {}, []
    for i, (file, tensors) in enumerate(self.shards, start=1):
      final = f"model-{i:05d}-of-{n:05d}.safetensors"
      os.replace(file, os.path.join(self.path, final))
      weight_map.update({t: final for t in tensors})
      names.append(final)
    with open(os.path.join(self.path, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
    return names

"""Versioned weight broadcast from the learner to rollout workers, full or delta, with checksums.

An update is ``(version, tensors or deltas, per-tensor checksums)``. A *full* update carries every
tensor's raw bytes; a *delta* update carries, per tensor, the XOR of the new raw bits with the
previous version's (bf16 as uint16, f32 as uint32, ...) compressed with zlib -- an unchanged tensor
is ``None``, and a tensor whose few elements changed is mostly zero bytes, which compress to almost
nothing. Applying a delta is bit-exact: XOR is its own inverse. Every tensor carries a 64-bit XXH3
hash of its new bytes, so a worker whose base differs from the learner's (a missed update, a corrupt
buffer) notices and asks for a full copy instead of sampling with wrong weights. XXH3 rather than
zlib's CRC32: 64 MiB hash in ~2 ms against ~16 ms on this 2-core machine, and the hash runs twice
per tensor per update (learner and every worker), so CRC32 alone cost more than the object-store put.
A full-only broadcast (``delta=False``) carries no hashes: with no delta to apply there is no base to
check, and the two hashes were ~4 ms of a 19 ms broadcast of 64 MiB to 2 workers.

The learner side (``Publisher``) puts each update into the Ray object store once (one put, many
gets) and hands workers the *chain* of refs since the last full sync (``rl.full_sync_every``); a
worker applies the deltas after its own version, or the full copy plus every delta when it is
behind the last full sync or a checksum failed (``Receiver``). The functions here are pure and run
without Ray; the Ray put is a callable passed in.

*Pieces*: every tensor cut into rectangles, each its own object in the store, the update only listing
their refs; deltas and checksums are then per piece. A rollout worker spanning several hosts
(``rl.worker_hosts`` > 1) gets the tensors cut as its mesh cuts them (``split_blocks``), and a
multi-process learner with ``rl.broadcast_from=shards`` puts its own shards (``local_pieces``, each
process its chain; ``merge_chains``). A receiver fetches only the pieces that overlap its devices'
slices (``Receiver(want=)``) and rebuilds its tensors from them (``assemble``), so no host of a gang
pulls or holds the whole policy and no learner host gathers it.
"""

from __future__ import annotations

import dataclasses
import zlib

import ml_dtypes
import numpy as np
import xxhash


class ChecksumError(ValueError):
  """A tensor's bytes after applying an update do not match the learner's checksum."""


@dataclasses.dataclass
class Update:
  version: int
  kind: str  # "full" | "delta"
  base: int  # version a delta applies to (-1 for full)
  names: tuple  # tensor names (tree paths), in leaf order
  # full: each tensor's raw bits as an unsigned-int array (bf16 -> uint16: pickle protocol 5, and so
  # Ray's zero-copy path, only handles builtin dtypes); delta: zlib(XOR bytes) or None (unchanged)
  data: list
  checksums: list | None  # XXH3-64 of each tensor's new raw bytes (None: not checked, see encode_full)
  dtypes: tuple = ()
  shapes: tuple = ()
  blocked: bool = False  # data holds one store handle per block (module docstring: blocks)

  @property
  def nbytes(self) -> int:
    """Payload bytes (what travels): raw tensor bytes, or compressed delta bytes."""
    if self.kind == "full":
      return int(sum(a.nbytes for a in self.data))
    return int(sum(len(d) for d in self.data if d is not None))


def _bits(a: np.ndarray) -> np.ndarray:
  """The raw bits of ``a`` as an unsigned-integer view of the same width (bf16 -> uint16)."""
  a = np.ascontiguousarray(a)
  width = a.dtype.itemsize
  return a.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])


def _dtype(name: str) -> np.dtype:
  return np.dtype(getattr(ml_dtypes, name, name))


def checksum(a: np.ndarray) -> int:
  return xxhash.xxh3_64_intdigest(_bits(a).view(np.uint8))


def flatten(tree) -> tuple[tuple, list[np.ndarray]]:
  """(names, host arrays) of a pytree, e.g. ``(params, rest)`` of an NNX model."""
  import jax
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = tuple(jax.tree_util.keystr(k) for k, _ in leaves)
  return names, [np.asarray(v) for _, v in leaves]


def encode_full(version: int, names, arrays, checksums: bool = True) -> Update:
  """Every tensor's raw bits; ``checksums=False`` for a full-only broadcast (module docstring)."""
  arrays = [np.ascontiguousarray(a).reshape(np.shape(a)) for a in arrays]  # 0-d stays 0-d
  return Update(version, "full", -1, tuple(names), [_bits(a).reshape(a.shape) for a in arrays],
                [checksum(a) for a in arrays] if checksums else None,
                tuple(str(a.dtype) for a in arrays), tuple(a.shape for a in arrays))


def encode_delta(version: int, base: int, names, prev, new, level: int = 1) -> Update:
  """Per tensor: None if bit-identical to ``prev``, else zlib(XOR of the raw bits)."""
  data, sums = [], []
  for p, n in zip(prev, new, strict=True):
    if p.shape != n.shape or p.dtype != n.dtype:
      raise ValueError(f"delta needs the same shape and dtype: {p.shape} {p.dtype} -> {n.shape} {n.dtype}")
    x = np.bitwise_xor(_bits(p), _bits(n))
    data.append(zlib.compress(x.tobytes(), level) if x.any() else None)
    sums.append(checksum(n))
  return Update(version, "delta", base, tuple(names), data, sums,
                tuple(str(a.dtype) for a in new), tuple(a.shape for a in new))


def decode(update: Update, prev: list | None, copy: bool = True) -> list[np.ndarray]:
  """The tensors of ``update`` (a delta applies to ``prev``); raises ChecksumError on a mismatch.

  ``copy=False`` returns a full update's tensors as views of its buffers (read-only, zero-copy
  views of the object store after ``ray.get``), for a caller that hands them to ``to_device``: no
  host copy of any byte (nor the page faults of a fresh allocation).
  """
  if update.kind == "full":
    out = [(np.array(a, copy=True) if copy else a).view(_dtype(d))
           for a, d in zip(update.data, update.dtypes)]
  else:
    if prev is None or len(prev) != len(update.data):
      raise ChecksumError(f"delta to version {update.version} needs the tensors of version {update.base}")
    out = []
    for p, d in zip(prev, update.data):
      if d is None:
        out.append(p)
        continue
      bits = _bits(p)
      x = np.frombuffer(zlib.decompress(d), bits.dtype)
      if x.shape != bits.shape:
        raise ChecksumError(f"delta to version {update.version}: tensor sizes differ")
      out.append(np.bitwise_xor(bits, x).view(p.dtype).reshape(p.shape))
  if update.checksums is None:  # a full-only broadcast's update (encode_full)
    return out
  for name, a, s in zip(update.names, out, update.checksums, strict=True):
    if checksum(a) != s:
      raise ChecksumError(f"tensor {name} of version {update.version} fails its checksum")
  return out


def to_device(arrays: list[np.ndarray], shardings: list | None = None) -> list:
  """A worker's tensors as jax arrays. ``jax.device_put``, not ``jnp.asarray``: on CPU it aliases a
  64-byte-aligned host buffer instead of copying it (Ray aligns every store buffer of 2 KiB and
  more), so the workers on one machine share the store's copy of a full update and a swap copies
  nothing; the jax arrays keep the buffers alive. On GPU/TPU it is the host-to-device copy.
  ``shardings`` (one per tensor; a worker over several devices, rl/worker_devices.py): each device
  gets only its own slice of each tensor. A gang's sharding (``rl.worker_hosts`` > 1) spans other
  processes' devices too: each process places only its own devices' slices."""
  import jax
  if shardings is None or all(s.is_fully_addressable for s in shardings):
    return jax.device_put(list(arrays), None if shardings is None else list(shardings))
  return [jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx])
          for a, s in zip(arrays, shardings, strict=True)]


# --------------------------------------------------------------------------------------------------
# Pieces: a tensor cut into rectangles, each its own store object
# --------------------------------------------------------------------------------------------------
# A piece is named ``tensor@start:stop,start:stop`` (its region of the tensor; ``tensor@`` for a 0-d
# one). Two cuts use them: a gang's blocks (``split_blocks``: the worker mesh's layout, cut on the
# learner) and a multi-process learner's own shards (``local_pieces``, rl.broadcast_from=shards: each
# process puts what it holds). A receiver keeps the pieces that overlap what it needs (``wants``) and
# rebuilds its slices from them (``assemble``), whichever cut they came in.


def block_grid(shape: tuple, spec, sizes: dict) -> tuple:
  """How many blocks each dim of a tensor of ``shape`` splits into under PartitionSpec ``spec`` on a
  mesh of axis ``sizes`` (the product of the sizes of the axes naming that dim)."""
  grid = []
  for d in range(len(shape)):
    entry = spec[d] if d < len(spec) else None
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    grid.append(int(np.prod([sizes[a] for a in axes])) if axes else 1)
  return tuple(grid)


def region_of(index: tuple, shape: tuple) -> tuple:
  """``((start, stop), ...)`` of a device's ``index`` (its tuple of slices of a tensor of ``shape``)."""
  return tuple((sl.start or 0, n if sl.stop is None else sl.stop)
               for sl, n in zip(index, shape, strict=True))


def piece_name(name: str, region: tuple) -> str:
  return f"{name}@{','.join(f'{a}:{b}' for a, b in region)}"


def parse_piece(piece: str) -> tuple[str, tuple]:
  name, _, r = piece.rpartition("@")
  return name, tuple(tuple(int(x) for x in d.split(":")) for d in r.split(",")) if r else ()


def split_blocks(names, arrays, grids) -> tuple[tuple, list]:
  """(piece names, arrays): every tensor cut by its grid, blocks in row-major order."""
  out_names, out = [], []
  for name, a, grid in zip(names, arrays, grids, strict=True):
    step = [n // k for n, k in zip(a.shape, grid)]
    for coord in np.ndindex(*grid):
      region = tuple((c * s, (c + 1) * s) for c, s in zip(coord, step))
      out_names.append(piece_name(name, region))
      # np.array, not ascontiguousarray: that makes a 0-d tensor 1-d
      out.append(np.array(a[tuple(slice(*r) for r in region)]))
  return tuple(out_names), out


def local_pieces(tree) -> tuple[tuple, list]:
  """(piece names, host arrays) of the shards of a pytree of jax arrays that this process puts: each
  distinct shard once over all processes (the copy with replica id 0, on exactly one device)."""
  import jax
  names, out = [], []
  for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path)
    for shard in v.addressable_shards:
      if shard.replica_id == 0:
        names.append(piece_name(name, region_of(shard.index, v.shape)))
        out.append(np.asarray(shard.data))
  return tuple(names), out


def _overlaps(a: tuple, b: tuple) -> bool:
  return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def wants(names, shapes, shardings, devices=None):
  """``Receiver(want=)`` of a receiver holding ``devices``' slices (default: this process's devices)
  of each tensor under its sharding: true of every piece that overlaps one of those slices."""
  import jax
  mine = (lambda d: d.process_index == jax.process_index()) if devices is None else devices.__contains__
  need: dict[str, set] = {}
  for name, shape, sh in zip(names, shapes, shardings, strict=True):
    need[name] = {region_of(index, tuple(shape))
                  for dev, index in sh.devices_indices_map(tuple(shape)).items() if mine(dev)}

  def want(piece: str) -> bool:
    name, region = parse_piece(piece)
    return any(_overlaps(region, r) for r in need.get(name, ()))
  return want


def cut(region: tuple, pieces: list, dtype) -> np.ndarray:
  """The part ``region`` of a tensor from its pieces ``[(region, array)]`` (disjoint): the piece
  itself where one matches exactly (no copy), else a new array filled from every piece it overlaps."""
  for r, a in pieces:
    if r == region:
      return a
  out = np.empty([b - a for a, b in region], dtype)
  filled = 0
  for r, a in pieces:
    lo = [max(x0, y0) for (x0, _), (y0, _) in zip(r, region)]
    hi = [min(x1, y1) for (_, x1), (_, y1) in zip(r, region)]
    if any(l >= h for l, h in zip(lo, hi)):
      continue
    out[tuple(slice(l - q0, h - q0) for l, h, (q0, _) in zip(lo, hi, region))] = \
        a[tuple(slice(l - r0, h - r0) for l, h, (r0, _) in zip(lo, hi, r))]
    filled += int(np.prod([h - l for l, h in zip(lo, hi)]))
  if filled != out.size:
    raise ValueError(f"the pieces received cover {filled} of the {out.size} elements of region "
                     f"{region}: the learner and the worker cut the tensors differently (same config?)")
  return out


def assemble(names, shapes, pieces: dict, shardings=None) -> list:
  """The tensors ``names`` from the pieces ``{piece name: array}``: whole host arrays, or with
  ``shardings`` global jax arrays, each of this process's devices getting its slice."""
  import jax
  by: dict[str, list] = {}
  for piece, a in pieces.items():
    name, region = parse_piece(piece)
    by.setdefault(name, []).append((region, a))
  out = []
  for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
    shape, got = tuple(shape), by.get(name)
    if not got:
      raise ValueError(f"no piece of tensor {name} was received (same config on learner and worker?)")
    dtype = got[0][1].dtype
    if shardings is None:
      out.append(cut(tuple((0, n) for n in shape), got, dtype))
    else:
      out.append(jax.make_array_from_callback(
          shape, shardings[i], lambda idx, g=got, s=shape, d=dtype: cut(region_of(idx, s), g, d)))
  return out


# --------------------------------------------------------------------------------------------------
# The two ends
# --------------------------------------------------------------------------------------------------


class Publisher:
  """Learner end: encodes each version against the previous one and keeps the chain since the last
  full sync. ``put`` stores an Update and returns a handle (``ray.put``; identity without Ray)."""

  def __init__(self, full_sync_every: int = 10, delta: bool = True, put=lambda u: u, grids=None):
    self.every, self.delta, self.put = max(1, int(full_sync_every)), delta, put
    self.grids = grids  # one block grid per tensor (leaf order): every block its own object
    self.prev: list | None = None
    self.names: tuple = ()
    self.chain: list = []  # [(version, kind, handle)], chain[0] is a full update
    self.last_bytes = 0

  def publish(self, tree, version: int) -> list:
    names, arrays = flatten(tree)
    if self.grids is not None:
      names, arrays = split_blocks(names, arrays, self.grids)
    return self.publish_arrays(names, arrays, version, blocked=self.grids is not None)

  def publish_arrays(self, names, arrays, version: int, blocked: bool = True) -> list:
    """``names``/``arrays`` as one update: with ``blocked``, pieces (``local_pieces``), each its own
    object."""
    since_full = version - self.chain[0][0] if self.chain else None
    if (not self.delta or self.prev is None or names != self.names or since_full is None
        or since_full >= self.every):
      upd = encode_full(version, names, arrays, checksums=self.delta)
      self.chain = []
    else:
      upd = encode_delta(version, self.chain[-1][0], names, self.prev, arrays)
    self.prev, self.names, self.last_bytes = arrays, names, upd.nbytes
    if blocked:  # the update lists the pieces' refs (None: unchanged in a delta)
      upd.data = [None if d is None else self.put(d) for d in upd.data]
      upd.blocked = True
    self.chain.append((version, upd.kind, self.put(upd)))
    return list(self.chain)


def merge_chains(chains: list) -> list:
  """One chain from every learner process's (rl.broadcast_from=shards): each entry holds one handle
  per process, whose pieces together make the update. Every process full-syncs at the same
  versions (the same ``full_sync_every`` over the same versions), so the entries line up."""
  out = []
  for entries in zip(*chains, strict=True):
    if len({e[:2] for e in entries}) != 1:
      raise ValueError(f"learner processes published different updates: {[e[:2] for e in entries]}")
    out.append((*entries[0][:2], tuple(e[2] for e in entries)))
  return out


class Receiver:
  """Worker end: applies a chain to its current tensors. ``get`` fetches an Update from a handle
  (``ray.get``). Counts full copies taken and checksum failures. ``copy=False``: the tensors of a
  full update stay views of the fetched buffers (see ``decode``); the caller must not write them."""

  def __init__(self, get=lambda h: h, copy: bool = True, want=None):
    self.get, self.copy = get, copy
    self.want = want  # pieces: true of the piece names to fetch (``wants``; the rest are never pulled)
    self.blocked = False  # the tensors are pieces (``assemble`` them), not whole tensors in leaf order
    self.version = -1
    self.arrays: list | None = None
    self.names: tuple = ()  # of ``arrays`` (tensor names, or the wanted pieces' names)
    self.full_copies = 0
    self.checksum_failures = 0
    self.fetched_bytes = 0  # payload bytes pulled from the store

  def _fetch(self, handle) -> Update:
    """The update of ``handle`` (a tuple: one part per learner process, ``merge_chains``); a blocked
    one cut down to the wanted pieces, their payloads fetched."""
    parts = [self._pieces(self.get(h)) for h in (handle if isinstance(handle, tuple) else (handle,))]
    u = parts[0] if len(parts) == 1 else dataclasses.replace(
        parts[0], names=sum((p.names for p in parts), ()), data=[d for p in parts for d in p.data],
        checksums=None if parts[0].checksums is None else [c for p in parts for c in p.checksums],
        dtypes=sum((p.dtypes for p in parts), ()), shapes=sum((p.shapes for p in parts), ()))
    self.fetched_bytes += u.nbytes
    self.names = u.names
    return u

  def _pieces(self, u: Update) -> Update:
    if not u.blocked:
      self.blocked = False
      return u
    self.blocked = True
    keep = [i for i, n in enumerate(u.names) if self.want is None or self.want(n)]
    return dataclasses.replace(
        u, names=tuple(u.names[i] for i in keep),
        data=[None if u.data[i] is None else self.get(u.data[i]) for i in keep],
        checksums=None if u.checksums is None else [u.checksums[i] for i in keep],
        dtypes=tuple(u.dtypes[i] for i in keep), shapes=tuple(u.shapes[i] for i in keep),
        blocked=False)

  def apply(self, chain: list, corrupt=None) -> bool:
    """Bring the tensors to the chain's last version; False if already there. ``corrupt`` (tests)
    is called on the tensors before the first delta, as a damaged buffer would be."""
    if not chain or chain[-1][0] <= self.version:
      return False
    base_ok = self.arrays is not None and self.version >= chain[0][0]
    if base_ok:
      if corrupt is not None:
        corrupt(self.arrays)
      try:
        arrays = self.arrays
        for v, kind, h in chain[1:]:
          if v > self.version:
            arrays = decode(self._fetch(h), arrays, self.copy)
        self.arrays, self.version = arrays, chain[-1][0]
        return True
      except ChecksumError:
        self.checksum_failures += 1
    # Behind the last full sync, or a checksum failed: take the full copy and every delta after it.
    self.full_copies += 1
    arrays = None
    for _, _, h in chain:
      arrays = decode(self._fetch(h), arrays, self.copy)
    self.arrays, self.version = arrays, chain[-1][0]
    return True

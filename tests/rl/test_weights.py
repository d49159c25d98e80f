"""Weight broadcast without Ray: full and delta updates are bit-exact in bf16 and f32, checksums catch
a damaged base, the publisher syncs in full every N versions, a receiver that falls behind or fails a
checksum rebuilds from the full copy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from composer_jax.rl import weights as W

BF16 = ml_dtypes.bfloat16


def _tensors(dtype, seed=0):
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((33, 17)).astype(dtype)
  b = rng.standard_normal((5,)).astype(dtype)
  # Special values: -0, inf, nan (a payload that compares unequal to itself), subnormal.
  b[:4] = np.array([-0.0, np.inf, np.nan, 1e-40], np.float32).astype(dtype)
  c = np.arange(6, dtype=np.int32)
  return [a, b, c]


def _step(ts, dtype, frac, seed=1):
  """An Adam-like update of a fraction of the elements (the rest stay bit-identical)."""
  rng = np.random.default_rng(seed)
  out = []
  for t in ts:
    t = t.copy()
    if t.dtype != np.int32:
      m = rng.random(t.shape) < frac
      t[m] = (t[m].astype(np.float32) - 1e-3 * np.sign(rng.standard_normal(m.sum()))).astype(dtype)
    out.append(t)
  return out


def _same_bits(x, y):
  return all(a.dtype == b.dtype and a.shape == b.shape and
             np.array_equal(W._bits(a), W._bits(b)) for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_full_and_delta_round_trip_bit_exact(dtype):
  names = ("a", "b", "c")
  v0 = _tensors(dtype)
  v1 = _step(v0, dtype, 0.1)
  full = W.encode_full(0, names, v0)
  assert _same_bits(W.decode(full, None), v0)
  d = W.encode_delta(1, 0, names, v0, v1)
  assert d.data[2] is None  # the int tensor did not change
  assert _same_bits(W.decode(d, v0), v1)
  # Only about 10 % of elements changed: the delta is far smaller than a full copy.
  assert d.nbytes < 0.6 * sum(a.nbytes for a in v1), (d.nbytes, sum(a.nbytes for a in v1))
  # An identical version is an empty delta.
  assert W.encode_delta(2, 1, names, v1, v1).nbytes == 0


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_checksum_catches_a_wrong_base(dtype):
  names = ("a", "b", "c")
  v0 = _tensors(dtype)
  v1 = _step(v0, dtype, 0.5)
  d = W.encode_delta(1, 0, names, v0, v1)
  bad = [t.copy() for t in v0]
  W._bits(bad[0])[3] ^= 1  # one flipped bit in the worker's copy
  with pytest.raises(W.ChecksumError, match="'?a'? of version 1"):
    W.decode(d, bad)
  assert W.checksum(v1[0]) == d.checksums[0] and W.checksum(bad[0]) != W.checksum(v0[0])


def test_publisher_and_receiver_chain_full_sync_and_recovery():
  import jax.numpy as jnp
  tree = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.zeros((4,), jnp.float32)}
  pub = W.Publisher(full_sync_every=3)
  kinds = []
  versions = []
  for v in range(7):
    tree = {"w": tree["w"].at[v % 8, 0].add(1.0), "b": tree["b"] + (v % 2)}
    chain = pub.publish(tree, v)
    kinds.append(chain[-1][1])
    versions.append([c[0] for c in chain])
  # Full at 0, 3, 6; a chain holds the last full and the deltas after it.
  assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
  assert versions[5] == [3, 4, 5]
  want = W.flatten(tree)[1]

  # A receiver that follows every version applies deltas only.
  pub2 = W.Publisher(full_sync_every=3)
  rx = W.Receiver()
  t = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.zeros((4,), jnp.float32)}
  for v in range(6):
    t = {"w": t["w"].at[v % 8, 0].add(1.0), "b": t["b"] + (v % 2)}
    assert rx.apply(pub2.publish(t, v))
  assert rx.version == 5 and rx.full_copies == 2  # the two full syncs (0 and 3)
  assert _same_bits(rx.arrays, W.flatten(t)[1])
  assert not rx.apply(pub2.chain)  # already there

  # A damaged copy fails the checksum of the next delta and is rebuilt from the full copy.
  t2 = {"w": t["w"].at[1, 1].add(3.0), "b": t["b"]}
  pub3 = W.Publisher(full_sync_every=100)
  rx3 = W.Receiver()
  rx3.apply(pub3.publish(t, 0))
  chain = pub3.publish(t2, 1)
  assert chain[-1][1] == "delta"

  def corrupt(arrays):
    W._bits(arrays[1])[0] ^= 1 << 5  # 'w' (leaves sort by key: b, w)

  assert rx3.apply(chain, corrupt=corrupt)
  assert rx3.checksum_failures == 1 and rx3.full_copies == 2
  assert _same_bits(rx3.arrays, W.flatten(t2)[1])

  # A receiver that starts late (a replacement worker) takes the full copy + deltas.
  late = W.Receiver()
  late.apply(pub.chain)
  assert late.version == 6 and late.full_copies == 1 and _same_bits(late.arrays, want)


def test_full_only_broadcast_skips_the_hashes_and_delta_mode_keeps_them(monkeypatch):
  """``delta=False``: every version is a full copy with no checksums, and neither end hashes a byte;
  with deltas on, the full syncs still carry hashes (the base the next delta is checked against)."""
  v0 = _tensors(BF16)
  v1 = _step(v0, BF16, 0.1)
  calls = []
  real = W.checksum
  monkeypatch.setattr(W, "checksum", lambda a: calls.append(1) or real(a))
  pub, rx = W.Publisher(delta=False), W.Receiver()
  for v, t in enumerate((v0, v1)):
    chain = pub.publish(t, v)
    assert [c[1] for c in chain] == ["full"] and chain[0][2].checksums is None
    assert rx.apply(chain) and rx.version == v and _same_bits(rx.arrays, t)
  assert not calls
  full = W.Publisher(delta=True).publish(v0, 0)[0][2]
  assert full.kind == "full" and full.checksums == [real(a) for a in v0]
  assert len(calls) == len(v0)


def test_receiver_without_copy_views_the_full_update_and_never_writes_it():
  """``copy=False`` (the Ray worker's mode): a full update's tensors are views of the fetched
  buffers, read-only as the object store's are; deltas on top still land bit-exact, in new arrays."""
  v0 = _tensors(BF16)
  v1 = _step(v0, BF16, 0.1)
  pub = W.Publisher(full_sync_every=10)
  chain = pub.publish(v0, 0)
  full = chain[0][2]
  for d in full.data:
    d.flags.writeable = False  # as ray.get returns them
  rx = W.Receiver(copy=False)
  assert rx.apply(chain) and _same_bits(rx.arrays, v0)
  assert all(np.shares_memory(a, d) for a, d in zip(rx.arrays, full.data))
  before = [d.copy() for d in full.data]
  assert rx.apply(pub.publish(v1, 1)) and _same_bits(rx.arrays, v1)
  assert all(np.array_equal(d, b) for d, b in zip(full.data, before))  # the store's copy untouched
  # The default copies: the receiver's tensors are its own.
  rx2 = W.Receiver()
  rx2.apply(chain)
  assert not any(np.shares_memory(a, d) for a, d in zip(rx2.arrays, full.data))


def test_to_device_shares_the_fetched_buffers_and_keeps_them_alive():
  """A worker's swap copies no aligned tensor: ``to_device`` aliases read-only 64-byte-aligned
  buffers (what ``ray.get`` returns for tensors of 2 KiB and more), and the jax arrays keep them
  alive after every other reference is gone. A misaligned small tensor is copied, with the same
  values."""
  import gc

  rng = np.random.default_rng(0)
  want = [rng.standard_normal((64, 32)).astype(BF16), rng.standard_normal(3).astype(np.float32)]
  store = np.zeros(8192 + 64 + 128, np.uint8)  # one buffer, as the object store's mapping is
  base = (-store.ctypes.data) % 64
  big = store[base:base + want[0].nbytes].view(BF16).reshape(want[0].shape)
  small = store[base + 8192 + 4:base + 8192 + 16].view(np.float32)  # 4 bytes past a 64-byte line
  big[...], small[...] = want
  store.flags.writeable = False
  views = [store[base:base + want[0].nbytes].view(BF16).reshape(want[0].shape),
           store[base + 8192 + 4:base + 8192 + 16].view(np.float32)]
  del big, small
  out = W.to_device(views)
  assert out[0].unsafe_buffer_pointer() == views[0].ctypes.data  # shared, not copied
  assert out[1].unsafe_buffer_pointer() != views[1].ctypes.data  # misaligned: copied
  del views, store
  gc.collect()
  junk = [np.full(1 << 16, 7.0) for _ in range(64)]  # reuse freed memory if it had been freed
  for o, w in zip(out, want):
    assert _same_bits([np.asarray(o)], [w])
  del junk


def _store():
  store: dict = {}
  fetched: list = []

  def put(x):
    store[len(store)] = x
    return len(store) - 1

  def get(h):
    fetched.append(h)
    return store[h]
  return put, get, fetched


def test_blocks_carry_each_member_only_its_devices_slices():
  """A gang's broadcast (``Publisher(grids=)``): every tensor cut as the worker mesh shards it, one
  store object per block. A member holding half the mesh fetches only its blocks (and, in a delta,
  only those that changed), decodes them bit-exactly, and places them where the full tensors would
  be placed; a receiver of every block rebuilds every tensor."""
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  devs = np.asarray(jax.devices()[:4]).reshape(2, 2)
  mesh, sizes = Mesh(devs, ("a", "b")), {"a": 2, "b": 2}
  rng = np.random.default_rng(0)
  tree = {"e": rng.standard_normal((4, 3, 2)).astype(BF16), "s": np.array(3.0, np.float32),
          "w": rng.standard_normal((8, 6)).astype(np.float32)}
  specs = [P(("a", "b")), P(), P("a", "b")]  # leaf order: e, s, w
  names, arrays = W.flatten(tree)
  grids = [W.block_grid(a.shape, sp, sizes) for a, sp in zip(arrays, specs)]
  assert grids == [(4, 1, 1), (), (2, 2)]
  shardings = [NamedSharding(mesh, sp) for sp in specs]
  shapes = [a.shape for a in arrays]
  put, get, fetched = _store()
  pub = W.Publisher(full_sync_every=5, delta=True, put=put, grids=grids)
  half = set(devs[0])  # mesh row a=0: e's blocks 0 and 1, w's top half, the scalar
  want = W.wants(names, shapes, shardings, devices=half)
  member, whole = W.Receiver(get=get, want=want), W.Receiver(get=get)
  member.apply(pub.publish(tree, 0))
  assert set(member.names) == {"['e']@0:1,0:3,0:2", "['e']@1:2,0:3,0:2", "['s']@", "['w']@0:4,0:3",
                               "['w']@0:4,3:6"}
  assert len(fetched) == 1 + 5  # the update's block list, then this member's blocks only
  blocks = dict(zip(member.names, member.arrays))
  np.testing.assert_array_equal(blocks["['w']@0:4,3:6"], tree["w"][:4, 3:])
  assert blocks["['e']@1:2,0:3,0:2"].dtype == BF16
  assert np.array_equal(blocks["['e']@1:2,0:3,0:2"], tree["e"][1:2])
  assert blocks["['s']@"].shape == ()
  # A delta that changes one element of w's bottom-right block (not this member's) and one of e's 1st.
  new = {k: v.copy() for k, v in tree.items()}
  new["w"][7, 5] += 1
  new["e"][1, 2, 1] = BF16(5.0)
  fetched.clear()
  assert member.apply(pub.publish(new, 1)) and pub.chain[-1][1] == "delta"
  assert len(fetched) == 2  # the update, and the one changed block this member holds
  blocks = dict(zip(member.names, member.arrays))
  np.testing.assert_array_equal(blocks["['e']@1:2,0:3,0:2"], new["e"][1:2])
  # Every block: the tensors placed from blocks are the tensors placed whole, bit for bit.
  whole.apply(pub.chain)
  placed = W.assemble(names, shapes, dict(zip(whole.names, whole.arrays)), shardings)
  for got, want_a, sh in zip(placed, W.flatten(new)[1], shardings):
    assert got.sharding == sh
    assert got.shape == want_a.shape
    np.testing.assert_array_equal(W._bits(np.asarray(got)), W._bits(want_a))


def test_learner_shards_as_pieces_rebuild_any_worker_layout():
  """rl.broadcast_from=shards: each learner process puts the distinct shards it holds (replicas
  once), the chains of the processes merge into one, and a worker whose mesh cuts the tensors
  differently fetches only the pieces overlapping its devices' slices and rebuilds them bit-exactly,
  in full and through a delta; a receiver missing a piece names it instead of placing garbage."""
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  rng = np.random.default_rng(1)
  host = {"e": rng.standard_normal((8, 3, 2)).astype(BF16), "s": np.array(2.5, np.float32),
          "w": rng.standard_normal((8, 6)).astype(np.float32)}
  learner = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
  lspecs = {"e": P(("x", "y")), "s": P(), "w": P("y")}  # w: 4 row blocks, each on 2 devices
  place = lambda t: {k: jax.device_put(v, NamedSharding(learner, lspecs[k])) for k, v in t.items()}
  names, pieces = W.local_pieces(place(host))
  assert len(names) == 8 + 1 + 4  # every distinct shard once: e's 8, the scalar, w's 4 row blocks
  np.testing.assert_array_equal(pieces[names.index("['w']@2:4,0:6")], host["w"][2:4])
  # Two learner "processes", each putting its half of the pieces, merged as the leader merges them.
  put, get, fetched = _store()
  pubs = [W.Publisher(full_sync_every=5, put=put) for _ in range(2)]

  def publish(tree, version):
    n, p = W.local_pieces(place(tree))
    return W.merge_chains([pub.publish_arrays(n[i::2], p[i::2], version) for i, pub in enumerate(pubs)])
  # The worker: a 2 x 2 mesh that splits w by columns and e in halves; a member holds row a=0.
  devs = np.asarray(jax.devices()[:4]).reshape(2, 2)
  worker = Mesh(devs, ("a", "b"))
  shardings = [NamedSharding(worker, sp) for sp in (P("a"), P(), P(None, "b"))]  # leaf order: e, s, w
  tnames, shapes = W.flatten(host)[0], [host[k].shape for k in ("e", "s", "w")]
  member = W.Receiver(get=get, want=W.wants(tnames, shapes, shardings, devices=set(devs[0])))
  whole = W.Receiver(get=get)
  chain = publish(host, 0)
  assert member.apply(chain) and len(fetched) == 2 + 4 + 1 + 4  # 2 updates; e's first 4, s, all of w
  got = dict(zip(member.names, member.arrays))
  by = lambda t: [(W.parse_piece(n)[1], a) for n, a in got.items() if n.startswith(f"['{t}']")]
  np.testing.assert_array_equal(W.cut(((0, 4), (0, 3), (0, 2)), by("e"), BF16), host["e"][:4])
  np.testing.assert_array_equal(W.cut(((0, 8), (3, 6)), by("w"), np.float32), host["w"][:, 3:])
  with pytest.raises(ValueError, match="cover 0 of the 24 elements"):  # e's second half: not fetched
    W.cut(((4, 8), (0, 3), (0, 2)), by("e"), BF16)
  # One optimizer-like change in each process's half; the member pulls only what it holds.
  new = {k: v.copy() for k, v in host.items()}
  new["w"][5, 4] -= 1  # piece w@4:6, inside the member's columns
  new["e"][7, 0, 0] = BF16(3.0)  # piece e@7:8, not the member's
  fetched.clear()
  chain = publish(new, 1)
  assert chain[-1][1] == "delta" and member.apply(chain) and len(fetched) == 2 + 1
  whole.apply(chain)
  for placed in (W.assemble(tnames, shapes, dict(zip(whole.names, whole.arrays)), shardings),
                 W.assemble(tnames, shapes, dict(zip(whole.names, whole.arrays)))):
    for a, k in zip(placed, ("e", "s", "w")):
      assert np.asarray(a).dtype == new[k].dtype and np.asarray(a).shape == new[k].shape
      np.testing.assert_array_equal(W._bits(np.asarray(a)), W._bits(new[k]))
  # Processes that disagree on an update's kind cannot be merged into one chain.
  with pytest.raises(ValueError, match="different updates"):
    W.merge_chains([[(2, "full", 0)], [(2, "delta", 1)]])

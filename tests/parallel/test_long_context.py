"""Long context on the fake 8-device CPU mesh: the tiny model (MLA + MoE, cut to a dense block and
an MoE block) at 8K tokens with context parallelism 8 gives the single-device loss, gradients and
QK-clip max logits.

Packed rows of three documents (positions restart, segment ids 1..3, padding at the end), float32,
matmul precision highest (tests/conftest.py). The attention on CPU is the blockwise kernel on one
device and the zigzag split of parallel/context.py with the same kernel inside (tiles of
model.attention_block = 128 rows) on the mesh. Tolerances: loss 1e-5 relative, each gradient within
1e-4 of its largest entry, max logits 1e-5 relative.

Both run by default. Cold (compile included) on the shared 2-core machine: 8K on context 8 took
26 s at a load of 3.6 (42 s at a load of 7), under the 60 s that would make it ``slow``; the second
test checks, at 2K, the layout docs/long_context.md plans K2.5's 256K stage with, scaled down
(57 s at a load of 7).
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from composer_jax.config import load_config
from composer_jax.model import build_model, lm_loss
from composer_jax.parallel.mesh import build_mesh
from composer_jax.parallel.rules import activate, make_rules, spec_for, state_shardings
from composer_jax.train.step import pop_max_logits

# Parameters' embed-like dims over fsdp and context, as docs/long_context.md plans the 256K stage.
PARAMS_OVER_CONTEXT = ("mesh.rules={embed: [fsdp, context], exp_embed: [fsdp, context], "
                       "q_lora_up: [fsdp, context], kv_lora_up: [fsdp, context]}")


def config(seq: int, batch: int, *overrides):
  return load_config("configs/tiny.yaml", [
      f"model.max_seq_len={seq}", f"data.seq_len={seq}", f"data.batch_size={batch}",
      "model.n_layers=2", "model.mtp_depths=0", "model.param_dtype=float32",
      "model.compute_dtype=float32", *overrides])


def packed_batch(cfg, batch: int, seed: int = 0) -> dict:
  """Three documents per row at random cuts, the last 100 tokens of row 0 padding (segment 0)."""
  rng = np.random.default_rng(seed)
  s = cfg.data.seq_len
  tokens = rng.integers(1, cfg.model.vocab_size, (batch, s)).astype(np.int32)
  cuts = np.sort(rng.integers(s // 8, s - s // 8, (batch, 2)), axis=1)
  idx = np.arange(s)[None]
  seg = (1 + (idx >= cuts[:, :1]) + (idx >= cuts[:, 1:])).astype(np.int32)
  start = np.where(seg == 1, 0, np.where(seg == 2, cuts[:, :1], cuts[:, 1:]))
  pos = (idx - start).astype(np.int32)
  seg[0, -100:] = 0
  return {"tokens": tokens, "segment_ids": seg, "positions": pos,
          "loss_mask": (seg > 0).astype(np.float32)}


def loss_and_grads(cfg, graphdef, params, rest, batch, mesh_axes: dict | None):
  """(loss, per-layer max logits [layers, heads], grads) as host float64, on one device or on the
  mesh ``mesh_axes`` (every other axis 1)."""
  def fn(params, rest, batch):
    def loss(params):
      model = nnx.merge(graphdef, params, rest)
      model.set_attributes(record_max_logit=True, raise_if_not_found=False)
      out = model(batch["tokens"], batch["segment_ids"], batch["positions"])
      total = lm_loss(out, batch["tokens"], batch["loss_mask"], cfg.model, batch["segment_ids"])[0]
      return total, pop_max_logits(model)
    (total, top), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return total, top, grads

  mesh, rules = None, None
  if mesh_axes is not None:
    for a in ("data", "fsdp", "expert", "tensor", "context"):
      setattr(cfg.mesh, a, mesh_axes.get(a, 1))
    mesh, rules = build_mesh(cfg.mesh), make_rules(cfg.mesh.rules)
    params = jax.device_put(params, state_shardings(params, mesh, rules))
    rest = jax.device_put(rest, state_shardings(rest, mesh, rules))
    shape = batch["tokens"].shape
    spec = spec_for(("act_batch", "act_seq"), shape, mesh, rules, strict=False)
    assert spec[1] == "context"  # the sequence really is split
    batch = jax.device_put(batch, NamedSharding(mesh, spec))
  with activate(mesh, rules):
    total, top, grads = jax.jit(fn)(params, rest, batch)
  host = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)
  return float(total), np.asarray(top, np.float64), host(nnx.to_pure_dict(grads))


def check(seq: int, batch: int, mesh_axes: dict, *overrides):
  cfg = config(seq, batch, *overrides)
  graphdef, params, rest = nnx.split(build_model(cfg), nnx.Param, ...)
  data = packed_batch(cfg, batch)
  t0 = time.perf_counter()
  ref = loss_and_grads(cfg, graphdef, params, rest, data, None)
  t1 = time.perf_counter()
  got = loss_and_grads(cfg, graphdef, params, rest, data, mesh_axes)
  print(f"seq {seq} {mesh_axes}: one device {t1 - t0:.1f} s, mesh {time.perf_counter() - t1:.1f} s")
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
  assert ref[1].shape == (cfg.model.n_layers, cfg.model.n_heads)
  leaves = jax.tree_util.tree_leaves_with_path(ref[2])
  for (path, want), have in zip(leaves, jax.tree.leaves(got[2])):
    scale = np.abs(want).max()
    assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
    err = np.abs(have - want).max()
    assert err <= 1e-4 * scale, (jax.tree_util.keystr(path), err, scale)


@pytest.mark.slow  # 37 s on 2 cores; test_context.py and the 2048-token layout below stay in the default run
def test_context8_at_8k():
  """8192 tokens, one row of three documents, 1024 tokens (two zigzag half-chunks of 512) per
  device."""
  check(8192, 1, {"context": 8})


def test_params_over_context_with_experts_and_tensor():
  """The 256K layout of docs/long_context.md scaled down: expert 2 x context 2 x tensor 2, the
  parameters' embed dims sharded over fsdp and context (so context shards weights, not only
  tokens), two sequences so the expert axis carries a batch shard; the MoE layers scanned and
  rematerialised, as K2.5 runs them."""
  check(2048, 2, {"expert": 2, "context": 2, "tensor": 2}, PARAMS_OVER_CONTEXT,
        "model.scan_layers=true", "model.remat=full")

"""Grain pipelines: tokenize, mix, pack to ``seq_len`` with segment ids and positions, batch.

Every batch is a dict of int32 ``[batch, seq_len]`` arrays:
  tokens       token ids (0 where padding)
  segment_ids  1, 2, ... per packed document within a row; 0 = padding
  positions    position of each token within its segment (restarts at 0)
  loss_mask    1 where the token is a trained *target*: it follows a token of the same segment, and
               (for SFT) the assistant produced it. The model at position t-1 predicts token t.

The iterator is a Grain ``DatasetIterator``: ``get_state()`` is a small JSON-able dict saved with
each checkpoint and ``set_state()`` resumes at exactly the next batch. Data-parallel processes each
take a disjoint slice of the documents (``process_index::process_count``) and produce their share
of the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

FEATURES = ("tokens", "segment_ids", "positions", "loss_mask")


def target_mask(segment_ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
  """1 where token t continues the segment of token t-1 (and ``mask`` allows it)."""
  seg = np.asarray(segment_ids)
  out = np.zeros_like(seg, dtype=np.int32)
  out[..., 1:] = (seg[..., 1:] == seg[..., :-1]) & (seg[..., 1:] > 0)
  if mask is not None:
    out &= np.asarray(mask, np.int32)
  return out


def _finish(batch: dict) -> dict:
  seg = batch["tokens_segment_ids"].astype(np.int32)
  out = {
      "tokens": batch["tokens"].astype(np.int32),
      "segment_ids": seg,
      "positions": batch["tokens_positions"].astype(np.int32),
  }
  out["loss_mask"] = target_mask(seg, batch.get("loss_mask"))
  return out


def _pack(ds: grain.IterDataset, seq_len: int, batch_size: int, with_mask: bool,
          drop_remainder: bool = True) -> grain.IterDataset:
  lengths = {"tokens": seq_len}
  if with_mask:
    lengths["loss_mask"] = seq_len
  packed = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)
  return packed.batch(batch_size, drop_remainder=drop_remainder).map(_finish)


def encoder(tokenizer) -> Callable[[str], dict]:
  eos = tokenizer.eos_id

  def encode(text: str) -> dict:
    return {"tokens": np.asarray(tokenizer.encode(text) + [eos], np.int32)}

  return encode


def shard(ds: grain.MapDataset, process_index: int, process_count: int) -> grain.MapDataset:
  if process_count > 1:
    if len(ds) < process_count:
      raise ValueError(f"{len(ds)} documents cannot be split over {process_count} processes")
    ds = ds[process_index::process_count]
  return ds


def local_batch_size(global_batch: int, process_count: int) -> int:
  if global_batch % process_count:
    raise ValueError(f"data.batch_size={global_batch} must be divisible by the {process_count} "
                     "data-loading processes")
  return global_batch // process_count


def mixture(datasets: Sequence[grain.MapDataset], weights: Sequence[float], seed: int
            ) -> grain.MapDataset:
  """Each source shuffled (a fresh order every epoch) and repeated, then mixed by weight."""
  streams = [ds.shuffle(seed=seed + 7919 * i).repeat() for i, ds in enumerate(datasets)]
  if len(streams) == 1:
    return streams[0]
  keep = [(s, w) for s, w in zip(streams, weights) if w > 0]
  return grain.MapDataset.mix([s for s, _ in keep], [w for _, w in keep])


def pretrain_dataset(texts_per_source: Sequence[Sequence[str]], weights: Sequence[float], tokenizer,
                     *, seq_len: int, batch_size: int, seed: int = 0, process_index: int = 0,
                     process_count: int = 1) -> grain.IterDataset:
  """An endless stream of packed training batches (``batch_size`` = the global batch)."""
  sources = [shard(grain.MapDataset.source(list(t)), process_index, process_count)
             for t in texts_per_source]
  ds = mixture(sources, weights, seed).map(encoder(tokenizer))
  return _pack(ds.to_iter_dataset(), seq_len, local_batch_size(batch_size, process_count), False)


def eval_batches(texts: Sequence[str], tokenizer, *, seq_len: int, batch_size: int,
                 n_batches: int) -> list[dict]:
  """The first ``n_batches`` packed batches of the held-out texts, in file order (fixed set)."""
  if not texts:
    return []
  ds = grain.MapDataset.source(list(texts)).map(encoder(tokenizer)).to_iter_dataset()
  out = []
  for batch in _pack(ds, seq_len, batch_size, False, drop_remainder=False):
    if batch["tokens"].shape[0] < batch_size:  # pad the last batch with empty rows
      pad = batch_size - batch["tokens"].shape[0]
      batch = {k: np.pad(v, ((0, pad), (0, 0))) for k, v in batch.items()}
    out.append(batch)
    if len(out) == n_batches:
      break
  return out


def records_dataset(records: Sequence[Any], to_example: Callable[[Any], dict], *, seq_len: int,
                    batch_size: int, seed: int = 0, process_index: int = 0,
                    process_count: int = 1) -> grain.IterDataset:
  """Packed batches from records mapped to ``{"tokens", "loss_mask"}`` (SFT trajectories).

  Unlike pretraining, examples are never split across rows (a continuation without its prompt
  would teach the wrong thing): each is truncated to ``seq_len`` and rows are filled first-fit.
  """
  ds = shard(grain.MapDataset.source(list(records)), process_index, process_count)

  def example(rec: Any) -> dict:
    ex = to_example(rec)
    return {k: np.asarray(ex[k][:seq_len], np.int32) for k in ("tokens", "loss_mask")}

  ds = ds.shuffle(seed=seed).repeat().map(example).to_iter_dataset()
  packed = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"tokens": seq_len, "loss_mask": seq_len}, num_packing_bins=4, seed=seed)
  bs = local_batch_size(batch_size, process_count)
  return packed.batch(bs, drop_remainder=True).map(_finish)

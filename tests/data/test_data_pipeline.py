"""Packing, masks, checkpointable iterator state, process sharding and the source mixture."""

from __future__ import annotations

import json

import numpy as np
import pytest

from composer_jax.data import pipeline, sources
from composer_jax.data.tokenizer import train_bpe


class CharTok:
  """A stand-in tokenizer (one id per character) so packing checks do not depend on BPE."""
  eos_id = 0

  def encode(self, text):
    return [ord(c) for c in text]


def test_target_mask_matches_loop():
  rng = np.random.default_rng(0)
  seg = np.sort(rng.integers(0, 4, size=(3, 17)), axis=1)
  mask = rng.integers(0, 2, size=seg.shape)
  got = pipeline.target_mask(seg, mask)
  want = np.zeros_like(seg)
  for b in range(seg.shape[0]):
    for t in range(1, seg.shape[1]):
      want[b, t] = int(seg[b, t] == seg[b, t - 1] and seg[b, t] > 0 and mask[b, t])
  np.testing.assert_array_equal(got, want)


def test_packing_rebuilds_the_stream_with_segments_and_positions():
  texts = ["abc", "defghij", "k", "lmnopqrstuvwxyz", "01234"]
  ds = pipeline.pretrain_dataset([texts], [1.0], CharTok(), seq_len=8, batch_size=2, seed=3)
  it = iter(ds)
  rows = np.concatenate([next(it)["tokens"] for _ in range(6)])
  batch = next(iter(ds))
  for k in pipeline.FEATURES:
    assert batch[k].shape == (2, 8) and batch[k].dtype == np.int32
  # Within a segment, positions count up from 0 and tokens are a contiguous piece of one document.
  docs = {t + "\0" for t in texts}
  for r in range(2):
    seg, pos, tok = batch["segment_ids"][r], batch["positions"][r], batch["tokens"][r]
    for s in np.unique(seg[seg > 0]):
      idx = np.where(seg == s)[0]
      np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))
      piece = "".join(chr(c) for c in tok[idx])
      assert any(piece in d for d in docs)
    np.testing.assert_array_equal(batch["loss_mask"][r], pipeline.target_mask(seg[None])[0])
  # Every document (with its EOS) appears in the packed stream within the first few epochs.
  stream = "".join(chr(c) for c in rows.reshape(-1))
  for t in texts:
    assert t + "\0" in stream or t[:8] in stream


def test_iterator_state_resumes_exactly_and_is_json():
  texts = [f"doc{i} " * (i % 5 + 1) for i in range(40)]
  ds = pipeline.pretrain_dataset([texts[:30], texts[30:]], [0.7, 0.3], CharTok(), seq_len=16,
                                 batch_size=4, seed=1)
  it = iter(ds)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(4)]
  it2 = iter(ds)
  it2.set_state(state)
  for w in want:
    got = next(it2)
    for k in pipeline.FEATURES:
      np.testing.assert_array_equal(got[k], w[k])


def test_processes_take_disjoint_halves_of_the_batch():
  texts = [f"{i:03d}" for i in range(50)]
  seen = []
  for p in range(2):
    ds = pipeline.pretrain_dataset([texts], [1.0], CharTok(), seq_len=4, batch_size=8, seed=0,
                                   process_index=p, process_count=2)
    b = next(iter(ds))
    assert b["tokens"].shape == (4, 4)
    rows = ["".join(chr(c) for c in r if c) for r in np.concatenate([next(iter(ds))["tokens"]])]
    seen.append({x for r in rows for x in r.split("\0") if len(x) == 3})
  assert seen[0] and seen[1] and not (seen[0] & seen[1])
  with pytest.raises(ValueError, match="divisible"):
    pipeline.local_batch_size(6, 4)


def test_mixture_follows_weights():
  a = [f"a{i}" for i in range(10)]
  b = [f"b{i}" for i in range(10)]
  import grain
  mix = pipeline.mixture([grain.MapDataset.source(a), grain.MapDataset.source(b)], [0.8, 0.2], 0)
  first = [mix[i][0] for i in range(500)]
  assert abs(first.count("a") / 500 - 0.8) < 0.02


def test_eval_batches_are_fixed_and_padded():
  texts = ["x" * 30, "y" * 7]
  out = pipeline.eval_batches(texts, CharTok(), seq_len=8, batch_size=4, n_batches=5)
  assert len(out) == 2 and out[-1]["tokens"].shape == (4, 8)
  total = sum(int((b["segment_ids"] > 0).sum()) for b in out)
  assert total == 31 + 8  # every character plus one EOS per document, nothing repeated
  again = pipeline.eval_batches(texts, CharTok(), seq_len=8, batch_size=4, n_batches=5)
  for x, y in zip(out, again):
    np.testing.assert_array_equal(x["tokens"], y["tokens"])


def test_heldout_split_by_content_hash(tmp_path):
  for i in range(40):
    (tmp_path / f"f{i}.txt").write_text(f"content {i % 20}\n")  # each content twice
  docs = sources.list_docs(str(tmp_path))
  assert docs == sources.list_docs(str(tmp_path))  # deterministic order
  train, held = sources.split_texts(sources.read_docs(docs), 0.3)
  assert held and train and not (set(train) & set(held))
  assert len(train) + len(held) == 40


def test_stdlib_source_is_python_and_deterministic():
  docs = sources.list_docs("stdlib", max_files=50)
  assert len(docs) == 50 and all(d.path.endswith(".py") for d in docs)
  assert all("site-packages" not in d.path for d in docs)
  assert docs == sources.list_docs("stdlib", max_files=50)


def test_jsonl_source_and_bad_path(tmp_path):
  p = tmp_path / "c.jsonl"
  p.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": "world"}) + "\n")
  assert [d.read() for d in sources.list_docs(str(p))] == ["hello", "world"]
  # The one-pass reader gives what reading each line on its own gives, across files and blank lines.
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": f"t{i}", "x": i}) if i % 3 else ""
                                              for i in range(30)) + "\n")
  docs = sources.list_docs(str(tmp_path))
  assert len(docs) == 2 + 20 and sources.read_docs(docs) == [d.read() for d in docs]
  assert sorted(sources.read_docs(docs)) == sorted(["hello", "world"] + [f"t{i}" for i in range(30) if i % 3])
  from composer_jax.config import ConfigError
  with pytest.raises(ConfigError, match="data.sources"):
    sources.list_docs(str(tmp_path / "missing"))


def test_real_tokenizer_in_the_pipeline():
  texts = [d.read() for d in sources.list_docs("stdlib", max_files=30)]
  tok = train_bpe(texts, 300)
  b = next(iter(pipeline.pretrain_dataset([texts], [1.0], tok, seq_len=64, batch_size=2)))
  assert b["tokens"].max() < tok.vocab_size


def test_repeats_source_is_deterministic_and_repeats_every_line():
  from composer_jax.data import repeats
  docs = repeats.documents(20, seed=3, units=2)
  assert docs == repeats.documents(20, seed=3, units=2) and docs != repeats.documents(20, seed=4, units=2)
  for doc in docs:
    units = doc.split("\n\n")
    assert len(units) == 2
    for u in units:
      lines = u.split("\n")
      assert 3 <= len(lines) <= 4 and len(set(lines)) == 1 and lines[0].strip()
  # Fresh lines: no line recurs across documents, so only the copy in front predicts it.
  firsts = [u.split("\n")[0] for d in docs for u in d.split("\n\n")]
  assert len(set(firsts)) == len(firsts)
  corpus = sources.load_corpus(["repeats"], [], heldout_fraction=0.1)
  assert len(corpus.train[0]) + len(corpus.heldout) == sources.GENERATED_DOCS and corpus.heldout


def test_code_repeats_copies_lines_of_the_stdlib_training_split_only():
  from composer_jax.data import repeats
  texts = [f"def f{i}(x):\n    return x + {i} * 1000\n# a comment line {i}\n" for i in range(30)]
  docs = repeats.code_documents(texts, 50, seed=1)
  assert docs == repeats.code_documents(texts, 50, seed=1) != repeats.code_documents(texts, 50, seed=2)
  known = {ln.strip() for t in texts for ln in t.splitlines()}
  for doc in docs:
    units = doc.split("\n\n")
    assert 1 <= len(units) <= 3
    for u in units:
      lines = u.split("\n")
      for k in (1, 2):  # a chunk of k lines written 2-3 times
        if len(lines) % k == 0 and 2 <= len(lines) // k <= 3 and lines == lines[:k] * (len(lines) // k):
          break
      else:
        raise AssertionError(f"not a repeated chunk: {u!r}")
      assert all(ln.strip() in known and ln[:4] in ("    ", ln.strip()[:4]) for ln in lines)
  with pytest.raises(ValueError, match="code_repeats"):
    repeats.code_documents(["x = 1"], 3)
  # In a corpus, its lines come from the stdlib's training split: none from a held-out file.
  corpus = sources.load_corpus(["stdlib", "code_repeats"], [], heldout_fraction=0.2, max_files=40)
  stdlib_held = sources.split_texts(sources.read_docs(sources.list_docs("stdlib", max_files=40)), 0.2)[1]
  train = {ln.strip() for t in corpus.train[0] for ln in t.splitlines()}
  only_held = {ln.strip() for t in stdlib_held for ln in t.splitlines()} - train
  copied = {ln.strip() for d in corpus.train[1] for ln in d.splitlines()}
  assert stdlib_held and only_held and copied and copied <= train

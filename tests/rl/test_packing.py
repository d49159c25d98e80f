"""Learner rows packed with several segments: the bin packing, the packed arrays, and teacher rows
(targeted feedback) landing where their student tokens went."""

from __future__ import annotations

import numpy as np
import pytest

from composer_jax.rl import learner as L


def test_first_fit_places_every_sequence_once_within_the_row():
  rng = np.random.default_rng(0)
  lengths = [int(x) for x in rng.integers(50, 1500, 40)]
  bins = L.first_fit(lengths, 2048)
  assert sorted(i for b in bins for i in b) == list(range(40))
  assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
  # First-fit decreasing is within 11/9 OPT + 1 bins; the sum of lengths bounds OPT from below.
  assert len(bins) <= 11 / 9 * -(-sum(lengths) // 2048) + 1
  assert L.first_fit(lengths, 2048) == bins  # a function of the lengths
  place = L.placements(bins, lengths)
  for row, b in enumerate(bins):
    starts = [place[i] for i in b]
    assert [s[0] for s in starts] == [row] * len(b)
    assert [s[1] for s in starts] == list(np.cumsum([0] + [lengths[i] for i in b])[:-1])
  with pytest.raises(ValueError, match="does not fit"):
    L.first_fit([10, 3000], 2048)


def _rows(lengths, n_moe=2, k=2):
  rng = np.random.default_rng(1)
  out = []
  for i, n in enumerate(lengths):
    mask = (rng.random(n) < 0.5).astype(np.float32)
    mask[0] = 0
    out.append(L.Row(tokens=rng.integers(1, 100, n).astype(np.int32),
                     experts=rng.integers(0, 8, (n, n_moe, k)).astype(np.int32), loss_mask=mask,
                     sampler_logp=-rng.random(n).astype(np.float32) * mask, advantage=float(i) - 1.5))
  return out


def test_packed_arrays_hold_each_segment_whole_with_its_own_ids_positions_and_advantage():
  lengths = [30, 12, 25, 7]
  rows = _rows(lengths)
  bins = L.first_fit(lengths, 40)  # [[0, 3], [2, 1]]
  assert bins == [[0, 3], [2, 1]]
  b = L.pack_rows(rows, 4, 40, 2, 2, pad_id=0, bins=bins)
  assert b["advantages"].shape == (4, 40)
  for (row, at), r, sid in zip(L.placements(bins, lengths), rows, [1, 2, 1, 2], strict=True):
    s = slice(at, at + len(r.tokens))
    np.testing.assert_array_equal(b["tokens"][row, s], r.tokens)
    np.testing.assert_array_equal(b["experts"][row, s], r.experts)
    np.testing.assert_array_equal(b["loss_mask"][row, s], r.loss_mask)
    np.testing.assert_array_equal(b["sampler_logp"][row, s], r.sampler_logp)
    np.testing.assert_array_equal(b["positions"][row, s], np.arange(len(r.tokens)))
    assert (b["segment_ids"][row, s] == sid).all() and (b["advantages"][row, s] == r.advantage).all()
  assert (b["segment_ids"][0, 37:] == 0).all() and (b["segment_ids"][2:] == 0).all()  # padding
  assert b["loss_mask"].sum() == sum(r.loss_mask.sum() for r in rows)
  with pytest.raises(ValueError, match="do not fit"):
    L.pack_rows(rows, 1, 40, 2, 2, pad_id=0, bins=bins)


def test_teacher_rows_land_on_the_packed_student_positions():
  """attach_teacher with the packing's placements writes what it writes unpacked, moved to the
  segment's row and offset."""
  lengths = [30, 12, 25, 7]
  rows = _rows(lengths)
  jobs = [L.TeacherJob(row=1, start=4, end=10, offset=3, tokens=None, experts=None, hint=None),
          L.TeacherJob(row=3, start=2, end=7, offset=5, tokens=None, experts=None, hint=None)]
  rng = np.random.default_rng(2)
  teacher = {"logp": rng.random((2, 16, 4)).astype(np.float32),
             "idx": rng.integers(0, 50, (2, 16, 4)).astype(np.int32),
             "tail_logp": rng.random((2, 16)).astype(np.float32)}
  flat = L.attach_teacher(L.pack_rows(rows, 4, 32, 2, 2, 0), jobs, teacher, 4)
  bins = L.first_fit(lengths, 40)
  place = L.placements(bins, lengths)
  packed = L.attach_teacher(L.pack_rows(rows, 4, 40, 2, 2, 0, bins), jobs, teacher, 4, place)
  for key in ("fb_mask", "fb_logp", "fb_idx", "fb_tail"):
    assert packed[key].sum() == pytest.approx(flat[key].sum())
    for i, n in enumerate(lengths):
      row, at = place[i]
      np.testing.assert_array_equal(packed[key][row, at:at + n], flat[key][i, :n])


def test_sft_rows_interleave_with_the_rl_rows_one_share_per_minibatch():
  """PPO-ptx: 4 RL rows and 2 SFT rows in 2 minibatches -> [rl0, rl1, sft0, rl2, rl3, sft1]; the SFT
  rows carry no policy-gradient token and their assistant mask; keys only the RL rows have (the
  feedback teacher's) are zero on the SFT rows."""
  rows = _rows([9, 8, 7, 6])
  rl = L.pack_rows(rows, 4, 12, 2, 2, 0)
  rl["fb_mask"] = np.ones((4, 12), np.float32)
  chats = [{"tokens": np.arange(1, 15, dtype=np.int32), "loss_mask": np.array([0] * 5 + [1] * 9)},
           {"tokens": np.arange(1, 6, dtype=np.int32), "loss_mask": np.array([0, 0, 1, 1, 0])}]
  sft = L.sft_rows(chats, 2, 12, 2, 2, 0)
  assert (sft["loss_mask"] == 0).all() and (sft["experts"] == -1).all()
  np.testing.assert_array_equal(sft["sft_mask"][0], [0] * 5 + [1] * 7)  # cut to the row length
  np.testing.assert_array_equal(sft["sft_mask"][1], [0, 0, 1, 1, 0] + [0] * 7)
  b = L.interleave(rl, sft, 2)
  assert b["tokens"].shape == (6, 12) and b["advantages"].shape == (6,)
  np.testing.assert_array_equal(b["tokens"][[0, 1, 3, 4]], rl["tokens"])
  np.testing.assert_array_equal(b["tokens"][[2, 5]], sft["tokens"])
  assert b["sft_mask"][[0, 1, 3, 4]].sum() == 0 and b["sft_mask"][[2, 5]].sum() == 9
  assert b["fb_mask"][[2, 5]].sum() == 0 and b["fb_mask"][[0, 1, 3, 4]].all()
  assert (b["advantages"][[2, 5]] == 0).all()
  with pytest.raises(ValueError, match="minibatches"):
    L.interleave(rl, sft, 4)

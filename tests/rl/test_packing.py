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

"""experiments/rl_heldout_paired: an evaluation under --out is reused only for the policy it was of."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from experiments import rl_heldout_paired as paired

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, name):
  run = tmp_path / name
  for stage in ("anneal", "rl"):
    (run / stage / "checkpoints" / "22").mkdir(parents=True)
    (run / stage / "checkpoints" / "22" / "w").write_bytes(name.encode())
  shutil.copy(os.path.join(ROOT, "configs", "tiny.yaml"), run / "config.yaml")
  return run


def test_a_stale_evaluation_of_another_run_is_refused_not_reused(tmp_path, monkeypatch):
  """The default --out was one /tmp folder, so scoring a second run on the same machine reused the
  first run's evaluations under the same names (it happened at stop 57, and printed the first run's
  figures as the second's)."""
  a, b = _run(tmp_path, "A"), _run(tmp_path, "B")
  sa, sb = paired.stamp(str(a / "rl"), [], 2), paired.stamp(str(b / "rl"), [], 2)
  assert sa["checkpoints"] != sb["checkpoints"] and sa != sb
  assert paired.stamp(str(a / "rl"), [], 2) == sa  # the same policy stamps alike
  assert paired.stamp(str(a / "rl"), ["rl.temperature=0.7"], 2) != sa
  out = tmp_path / "shared"
  for name, run in (("sft", a / "anneal"), ("rl", a / "rl")):
    (out / name).mkdir(parents=True)
    (out / name / "summary.json").write_text(json.dumps({"samples_per_task": 2}))
    (out / name / "stamp.json").write_text(json.dumps(paired.stamp(str(run), [], 2)))
  monkeypatch.setattr(sys, "argv", ["x", "--run", str(b), "--out", str(out)])
  with pytest.raises(SystemExit, match=r"holds an evaluation of .*/A/anneal.*not of .*/B/anneal"):
    paired.main()
  (out / "sft" / "stamp.json").unlink()  # an unstamped one (written before stamps) is refused too
  monkeypatch.setattr(sys, "argv", ["x", "--run", str(a), "--out", str(out)])
  with pytest.raises(SystemExit, match="unknown policy"):
    paired.main()

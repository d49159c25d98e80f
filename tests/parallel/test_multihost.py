"""The multi-host training path on a fake cluster: two processes (jax.distributed over gloo, 4 CPU
devices each) run one pretraining job over one 8-device mesh.

  * its losses equal a one-process run on the same 8-device mesh fed the same global batches
    (each process's slice of the data, concatenated in process order);
  * the run directory is written once (one metrics line per step, not one per process);
  * resuming from a checkpoint reproduces the uninterrupted losses bit for bit, which needs each
    process's own data-iterator state back (each packs different documents);
  * a checkpoint written by two processes is refused in one line by a run with one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.parallel.cluster import run_cluster
from tests.train.test_resume import ROOT, SMALL, _env, _losses

MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"]
STEPS = ["data.batch_size=8", "train.steps=4", "checkpoint.every=2", "train.eval_every=2"]


def _launch(out, *extra, n=2, stage="pretrain"):
  """``n`` processes of `composer-jax STAGE` forming one job; returns their (rc, output)."""
  return run_cluster([stage, os.path.join(ROOT, "configs/tiny.yaml"), "--out", str(out), *SMALL,
                      *MESH, *STEPS, *extra], n=n, env=_env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("multihost")
  a, b = base / "a", base / "b"
  for rc, text in _launch(a):
    assert rc == 0, text[-3000:]
  # b: a copy of a without its step-4 checkpoint, resumed from step 2 by two processes again.
  shutil.copytree(a, b)
  shutil.rmtree(b / "checkpoints" / "4")
  resumed = _launch(b, "--resume")
  for rc, text in resumed:
    assert rc == 0, text[-3000:]
  return a, b, resumed


@pytest.mark.slow
def test_two_processes_match_one_process_on_the_same_global_batches(runs):
  import jax

  from composer_jax.config import load_config
  from composer_jax.data import pipeline, sources
  from composer_jax.data.tokenizer import load_tokenizer
  from composer_jax.train.loop import build_trainer, init_state, put_batch
  a, _, _ = runs
  cfg = load_config(str(a / "config.yaml"))
  assert cfg.mesh.distributed and jax.process_count() == 1 and jax.device_count() == 8
  cfg.mesh.distributed = False
  d = cfg.data
  corpus = sources.load_corpus(d.sources, d.weights, heldout_fraction=d.heldout_fraction,
                               max_files=d.max_files, text_field=d.text_field)
  tok = load_tokenizer(str(a / "tokenizer.json"))
  its = [iter(pipeline.pretrain_dataset(corpus.train, corpus.weights, tok, seq_len=d.seq_len,
                                        batch_size=d.batch_size, seed=d.seed, process_index=i,
                                        process_count=2)) for i in (0, 1)]
  tr = build_trainer(cfg, materialize=False)
  init_state(tr)
  want = _losses(a)
  got = {}
  for step in range(1, 5):
    parts = [next(it) for it in its]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    tr.state, metrics = tr.step_fn(tr.state, put_batch(tr, batch))
    got[step] = float(metrics["loss"])
  # Same program, same data; only the cross-process all-reduce (gloo) may sum in another order.
  np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)],
                             rtol=2e-5)


@pytest.mark.slow
def test_the_run_directory_is_written_once(runs):
  a, _, _ = runs
  with open(a / "metrics.jsonl") as f:
    recs = [json.loads(line) for line in f]
  steps = [r["step"] for r in recs if "loss" in r]
  assert steps == [1, 2, 3, 4]
  assert [r["step"] for r in recs if "eval_bpb" in r] == [0, 2, 4]
  assert (a / "config.yaml").exists() and (a / "tokenizer.json").exists()
  assert sorted(int(n) for n in os.listdir(a / "checkpoints") if n.isdigit()) == [2, 4]
  with open(a / "checkpoints" / "4" / "data" / "metadata") as f:
    state = json.load(f)
  assert state["process_count"] == 2 and len(state["processes"]) == 2
  assert state["processes"][0] != state["processes"][1]  # each process packs its own documents


@pytest.mark.slow
def test_resume_on_two_processes_is_bit_identical(runs):
  a, b, resumed = runs
  assert all("resumed from" in text for _, text in resumed)
  la, lb = _losses(a), _losses(b)
  assert sorted(lb) == [1, 2, 3, 4]
  assert [lb[s] for s in (3, 4)] == [la[s] for s in (3, 4)]


@pytest.mark.slow
def test_one_process_refuses_a_two_process_checkpoint_in_one_line(runs, tmp_path):
  a, _, _ = runs
  c = tmp_path / "c"
  shutil.copytree(a, c)
  cmd = [sys.executable, "-m", "composer_jax.cli", "pretrain", os.path.join(ROOT, "configs/tiny.yaml"),
         "--out", str(c), "--cpu-devices", "8", *SMALL, "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2",
         "data.batch_size=8", "train.steps=6", "--resume"]
  p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, check=False)
  assert p.returncode != 0
  err = p.stderr.strip().splitlines()
  assert "saved by 2 process(es) and this run has 1" in err[-1], p.stderr[-2000:]
  assert "Traceback" not in p.stderr


@pytest.mark.parametrize("mesh,axes", [
    (["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"], r"mesh.data=2 x mesh.fsdp=2 x mesh.expert=2"),
    (["mesh.data=-1"], r"mesh.data=8"),  # one batch axis: the spec names it bare, not as a tuple
])
def test_a_batch_that_does_not_split_over_the_batch_axes_is_refused_in_one_line(mesh, axes):
  from composer_jax.config import ConfigError, load_config
  from composer_jax.train.loop import build_trainer, check_batch
  cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [*SMALL, *mesh, "data.batch_size=4"])
  tr = build_trainer(cfg, materialize=False)  # abstract: nothing compiled
  with pytest.raises(ConfigError, match=rf"data.batch_size=4 .* {axes}: .* multiple of 8"):
    check_batch(cfg, tr)
  ok = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [*SMALL, *mesh, "data.batch_size=8"])
  check_batch(ok, build_trainer(ok, materialize=False))


def test_bad_process_environment_is_refused_in_one_line(monkeypatch):
  from composer_jax.config import ConfigError, MeshConfig
  from composer_jax.parallel.mesh import maybe_initialize_distributed
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two' is not an integer"):
    maybe_initialize_distributed(MeshConfig(distributed=True))
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS is not"):
    maybe_initialize_distributed(MeshConfig(distributed=True))


@pytest.mark.slow
def test_sft_on_two_processes_starts_from_a_two_process_run(runs, tmp_path):
  a, _, _ = runs
  chats = [[{"role": "user", "content": f"add {i} and 2"},
            {"role": "assistant", "content": f"The answer is {i + 2}."}] for i in range(16)]
  path = tmp_path / "sft.jsonl"
  path.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
  out = tmp_path / "sft"
  for rc, text in _launch(out, "--init", str(a), f"data.sft_path={path}", "train.steps=2",
                          "checkpoint.every=0", stage="sft"):
    assert rc == 0, text[-3000:]
    assert "initialised weights from" in text
  assert sorted(_losses(out)) == [1, 2]
  with open(out / "checkpoints" / "2" / "data" / "metadata") as f:
    assert json.load(f)["process_count"] == 2

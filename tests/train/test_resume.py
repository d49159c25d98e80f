"""End to end: a pretrain run killed with SIGKILL and resumed reproduces the uninterrupted losses
bit for bit; the run directory holds everything the stage promises; the other stages start."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
    "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_dim=8", "model.qk_rope_dim=4",
    "model.v_head_dim=8", "model.n_routed_experts=4", "model.n_group=1", "model.topk_group=1",
    "model.moe_ffn_dim=16", "model.dense_ffn_dim=32", "model.max_seq_len=64", "data.seq_len=32",
    "data.batch_size=4", "data.max_files=60", "data.heldout_fraction=0.1", "data.tokenizer_train_mb=0.3", "train.steps=6",
    "train.eval_every=3", "train.eval_batches=1", "train.progress=false", "checkpoint.every=2",
    "rl.max_context=0",  # 0 = the model's (shrunk) length, whatever the YAML's rl section says
]


CACHE = {}


def _env():
  # One persistent compilation cache for all the runs here: later processes skip XLA compiles.
  cache = CACHE.setdefault("dir", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                               f"composer_jax_test_cache_{os.getuid()}"))
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT,
              JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _cmd(stage, out, *extra):
  return [sys.executable, "-m", "composer_jax.cli", stage, os.path.join(ROOT, "configs/tiny.yaml"),
          "--out", str(out), *SMALL, *extra]


def _losses(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("runs")
  a, b = base / "a", base / "b"
  # The uninterrupted run first (it fills the compilation cache), then the one to be killed.
  pa = subprocess.run(_cmd("pretrain", a), env=_env(), capture_output=True, text=True, check=False, timeout=600)
  assert pa.returncode == 0, pa.stderr[-2000:]
  pb = subprocess.Popen(_cmd("pretrain", b), env=_env(), stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
  deadline = time.time() + 600
  while time.time() < deadline and pb.poll() is None:
    # Once the step-2 checkpoint is committed, kill at whatever the run is doing (often mid-save).
    if (b / "checkpoints" / "2").is_dir() and max(_losses(b) or {0: 0}) >= 3:
      break
    time.sleep(0.02)
  assert pb.poll() is None, "the run to be killed finished before it could be killed"
  os.kill(pb.pid, signal.SIGKILL)
  pb.wait()
  killed_at = max(_losses(b))
  res = subprocess.run(_cmd("pretrain", b, "--resume"), env=_env(), capture_output=True, text=True, check=False,
                       timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  return a, b, killed_at, res.stdout + res.stderr


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(runs):
  a, b, killed_at, log = runs
  assert "resumed from" in log
  la, lb = _losses(a), _losses(b)
  assert sorted(la) == list(range(1, 7)) and sorted(lb) == list(range(1, 7))
  assert killed_at >= 3
  for step in range(1, 7):
    assert la[step] == lb[step], (step, la[step], lb[step])


@pytest.mark.slow
def test_run_directory_contents(runs):
  a = runs[0]
  for name in ("config.yaml", "tokenizer.json", "metrics.jsonl"):
    assert (a / name).exists()
  assert sorted(os.listdir(a / "checkpoints")) == ["4", "6"]  # keep=2
  assert any(n.startswith("events") for n in os.listdir(a / "tb"))
  assert (a / "plots" / "loss.png").stat().st_size > 1000
  with open(a / "metrics.jsonl") as f:
    recs = [json.loads(line) for line in f]
  evals = [r for r in recs if "eval_bpb" in r]
  assert [r["step"] for r in evals] == [0, 3, 6]
  steps = [r for r in recs if "loss" in r]
  assert all(k in steps[-1] for k in ("grad_norm", "lr", "tokens_per_s", "model_flops_per_s",
                                      "expert_max_violation", "mtp_ce"))


@pytest.mark.slow
def test_refuses_to_overwrite_checkpoints_without_resume(runs):
  a = runs[0]
  res = subprocess.run(_cmd("pretrain", a), env=_env(), capture_output=True, text=True, check=False, timeout=60)
  assert res.returncode == 2
  assert res.stderr.strip().count("\n") == 0 and "--resume" in res.stderr


@pytest.mark.slow
def test_resume_with_an_incompatible_config_stops_with_one_line(runs):
  """A config change that alters shapes is not 'no checkpoint yet': one line naming the array and
  the differing field, exit 2, and the run directory (config, checkpoints) left as it was."""
  a = runs[0]
  before = (a / "config.yaml").read_text(), sorted(os.listdir(a / "checkpoints"))
  res = subprocess.run(_cmd("pretrain", a, "--resume", "model.moe_ffn_dim=24"), env=_env(),
                       capture_output=True, text=True, check=False, timeout=300)
  assert res.returncode == 2, res.stderr[-2000:]
  err = res.stderr.strip()
  assert err.count("\n") == 0 and "does not fit this run" in err
  assert re.search(r"params\.layers\.1\.mlp\.\S+ is \[[\d, ]+\] float32 there, \[[\d, ]+\] float32 here", err)
  assert "model.moe_ffn_dim 16 there, 24 here" in err
  assert ((a / "config.yaml").read_text(), sorted(os.listdir(a / "checkpoints"))) == before


def test_extend_overrides_and_bad_sft_input(tmp_path):
  from composer_jax.train.cli import extend_overrides
  old = {"data": {"seq_len": 128}, "model": {"yarn_factor": 1.0}}
  assert extend_overrides(old, 512) == ["data.seq_len=512", "model.max_seq_len=512",
                                        "model.yarn_factor=4.0",
                                        "model.yarn_original_max_position=128"]
  again = {"data": {"seq_len": 512},
           "model": {"yarn_factor": 4.0, "yarn_original_max_position": 128}}
  assert extend_overrides(again, 1024, 16.0)[2:] == ["model.yarn_factor=16.0",
                                                     "model.yarn_original_max_position=128"]
  # By default the factor is relative to the original window: 1024 / 128 = 8 (not 1024 / 512).
  assert extend_overrides(again, 1024)[2] == "model.yarn_factor=8.0"
  from composer_jax.cli import main
  from composer_jax.config import ConfigError
  with pytest.raises(ConfigError, match="--seq-len"):
    extend_overrides(old, 64)
  (tmp_path / "ck" / "checkpoints" / "1").mkdir(parents=True)
  rc = main(["sft", os.path.join(ROOT, "configs/tiny.yaml"), "--out", str(tmp_path / "o"),
             "--init", str(tmp_path / "ck"), f"data.sft_path={tmp_path / 'missing.jsonl'}"])
  assert rc == 2


@pytest.mark.slow
def test_sft_and_extend_start_from_the_checkpoint(runs, tmp_path):
  a = runs[0]
  traj = [{"role": "user", "content": "add 1 and 2"},
          {"role": "assistant", "content": "",
           "tool_calls": [{"name": "python", "arguments": {"code": "print(1 + 2)"}}]},
          {"role": "tool", "tool_call_id": "functions.python:0", "content": "3"},
          {"role": "assistant", "content": "The answer is 3."}]
  path = tmp_path / "sft.jsonl"
  path.write_text("\n".join(json.dumps({"messages": traj}) for _ in range(4)) + "\n")
  sft = subprocess.run(_cmd("sft", tmp_path / "sft", "--init", str(a), f"data.sft_path={path}",
                            "train.steps=2", "checkpoint.every=0"),
                       env=_env(), capture_output=True, text=True, check=False, timeout=600)
  assert sft.returncode == 0, sft.stderr[-2000:]
  assert "initialised weights from" in sft.stdout
  assert len(_losses(tmp_path / "sft")) == 2
  keep = [o for o in SMALL if not o.startswith(("data.seq_len", "model.max_seq_len"))]
  ext = subprocess.run([*_cmd("extend", tmp_path / "ext")[:7], *keep, "--init",
                        str(a / "checkpoints" / "4"), "--seq-len", "64", "train.steps=1",
                        "checkpoint.every=0"],
                       env=_env(), capture_output=True, text=True, check=False, timeout=600)
  assert ext.returncode == 0, ext.stderr[-2000:]
  import yaml
  cfg = yaml.safe_load((tmp_path / "ext" / "config.yaml").read_text())
  assert cfg["data"]["seq_len"] == 64 and cfg["model"]["yarn_factor"] == 2.0
  assert cfg["model"]["yarn_original_max_position"] == 32

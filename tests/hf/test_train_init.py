"""HF weights into training and back: HF -> ``sft --init HF_DIR`` -> ``convert --to-hf RUN`` gives
back every tensor bit for bit when the step cannot move the weights (lr 1e-30, far below half
an ulp of every weight; no router-bias update),
and ``--init`` also takes a ``convert --from-hf`` folder."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

from composer_jax.cli import main
from composer_jax.data.tokenizer import train_bpe
from composer_jax.hf import save_pretrained
from tests.hf.helpers import hf_tensors, our_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 320  # 256 byte symbols + 12 chat special tokens + 35 tool-call tags + a few merges


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  base = tmp_path_factory.mktemp("hfinit")
  src = save_pretrained(our_model(seed=3, vocab_size=VOCAB, param_dtype="bfloat16",
                                  compute_dtype="bfloat16"), str(base / "hf"))
  texts = ["def add(a, b):\n  return a + b\n", "print(add(1, 2))\n"] * 20
  train_bpe(texts, VOCAB).save(os.path.join(src, "tokenizer.json"))
  traj = [{"role": "user", "content": "add 1 and 2"},
          {"role": "assistant", "content": "",
           "tool_calls": [{"name": "python", "arguments": {"code": "print(1 + 2)"}}]},
          {"role": "tool", "tool_call_id": "functions.python:0", "content": "3"},
          {"role": "assistant", "content": "The answer is 3."}]
  (base / "sft.jsonl").write_text("\n".join(json.dumps({"messages": traj}) for _ in range(4)) + "\n")
  return base, src


def _sft(base, init, out):
  return main(["sft", os.path.join(ROOT, "configs/tiny.yaml"), "--out", str(out), "--init", init,
               f"data.sft_path={base / 'sft.jsonl'}", "data.seq_len=32", "data.batch_size=2",
               "data.max_files=5", "data.heldout_fraction=0.0", "mesh.data=1", "train.steps=1",
               "train.progress=false", "checkpoint.every=0", "checkpoint.async_save=false",
               "optim.lr=1e-30", "optim.warmup_steps=0", "optim.qk_clip=0",
               "model.bias_update_rate=0.0", "rl.max_context=0"])


def test_hf_to_sft_to_hf_round_trip(hf_dir, capsys):
  base, src = hf_dir
  assert _sft(base, src, base / "run") == 0
  out = capsys.readouterr().out
  assert "model section from the checkpoint" in out and f"initialised weights from {src}" in out
  with open(base / "run" / "metrics.jsonl") as f:
    loss = json.loads(f.readline())["loss"]
  assert np.isfinite(loss) and loss > 0
  assert main(["convert", "--to-hf", str(base / "run"), "--out", str(base / "hf2")]) == 0
  a, b = hf_tensors(src), hf_tensors(str(base / "hf2"))
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_init_from_a_converted_folder_matches_hf_init(hf_dir, capsys):
  base, src = hf_dir
  assert main(["convert", "--from-hf", src, "--out", str(base / "conv")]) == 0
  # The converted folder has no tokenizer: the HF one goes into the run directory first.
  os.makedirs(base / "run_c", exist_ok=True)
  with open(os.path.join(src, "tokenizer.json")) as f, open(base / "run_c" / "tokenizer.json", "w") as g:
    g.write(f.read())
  assert _sft(base, str(base / "conv"), base / "run_c") == 0
  assert f"initialised weights from {base / 'conv' / 'params'}" in capsys.readouterr().out
  assert main(["convert", "--to-hf", str(base / "run_c"), "--out", str(base / "hf3")]) == 0
  a, b = hf_tensors(src), hf_tensors(str(base / "hf3"))
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_extend_from_an_hf_folder_reads_its_window(hf_dir):
  """extend --init HF_DIR: the old length is the checkpoint's max_position_embeddings (128), and an
  already-YaRN'd model (factor 4 over 32) extends relative to its original window: 256 / 32 = 8."""
  from composer_jax.train.cli import _init_run_config, extend_overrides
  old = _init_run_config(hf_dir[1])
  assert old["data"]["seq_len"] == 128
  assert extend_overrides(old, 256) == ["data.seq_len=256", "model.max_seq_len=256",
                                        "model.yarn_factor=8.0", "model.yarn_original_max_position=32"]


def _config_of(base: str, extra: list[str] = ()):
  """configs/tiny.yaml with the model section of the folder ``base`` (then ``extra``)."""
  from composer_jax.config import load_config
  from composer_jax.train.init import model_section
  model = model_section(base, "hf")
  return load_config(os.path.join(ROOT, "configs/tiny.yaml"),
                     [f"model.{k}={v}" for k, v in model.items() if not isinstance(v, (list, dict))]
                     + list(extra))


def test_run_base_is_checked_before_any_stage(hf_dir, tmp_path):
  """`run.base`: a missing folder or another architecture is one line naming the field, and the
  main job stops before it creates --out."""
  from composer_jax.config import ConfigError
  from composer_jax.train.init import check_base
  cfg = _config_of(hf_dir[1])
  assert check_base(hf_dir[1], cfg.model) == "hf"
  wide = _config_of(hf_dir[1], [f"model.d_model={cfg.model.d_model * 2}"])
  with pytest.raises(ConfigError, match=r"run.base=.* has model.d_model=\d+ .* set model.d_model="):
    check_base(hf_dir[1], wide.model)
  with pytest.raises(ConfigError, match=r"run.base='/nonexistent' does not exist"):
    check_base("/nonexistent", cfg.model)
  out = tmp_path / "job"
  assert main(["run", os.path.join(ROOT, "configs/tiny.yaml"), "--out", str(out),
               "run.base=/nonexistent"]) == 2
  assert not out.exists()


def test_shipped_tiny_base_fits_the_tiny_config():
  """configs/tiny.yaml's run.base: an HF folder of the tiny architecture in bfloat16 whose tokenizer
  has the model's vocabulary and holds every tool-call tag as one token."""
  from composer_jax.config import load_config
  from composer_jax.data.tokenizer import load_tokenizer, tool_tags
  from composer_jax.recipe import resolve_beside
  from composer_jax.train.init import check_base
  path = os.path.join(ROOT, "configs/tiny.yaml")
  cfg = load_config(path)
  base = resolve_beside(cfg.run.base, path)  # found from any working directory
  assert base == os.path.join(ROOT, "configs", "tiny-base")
  assert check_base(base, cfg.model) == "hf"
  with open(os.path.join(base, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  tok = load_tokenizer(os.path.join(base, "tokenizer.json"))
  assert tok.vocab_size == cfg.model.vocab_size
  assert [tok.encode(t) for t in tool_tags()] == [[i] for i in range(2048 - 35, 2048)]


def test_pretrain_stage_continues_from_run_base(hf_dir, tmp_path):
  """The main job's pretraining stage starts from `run.base`'s weights and tokenizer: one step at
  lr 1e-30 leaves every base tensor as it was."""
  from composer_jax.recipe import Recipe
  cfg = _config_of(hf_dir[1], [f"run.base={hf_dir[1]}", "mesh.data=1", "rl.max_context=0"])
  recipe = Recipe(cfg, str(tmp_path / "job"), log=lambda *a: None)
  recipe.stage("pretrain", lambda: recipe._train("pretrain", [
      "data.seq_len=32", "data.batch_size=2", "data.max_files=5", "train.steps=1",
      "train.eval_every=0", "train.progress=false", "checkpoint.every=0",
      "checkpoint.async_save=false", "optim.lr=1e-30", "optim.warmup_steps=0", "optim.qk_clip=0",
      "model.bias_update_rate=0.0"], cfg.run.base))
  job = tmp_path / "job"
  base_tok = os.path.join(hf_dir[1], "tokenizer.json")
  assert (job / "pretrain" / "tokenizer.json").read_bytes() == pathlib.Path(base_tok).read_bytes()
  # The stage's own run is a valid base too (read from its config.yaml), as is a step folder of it.
  from composer_jax.train.init import check_base
  assert check_base(str(job / "pretrain"), cfg.model) == "run"
  assert check_base(str(job / "pretrain" / "checkpoints" / "1"), cfg.model) == "run"
  assert main(["convert", "--to-hf", str(job / "pretrain"), "--out", str(tmp_path / "back")]) == 0
  want, got = hf_tensors(hf_dir[1]), hf_tensors(str(tmp_path / "back"))
  assert set(want) == set(got)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)

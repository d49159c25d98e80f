"""``composer-jax convert``: HF -> Orbax -> HF reproduces every tensor bit for bit."""

from __future__ import annotations

import json
import os

import numpy as np

from composer_jax.cli import main
from composer_jax.hf import save_pretrained
from tests.hf.helpers import hf_tensors, our_model


def test_convert_round_trip(tmp_path, capsys):
  src = save_pretrained(our_model(seed=5, param_dtype="bfloat16", compute_dtype="bfloat16"),
                        str(tmp_path / "hf"))
  assert main(["convert", "--from-hf", src, "--out", str(tmp_path / "orbax")]) == 0
  assert os.path.isdir(tmp_path / "orbax" / "params")
  assert main(["convert", "--to-hf", str(tmp_path / "orbax"), "--out", str(tmp_path / "hf2"),
               "--max-shard-gb", "0.00001"]) == 0
  assert os.path.exists(tmp_path / "hf2" / "model.safetensors.index.json")
  a, b = hf_tensors(src), hf_tensors(str(tmp_path / "hf2"))
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  with open(tmp_path / "hf2" / "config.json") as a, open(os.path.join(src, "config.json")) as b:
    assert json.load(a) == json.load(b)
  # The HF config.json can stand in for the YAML.
  assert main(["convert", "--to-hf", str(tmp_path / "orbax"), "--out", str(tmp_path / "hf3"),
               "--config", os.path.join(src, "config.json")]) == 0


def test_convert_bad_input(tmp_path, capsys):
  assert main(["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
  assert main(["convert", "--to-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 2 and "config.json" in err[0] and "params/" in err[1]


def test_to_hf_dtype_casts_the_parameters_not_the_router_biases(tmp_path, capsys):
  # A float32 model exported with --dtype bfloat16: every parameter is its float32 value rounded to
  # bfloat16 (what ml_dtypes rounds to, independently of jax), the selection biases stay float32, and
  # config.json says bfloat16.
  import ml_dtypes
  src = save_pretrained(our_model(seed=7), str(tmp_path / "hf"))
  assert main(["convert", "--from-hf", src, "--out", str(tmp_path / "orbax")]) == 0
  assert main(["convert", "--to-hf", str(tmp_path / "orbax"), "--out", str(tmp_path / "hf16"),
               "--dtype", "bfloat16"]) == 0
  a, b = hf_tensors(src), hf_tensors(str(tmp_path / "hf16"))
  assert a.keys() == b.keys()
  biases = [k for k in a if k.endswith("e_score_correction_bias")]
  assert biases
  for k in a:
    assert a[k].dtype == np.float32, k
    if k in biases:
      assert b[k].dtype == np.float32, k
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    else:
      assert b[k].dtype == ml_dtypes.bfloat16, k
      np.testing.assert_array_equal(a[k].astype(ml_dtypes.bfloat16), b[k], err_msg=k)
  with open(tmp_path / "hf16" / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"

"""``composer-jax params --sharding --seq-len``: Kimi K2.5's 256K stage planned with activations
(docs/long_context.md), on no devices."""

from __future__ import annotations

import re

from composer_jax.cli import main

# docs/long_context.md: 512 devices, expert 2 x context 32 x tensor 8, parameters over fsdp and
# context, full remat, one 256K sequence per batch shard per micro-step.
RULES = ("mesh.rules={embed: [fsdp, context], exp_embed: [fsdp, context], "
         "q_lora_up: [fsdp, context], kv_lora_up: [fsdp, context]}")
LAYOUT = ["--devices", "512", "--seq-len", "262144", "--budget-gb", "95", "mesh.fsdp=1",
          "mesh.expert=2", "mesh.context=32", "mesh.tensor=8", "train.grad_accum=32", RULES]


def _plan(capsys, *extra) -> tuple[str, dict]:
  assert main(["params", "configs/kimi-k2.5.yaml", "--sharding", *LAYOUT, *extra]) == 0
  out = capsys.readouterr().out
  last = out.strip().splitlines()[-1]
  gb = {k: float(v) for k, v in re.findall(r"(params|optimizer|gradients|activations|total) "
                                           r"([\d.]+) GB", last)}
  return out, {"line": last, **gb}


def test_k25_256k_fits_on_512_devices(capsys):
  out, got = _plan(capsys, "model.remat=full")
  assert "step: seq 262144, 1 sequence(s) per batch shard, 8192 tokens per device, remat full" in out
  assert got["line"].endswith("(expert=2 x context=32 x tensor=8): FITS"), got["line"]
  assert "on 512 devices" in got["line"]
  # the one line adds up (the optimizer update, after the backward, is below the activations)
  parts = got["params"] + got["optimizer"] + got["gradients"] + got["activations"]
  assert abs(parts - got["total"]) <= 0.2
  assert 60 < got["total"] <= 95 and got["activations"] > 30


def test_k25_default_remat_does_not_fit(capsys):
  """K2.5's own remat (dots_no_batch) saves each layer's K/V expansion, which under context
  parallelism covers the whole 256K sequence: 61 x 1.07 GB."""
  _, got = _plan(capsys)
  assert got["line"].endswith("DOES NOT FIT"), got["line"]
  assert got["total"] > 95


def test_bad_seq_len_is_one_line_before_tracing(capsys, monkeypatch):
  from composer_jax.train import plan

  def boom(cfg):
    raise AssertionError("traced the model before checking the shape")

  monkeypatch.setattr(plan, "abstract_model", boom)
  monkeypatch.setattr(plan, "_ABSTRACT", {})
  args = ["params", "configs/kimi-k2.5.yaml", "--sharding", *LAYOUT, "--seq-len", "262000"]
  assert main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  want = ("composer-jax: error: --seq-len=262000 must be divisible by 2*mesh.context=64 "
          "(zigzag context parallelism cuts each sequence into 2*context half-chunks)")
  assert err == [want]


def test_search_lists_fitting_layouts_first(capsys):
  assert main(["params", "configs/tiny.yaml", "--sharding", "--devices", "8", "--search",
               "--seq-len", "2048", "model.max_seq_len=2048", "--budget-gb", "0.5"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  rows = lines[1:-1]
  fits = [ln.endswith(" FITS") for ln in rows]
  assert fits == sorted(fits, reverse=True) and any(fits)
  assert all("expert=" in ln for ln in rows)  # MoE: an expert axis always
  assert re.fullmatch(r"\d+ of \d+ layouts fit \(GB = 1e9 bytes\)", lines[-1])

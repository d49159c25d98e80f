"""Config loading, overrides and one-line validation errors."""

import subprocess
import sys

import pytest

from composer_jax.config import ConfigError, load_config

PRESETS = ["tiny", "bench", "kimi-k2", "kimi-k2.5", "deepseek-v3"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load(name):
  cfg = load_config(f"configs/{name}.yaml")
  assert cfg.model.n_layers > cfg.model.n_dense_layers >= 1


def test_tiny_exercises_every_module():
  m = load_config("configs/tiny.yaml").model
  assert m.n_dense_layers >= 1 and m.n_moe_layers >= 2 and m.n_routed_experts >= 8
  assert m.n_shared_experts >= 1 and m.n_group > 1 and m.mtp_depths == 1


def test_base_include_and_overrides():
  cfg = load_config("configs/kimi-k2.5.yaml", ["model.n_layers=4", "optim.lr=1e-3", "data.sources=[a, b]"])
  assert cfg.model.yarn_factor == 64.0 and cfg.model.d_model == 7168  # from the base file
  assert cfg.model.n_layers == 4 and cfg.optim.lr == 1e-3 and cfg.data.sources == ["a", "b"]


@pytest.mark.parametrize("override,field", [
    ("model.n_layerz=3", "model.n_layerz"),
    ("model.n_layers=abc", "model.n_layers"),
    ("model.n_experts_per_tok=99", "model.n_experts_per_tok"),
    ("mesh.expert=3", "mesh.expert"),
    ("model.n_group=3", "model.n_group"),
    ("model.topk_group=9", "model.topk_group"),
    ("model.qk_rope_dim=7", "model.qk_rope_dim"),
    ("data.seq_len=100000", "data.seq_len"),
    ("model.scoring=relu", "model.scoring"),
    ("mesh.data=-1", "mesh"),
    ("model.gmm_precision=fp8_block", "model.gmm_precision"),
    ("data.sft_copy_share=1.0", "data.sft_copy_share"),
    ("data.sft_spec_share=-0.1", "data.sft_spec_share"),
    ("data.sft_spec_share=1.0", "data.sft_copy_share"),
    ("data.sft_word_share=-0.5", "data.sft_word_share"),
    ("data.sft_word_share=1.0", "data.sft_word_share"),
    ("rl.prefill_rows=-1", "rl.prefill_rows"),
    ("rl.dynamic_by=accuracy", "rl.dynamic_by"),
    ("run.rl_tasks=-1", "run.rl_tasks"),
    ("run.expert_recover=1.5", "run.expert_recover"),
    ("rl.curriculum=hard", "rl.curriculum"),
    ("rl.curriculum_decay=1.0", "rl.curriculum_decay"),
    ("rl.pack_length=-1", "rl.pack_length"),
    ("rl.sft_mix_coef=-0.1", "rl.sft_mix_coef"),
    ("rl.adv_negative_weight=-0.5", "rl.adv_negative_weight"),
    ("rl.sft_mix_coef=0.1", "rl.sft_mix_path"),
    ("rl.expert_demo_rows=2", "rl.sft_mix_coef"),  # the demonstrations are SFT-mix rows
    ("rl.expert_demo_rows=-1", "rl.expert_demo_rows"),
    ("rl.expert_demo_on=failed", "rl.expert_demo_on"),
    ("rl.entropy_coef=-1.5", "rl.entropy_coef"),
    ("rl.entropy_coef=nan", "rl.entropy_coef"),
])
def test_bad_values_name_the_field(override, field):
  over = [override] + (["mesh.fsdp=-1"] if override == "mesh.data=-1" else [])
  with pytest.raises(ConfigError) as e:
    load_config("configs/tiny.yaml", over)
  msg = str(e.value)
  assert field in msg and "\n" not in msg


def test_cli_prints_one_line_and_exit_2():
  r = subprocess.run([sys.executable, "-m", "composer_jax.cli", "params", "configs/tiny.yaml",
                      "model.n_experts_per_tok=99"], check=False, capture_output=True, text=True)
  assert r.returncode == 2
  assert r.stderr.strip().count("\n") == 0 and "model.n_experts_per_tok" in r.stderr
  assert "Traceback" not in r.stderr


def test_every_command_uses_a_persistent_compilation_cache(tmp_path):
  """composer-jax turns on JAX's persistent compilation cache under $XDG_CACHE_HOME (a set
  JAX_COMPILATION_CACHE_DIR wins, '' turns it off); the environment variables reach jax because the
  command line imports it only in the handlers."""
  import os

  from composer_jax.cli import compile_cache_env
  env = {"XDG_CACHE_HOME": str(tmp_path)}
  compile_cache_env(env)
  cache = env["JAX_COMPILATION_CACHE_DIR"]
  assert os.path.dirname(cache) == str(tmp_path / "composer_jax" / "xla")
  assert os.path.basename(cache).startswith("jaxlib-")  # one folder per jaxlib and host CPU
  assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
  mine = {"JAX_COMPILATION_CACHE_DIR": "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
  compile_cache_env(mine)
  assert mine == {"JAX_COMPILATION_CACHE_DIR": "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
  code = ("import sys; from composer_jax.cli import main; rc = main(sys.argv[1:]); import jax; "
          "print(jax.config.jax_compilation_cache_dir)")
  clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  r = subprocess.run([sys.executable, "-c", code, "params", "configs/tiny.yaml"], check=True,
                     capture_output=True, text=True, env={**clean, "XDG_CACHE_HOME": str(tmp_path)})
  assert r.stdout.strip().splitlines()[-1] == cache

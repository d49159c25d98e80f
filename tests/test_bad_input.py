"""Bad input stops in one line naming the field and the fix, before anything compiles or is written:
config values the stages would choke on minutes in, config files, --out / --init / --resume folders."""

from __future__ import annotations

import os

import pytest

from composer_jax.cli import main
from composer_jax.config import ConfigError, dump_config, load_config
from composer_jax.config_check import check_out

TINY = "configs/tiny.yaml"


def _one_line(e) -> str:
  msg = str(e.value)
  assert msg and "\n" not in msg, msg
  return msg


@pytest.mark.parametrize("override,field", [
    ("train.log_every=0", "train.log_every"),  # divided by at the first step, after the compile
    ("train.eval_every=-1", "train.eval_every"),
    ("checkpoint.every=-1", "checkpoint.every"),
    ("optim.eps=-1", "optim.eps"),
    ("optim.lr=inf", "optim.lr"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("optim.clip_norm=-1", "optim.clip_norm"),
    ("optim.muon_momentum=1.5", "optim.muon_momentum"),
    ("optim.muon_ns_steps=0", "optim.muon_ns_steps"),
    ("data.sources=[]", "data.sources"),
    ("data.weights=[a]", "data.weights"),
    ("data.weights=[-1]", "data.weights"),
    ("data.weights=[0]", "data.weights"),
    ("data.tokenizer_vocab_size=10", "data.tokenizer_vocab_size"),
    ("data.tokenizer_vocab_size=4096", "data.tokenizer_vocab_size"),  # above model.vocab_size
    ("data.num_workers=-1", "data.num_workers"),
    ("model.rope_theta=0", "model.rope_theta"),
    ("model.init_std=-1", "model.init_std"),
    ("model.n_shared_experts=-1", "model.n_shared_experts"),
    ("model.attention_rows=-1", "model.attention_rows"),
    ("model.routed_scaling_factor=0", "model.routed_scaling_factor"),
    ("rl.max_context=-1", "rl.max_context"),  # was blamed on rl.summary_trigger_tokens
    ("run.train_templates=foo", "run.train_templates"),  # failed at the tasks stage, after pretraining
    ("run.train_templates=", "run.train_templates"),
    ("run.train_templates=implement,rename", "run.train_templates"),  # a held-out template
    ("run.unseen_templates=implement", "run.unseen_templates"),
])
def test_bad_values_name_the_field(override, field):
  with pytest.raises(ConfigError) as e:
    load_config(TINY, [override])
  assert field in _one_line(e)


def test_good_neighbours_still_load():
  cfg = load_config(TINY, ["optim.clip_norm=0", "data.tokenizer_vocab_size=2048", "model.attention_rows=0",
                           "run.train_templates=implement", "run.unseen_templates=rename", "train.steps=0"])
  assert cfg.optim.clip_norm == 0 and cfg.data.tokenizer_vocab_size == 2048 and cfg.train.steps == 0


def test_config_files_that_are_empty_or_a_folder(tmp_path):
  empty = tmp_path / "empty.yaml"
  empty.write_text("# only a comment\n")
  with pytest.raises(ConfigError) as e:
    load_config(str(empty))
  assert "is empty" in _one_line(e)
  with pytest.raises(ConfigError) as e:
    load_config(str(tmp_path))
  assert "is a directory" in _one_line(e)


@pytest.mark.parametrize("cmd", ["sft", "rl"])
def test_an_init_run_of_other_arrays_is_refused_before_anything_is_written(tmp_path, capsys, cmd):
  run = tmp_path / "run"
  (run / "checkpoints" / "5").mkdir(parents=True)
  dump_config(load_config(TINY, ["model.d_model=64"]), str(run / "config.yaml"))
  before = sorted(os.walk(tmp_path))
  assert main([cmd, TINY, "--out", str(tmp_path / "new"), "--init", str(run)]) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and "model.d_model=64" in err and "--init" in err, err
  assert sorted(os.walk(tmp_path)) == before
  # a field that changes the function, not the arrays, may change on purpose
  from composer_jax.train.init import check_run_init_model
  check_run_init_model(str(run), load_config(TINY, ["model.d_model=64", "model.rope_theta=50000"]).model)


def test_pass_at_k_beyond_the_rl_runs_closing_samples():
  with pytest.raises(ConfigError) as e:
    load_config(TINY, ["rl.eval_tasks=held", "eval.k=[1,4]", "eval.samples=2"])
  assert "eval.k=[1, 4]" in _one_line(e) and "eval.samples=2" in str(e.value)
  assert load_config(TINY, ["eval.k=[1,4]", "eval.samples=2"]).eval.k == [1, 4]  # no closing eval


def test_an_override_with_an_empty_name_between_dots():
  with pytest.raises(ConfigError) as e:
    load_config(TINY, ["rl..steps=3"])
  assert "'rl..steps'" in _one_line(e) and "did you mean" not in str(e.value)


def test_out_folders(tmp_path):
  check_out(str(tmp_path / "new"))
  check_out(str(tmp_path))  # empty
  (tmp_path / "f").write_text("x")
  with pytest.raises(ConfigError) as e:
    check_out(str(tmp_path / "f"))
  assert "is a file" in _one_line(e)
  other = tmp_path / "notes"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  with pytest.raises(ConfigError) as e:
    check_out(str(other))
  assert "holds files but no run" in _one_line(e)
  check_out(str(other), runs=False)  # eval --out: its own files beside others are fine
  base = tmp_path / "base"  # an HF folder: its tokenizer.json is not a run's
  base.mkdir()
  (base / "config.json").write_text("{}")
  (base / "tokenizer.json").write_text("{}")
  with pytest.raises(ConfigError) as e:
    check_out(str(base))
  assert "checkpoint folder" in _one_line(e)
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  check_out(str(run))


def test_run_init_needs_a_checkpoint_step(tmp_path):
  from composer_jax.train.init import check_run_init
  with pytest.raises(ConfigError) as e:
    check_run_init(str(tmp_path / "missing"))
  assert "--init" in _one_line(e)
  with pytest.raises(ConfigError) as e:
    check_run_init(str(tmp_path))
  assert "not a run directory" in _one_line(e)
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(ConfigError) as e:
    check_run_init(str(tmp_path))
  assert "no checkpoint step" in _one_line(e)
  (tmp_path / "checkpoints" / "30").mkdir()
  check_run_init(str(tmp_path))
  check_run_init(str(tmp_path / "checkpoints" / "30"))


def test_the_main_job_out_and_resume(tmp_path):
  from composer_jax.recipe import check_run_out
  cfg = load_config(TINY)
  check_run_out(cfg, str(tmp_path), resume=False)  # empty: fine
  (tmp_path / "x").write_text("x")
  with pytest.raises(ConfigError) as e:
    check_run_out(cfg, str(tmp_path), resume=False)
  assert "pass --resume" in _one_line(e)
  with pytest.raises(ConfigError) as e:
    check_run_out(cfg, str(tmp_path), resume=True)  # not a run of `composer-jax run`
  assert "no config.yaml" in _one_line(e)
  dump_config(load_config(TINY, ["model.d_model=64"]), str(tmp_path / "config.yaml"))
  with pytest.raises(ConfigError) as e:
    check_run_out(cfg, str(tmp_path), resume=True)
  assert "model.d_model=64" in _one_line(e)
  dump_config(load_config(TINY, ["rl.steps=5"]), str(tmp_path / "config.yaml"))
  check_run_out(cfg, str(tmp_path), resume=True)  # a later stage's overrides may change


def test_the_main_job_names_the_stage_list_and_holds_stages_to_one_model():
  from composer_jax.recipe import check_stage_models, checked_stage
  cfg = load_config(TINY)
  with pytest.raises(ConfigError) as e:
    checked_stage(cfg, "rl_overrides", ["rl.stepz=1"])
  assert _one_line(e).startswith("run.rl_overrides: rl.stepz")
  pre = checked_stage(cfg, "pretrain_overrides", ["model.d_model=64"])
  with pytest.raises(ConfigError) as e:
    check_stage_models({"pretrain_overrides": pre, "sft_overrides": cfg})
  assert _one_line(e).startswith("run.sft_overrides: model.d_model=128")
  check_stage_models({"pretrain_overrides": cfg, "sft_overrides": checked_stage(
      cfg, "sft_overrides", ["data.seq_len=1280"])})


def test_a_model_too_small_to_train_a_tokenizer_stops_before_the_corpus(tmp_path):
  from composer_jax.train.loop import get_tokenizer
  cfg = load_config(TINY, ["model.vocab_size=100"])
  with pytest.raises(ConfigError) as e:
    get_tokenizer(cfg, str(tmp_path), lambda: pytest.fail("the corpus must not be read"))
  assert "model.vocab_size=100" in _one_line(e)


@pytest.mark.parametrize("argv,field", [
    (["run", TINY, "--out", "{file}"], "is a file"),
    (["run", TINY, "--out", "{other}", "--resume"], "no config.yaml"),
    (["pretrain", TINY, "--out", "{file}"], "is a file"),
    (["pretrain", TINY, "--out", "{other}", "--resume"], "holds files but no run"),
    (["pretrain", TINY, "--out", "{new}", "--cpu-devices", "-2"], "--cpu-devices"),
    (["pretrain", TINY, "--out", "{new}", "--init", "{ckpts}"], "no checkpoint step"),
    (["sft", TINY, "--out", "{new}", "--init", "configs/tiny-base", "data.sft_path={other}"], "data.sft_path"),
    (["extend", TINY, "--out", "{new}", "--init", "{new}", "--seq-len", "256"], "not a run"),
    (["rl", TINY, "--out", "{new}", "--init", "configs/tiny-base"], "not a run directory"),
    (["eval", "--tasks", "{other}", "--policy", "oracle", "--out", "{file}"], "is a file"),
    (["eval", "--tasks", "{other}", "--policy", "oracle", "--out", "{new}", "--samples", "2",
      "--set", "eval.k=[1,4]"], "pass@4"),  # was left out of the summary without a word
    (["tasks", "generate", "--synthetic", "2", "--out", "{file}"], "is a file"),
    (["tasks", "generate", "--repo", "{other}", "--out", "{file}"], "is a file"),
])
def test_commands_refuse_bad_folders_in_one_line_and_write_nothing(tmp_path, capsys, argv, field):
  paths = {"file": tmp_path / "f", "other": tmp_path / "notes", "new": tmp_path / "new",
           "ckpts": tmp_path / "run"}
  paths["file"].write_text("x")
  paths["other"].mkdir()
  (paths["other"] / "notes.txt").write_text("mine")
  (paths["ckpts"] / "checkpoints").mkdir(parents=True)
  before = sorted(os.walk(tmp_path))
  assert main([a.format(**{k: str(v) for k, v in paths.items()}) for a in argv]) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and field in err, err
  assert sorted(os.walk(tmp_path)) == before  # nothing written

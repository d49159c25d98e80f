"""String fields take the text as written (YAML 1.1 reads off/yes/no as booleans), in files and in
``key=value`` overrides alike; typed fields still follow the YAML 1.2 core schema."""

from __future__ import annotations

import pytest

from composer_jax.config import ConfigError, load_config


@pytest.mark.parametrize("text", ["off", "yes", "no", "on", "null", "2001-01-01", "1:30", "0x10"])
def test_string_field_keeps_text_in_both_styles(tmp_path, text):
  over = load_config(None, [f"env.cache_dir={text}"])
  path = tmp_path / "c.yaml"
  path.write_text(f"env:\n  cache_dir: {text}\n")
  assert over.env.cache_dir == text and load_config(str(path)).env.cache_dir == text


def test_literal_off_both_styles(tmp_path):
  assert load_config(None, ["env.sandbox=off"]).env.sandbox == "off"
  path = tmp_path / "c.yaml"
  path.write_text("env:\n  sandbox: off\n")
  assert load_config(str(path)).env.sandbox == "off"
  with pytest.raises(ConfigError, match="env.sandbox='of' is not allowed"):
    load_config(None, ["env.sandbox=of"])


def test_typed_fields_follow_yaml_1_2(tmp_path):
  cfg = load_config(None, ["optim.lr=1e-3", "env.verbose_prompt=true", "env.max_turns=0x10",
                           "data.sources=[a, off, 'x: y']", "eval.k=[1, 5]", "env.cache_dir='q'"])
  assert cfg.optim.lr == 1e-3 and cfg.env.verbose_prompt is True and cfg.env.max_turns == 16
  assert cfg.data.sources == ["a", "off", "x: y"] and cfg.eval.k == [1, 5] and cfg.env.cache_dir == "q"
  with pytest.raises(ConfigError, match="env.verbose_prompt='off' must be true or false"):
    load_config(None, ["env.verbose_prompt=off"])
  # a value that is not valid YAML is fine for a string field and one line for any other
  assert load_config(None, ["env.cache_dir=[a"]).env.cache_dir == "[a"
  with pytest.raises(ConfigError, match="data.sources"):
    load_config(None, ["data.sources=[a"])
  # text as written also for values YAML would read as a mapping
  assert load_config(None, ["env.cache_dir=a: b"]).env.cache_dir == "a: b"

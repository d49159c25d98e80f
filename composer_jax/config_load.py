"""Reading a config: YAML files (with ``base`` includes) and ``key=value`` overrides, typed by the
dataclass fields of ``composer_jax.config`` they land in.

Plain scalars stay text until a field's annotation types them (YAML 1.2 core schema: only true/false
are booleans, so ``env.sandbox=off`` stays "off"); any mismatch raises ``ConfigError``, one line
naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
  """A bad configuration value; the message is one line naming the field and the fix."""


class _Text(str):
  """A plain (unquoted) YAML scalar kept as written: the field it lands in decides its type, so a
  string field gets the text itself (``env.sandbox=off`` stays "off", not YAML 1.1's False)."""
  parsed: Any = None  # an override's value read as YAML (set when it is not a plain scalar)
  error: str = ""  # an override that is not valid YAML (fine for a string field)


class _TextLoader(yaml.SafeLoader):
  """SafeLoader that resolves no plain scalar: each stays a ``_Text`` until ``_coerce`` types it."""


_TextLoader.yaml_implicit_resolvers = {}
_TextLoader.add_constructor(
    "tag:yaml.org,2002:str",
    lambda loader, node: _Text(node.value) if node.style is None else loader.construct_scalar(node))

# YAML 1.2 core schema: only true/false are booleans (no yes/no/on/off), no dates or sexagesimals.
_NULL = re.compile(r"~|null|Null|NULL|")
_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_INT = re.compile(r"[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)"
                    r"|\.(nan|NaN|NAN)")


def _typed(value: Any, name: str = "") -> Any:
  """Resolve ``_Text`` scalars (inside lists and mappings too) by the YAML 1.2 core schema."""
  if isinstance(value, _Text):
    if value.error:
      raise ConfigError(f"{name}={str(value)!r} is not valid YAML ({value.error}); quote it or fix it")
    if value.parsed is not None:
      return _typed(value.parsed, name)
    text = str(value)
    if _NULL.fullmatch(text):
      return None
    if text in _BOOL:
      return _BOOL[text]
    if _INT.fullmatch(text):
      return int(text, 0) if text[:2] in ("0o", "0x") else int(text)
    if _FLOAT.fullmatch(text):
      return float(text.replace(".inf", "inf").replace(".Inf", "inf").replace(".INF", "inf")
                   .replace(".nan", "nan").replace(".NaN", "nan").replace(".NAN", "nan"))
    return text
  if isinstance(value, list):
    return [_typed(v, name) for v in value]
  if isinstance(value, dict):
    return {_typed(k, name): _typed(v, name) for k, v in value.items()}
  return value


def _takes_text(tp: Any) -> bool:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return all(isinstance(a, str) for a in typing.get_args(tp))
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return len(args) == 1 and _takes_text(args[0])
  return tp is str


def _load_yaml(text) -> Any:
  return yaml.load(text, Loader=_TextLoader)  # a SafeLoader subclass: safe


def _coerce(value: Any, tp: Any, name: str) -> Any:
  """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
  if isinstance(value, _Text) and _takes_text(tp):
    nullable = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if nullable and value.parsed is None and not value.error and _NULL.fullmatch(str(value)):
      return None
    # an override that YAML reads as a quoted string keeps the string; anything else the text
    value = value.parsed if isinstance(value.parsed, str) else str(value)
  else:
    value = _typed(value, name)
  origin = typing.get_origin(tp)
  if origin is Literal:
    if value not in typing.get_args(tp):
      raise ConfigError(f"{name}={value!r} is not allowed: choose one of {list(typing.get_args(tp))}")
    return value
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
      return None
    return _coerce(value, args[0], name)
  if tp is float:
    if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
      try:
        value = float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{name}={value!r} must be a number")
    return float(value)
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{name}={value!r} must be an integer")
    return value
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{name}={value!r} must be true or false")
    return value
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{name}={value!r} must be a string")
    return value
  if tp is list or origin is list:
    if isinstance(value, (str, int, float)):
      value = [value]
    if not isinstance(value, list):
      raise ConfigError(f"{name}={value!r} must be a list")
    return value
  if tp is dict or origin is dict:
    if not isinstance(value, dict):
      raise ConfigError(f"{name}={value!r} must be a mapping")
    return value
  return value


def build(cls, data: dict, prefix: str = ""):
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  if "async" in data and "async_" in names:  # `async` is a Python keyword: the field is `async_`
    data = {("async_" if k == "async" else k): v for k, v in data.items()}
  for key in data:
    if key not in names:
      close = [n for n in names if n.startswith(key[:3])]
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise ConfigError(f"{prefix}{key}: unknown key{hint}; remove it or fix its spelling")
  kwargs = {}
  for f in dataclasses.fields(cls):
    if f.name not in data:
      continue
    tp = hints[f.name]
    if dataclasses.is_dataclass(tp):
      sub = data[f.name] or {}
      if not isinstance(sub, dict):
        raise ConfigError(f"{prefix}{f.name} must be a mapping of its fields")
      kwargs[f.name] = build(tp, sub, f"{prefix}{f.name}.")
    else:
      kwargs[f.name] = _coerce(data[f.name], tp, f"{prefix}{f.name}")
  return cls(**kwargs)


def _deep_merge(base: dict, over: dict) -> dict:
  out = dict(base)
  for k, v in over.items():
    if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "rules":
      out[k] = _deep_merge(out[k], v)
    else:
      out[k] = v
  return out


def read_yaml(path: str, seen: tuple = ()) -> dict:
  if not os.path.exists(path):
    raise ConfigError(f"config file {path!r} does not exist: pass a path such as configs/tiny.yaml")
  if os.path.isdir(path):
    raise ConfigError(f"config file {path!r} is a directory: pass a YAML file such as configs/tiny.yaml")
  if path in seen:
    raise ConfigError(f"{path}: 'base' includes itself")
  with open(path) as f:
    try:
      data = _load_yaml(f)
    except yaml.YAMLError as e:
      raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
  if data is None:  # an empty file would run every default (a stray or truncated path)
    raise ConfigError(f"{path}: the file is empty: give at least one section, e.g. 'base: tiny.yaml'")
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: the top level must be a mapping of sections")
  base = data.pop("base", None)
  if base:
    base_path = os.path.join(os.path.dirname(path), base)
    data = _deep_merge(read_yaml(base_path, seen + (path,)), data)
  return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
  """Apply ``section.key=value`` strings (values parsed as YAML scalars / lists)."""
  data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like section.key=value (e.g. model.n_layers=4)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2:
      raise ConfigError(f"override {key!r} must name a section and a key, e.g. train.steps=10")
    if not all(parts):
      raise ConfigError(f"override {key!r} has an empty name between dots: write section.key=value, "
                        "e.g. train.steps=10")
    value = _Text(raw.strip())
    try:  # a plain scalar stays text; a list, mapping or quoted string is kept as read
      loaded = _load_yaml(raw) if raw.strip() else value
    except yaml.YAMLError as e:
      value.error = str(e).splitlines()[0]
    else:
      if not isinstance(loaded, _Text):
        value.parsed = loaded
    node = data
    for p in parts[:-1]:
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ConfigError(f"override {key!r}: {p} is not a section")
    node[parts[-1]] = value
  return data

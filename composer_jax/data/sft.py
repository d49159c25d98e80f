"""SFT data: JSONL chat trajectories with tool calls and tool results, trained on assistant tokens.

Each line is ``{"messages": [...]}`` (or a bare message list) in the format of
``composer_jax.data.chat`` — the same records the RL agent writes for its trajectories.
"""

from __future__ import annotations

import json
import os

import numpy as np

from composer_jax.config import ConfigError
from composer_jax.data import chat


def read_trajectories(path: str) -> list[list[dict]]:
  if not path or not os.path.exists(path):
    raise ConfigError(f"data.sft_path={path!r} does not exist: give a JSONL file of chat trajectories")
  out = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"data.sft_path: line {i + 1} of {path} is not JSON ({e.msg})") from None
      msgs = rec.get("messages") if isinstance(rec, dict) else rec
      if not isinstance(msgs, list) or not msgs:
        raise ConfigError(f"data.sft_path: line {i + 1} of {path} needs a non-empty 'messages' list")
      try:
        chat.render_segments(msgs)
      except chat.ChatFormatError as e:
        raise ConfigError(f"data.sft_path: line {i + 1} of {path}: {e}") from None
      out.append(msgs)
  if not out:
    raise ConfigError(f"data.sft_path: {path} holds no trajectories")
  return out


def encode_chat(messages: list[dict], tokenizer) -> dict:
  """Token ids and a mask that is 1 on the tokens the assistant produced (``chat.encode_segments``)."""
  ids, mask = chat.encode_segments(messages, tokenizer)
  return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def with_drills(trajs: list[list[dict]], share: float, texts: list[str], seed: int = 0,
                spec_share: float = 0.0, word_share: float = 0.0,
                spec_levels: tuple = (2, 3)) -> list[list[dict]]:
  """``trajs`` plus generated drills (``data/drills.py``): edit drills from ``texts`` as ``share`` of
  the chats, spec drills (at ``spec_levels``) as ``spec_share`` and word drills (names from
  ``texts``) as ``word_share``; they take the trajectories' system message, so all open alike."""
  rest = 1.0 - share - spec_share - word_share
  n, n_spec, n_word = (round(len(trajs) * s / rest) for s in (share, spec_share, word_share))
  if n + n_spec + n_word == 0:
    return trajs
  from composer_jax.data.drills import edit_drills, spec_drills, word_drills
  first = trajs[0][0]
  system = first.get("content") if first.get("role") == "system" else None
  return (trajs + (edit_drills(texts, n, seed, system) if n else [])
          + (spec_drills(n_spec, seed, system, spec_levels) if n_spec else [])
          + (word_drills(texts, n_word, seed, system) if n_word else []))

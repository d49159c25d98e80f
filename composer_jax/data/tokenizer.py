"""Tokenizers: byte-level BPE trained on the corpus (small configs), or a real one loaded from disk.

Built on the HF ``tokenizers`` library. A trained tokenizer is saved as ``tokenizer.json`` in the run
directory so resumed runs and later stages (long context, SFT, RL) read exactly the same ids. A real
tokenizer comes from an HF ``tokenizer.json`` or from a tiktoken rank file (the ``tiktoken.model``
Kimi ships), converted to an equivalent BPE. Either way the chat / tool-call special tokens of
``composer_jax.data.chat`` are present.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections.abc import Iterable

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from composer_jax.data import chat
from composer_jax.env import protocol
from composer_jax.env.tools import SPECS

# Kimi K2's pre-tokenization pattern (from its tokenization_kimi.py); used for tiktoken files.
KIMI_PATTERN = "|".join([  # noqa: FLY002 -- one alternative per line, as Kimi writes it
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Aliases under which real tokenizers name our end-of-text and padding tokens.
_ALIASES = {chat.EOS: ("[EOS]", "<|endoftext|>", "</s>", "<|end_of_text|>"), chat.PAD: ("[PAD]", "<pad>")}


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


class Tokenizer:
  """A thin wrapper: encode/decode plus the ids and per-token byte lengths the trainer needs."""

  def __init__(self, tok: tokenizers.Tokenizer):
    self.tok = tok
    missing = [t for t in chat.SPECIAL_TOKENS if self._find(t) is None]
    if missing:
      tok.add_special_tokens(missing)
    self.eos_id = self._find(chat.EOS)
    self.pad_id = self._find(chat.PAD)

  def _find(self, token: str) -> int | None:
    for name in (token, *_ALIASES.get(token, ())):
      i = self.tok.token_to_id(name)
      if i is not None:
        return i
    return None

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: str) -> int:
    i = self._find(token)
    if i is None:
      raise KeyError(token)
    return i

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def byte_lengths(self) -> np.ndarray:
    """UTF-8 bytes each token stands for (0 for special tokens): the denominator of bits/byte."""
    out = np.zeros(self.vocab_size, np.int32)
    inv = {c: b for b, c in bytes_to_unicode().items()}
    special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
    byte_level = isinstance(self.tok.decoder, decoders.ByteLevel)
    for token, i in self.tok.get_vocab(with_added_tokens=True).items():
      if token in special:
        continue
      if byte_level and all(c in inv for c in token):
        out[i] = len(token)
      else:
        out[i] = len(self.tok.decode([i]).encode("utf-8"))
    return out

  def save(self, path: str) -> None:
    self.tok.save(path)


def tool_tags() -> list[str]:
  """The tool-call tags a trained tokenizer holds as single tokens (``protocol.tag_tokens``)."""
  return protocol.tag_tokens(SPECS)


def min_trained_vocab() -> int:
  """The smallest ``train_bpe`` size: the chat special tokens, the 256 bytes and the tool tags."""
  return len(chat.SPECIAL_TOKENS) + 256 + len(tool_tags())


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """Byte-level BPE over ``texts`` with the chat special tokens first (ids 0..n-1) and the tool-call
  tags last (the final ``len(tool_tags())`` ids), ``vocab_size`` tokens in all.

  The tags are ordinary (non-special) added tokens: the corpus never holds them, so BPE would split
  ``<tool_call name="view">`` into ~9 code fragments, and a small policy sampling those fragments
  mixed them into calls like ``</toold>`` (docs/tiny_base.md, "Tool-call tags as tokens"). As one
  token each the call's frame is one choice per tag. They decode to their text and count their
  bytes.
  """
  tags = tool_tags()  # (below 12 + 256 + 35 tokens BPE keeps the bytes and the total is larger)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(tags),
                                special_tokens=list(chat.SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                min_frequency=2, show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in tags])
  return Tokenizer(tok)


def _tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
  # A token of rank r was formed by merging two lower-ranked tokens; every split whose halves are
  # both tokens is a candidate, and BPE applies merges in the order of the merged token's rank.
  merges = []
  for token, rank in ranks.items():
    if len(token) == 1:
      continue
    local = [(token[:i], token[i:]) for i in range(1, len(token))
             if token[:i] in ranks and token[i:] in ranks]
    local.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
    merges += [(left, right, rank) for left, right in local]
  merges.sort(key=lambda m: m[2])
  return [(m[0], m[1]) for m in merges]


def load_tiktoken(path: str, pattern: str = KIMI_PATTERN) -> Tokenizer:
  """Convert a tiktoken rank file (``base64 rank`` per line) into an equivalent HF BPE tokenizer.

  Special tokens come from a sibling ``tokenizer_config.json`` (``added_tokens_decoder``) when there
  is one, so their ids match the released model; missing chat tokens are appended after them.
  """
  ranks: dict[bytes, int] = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        b64, rank = line.split()
        ranks[base64.b64decode(b64)] = int(rank)
  b2u = bytes_to_unicode()
  enc = lambda b: "".join(b2u[x] for x in b)
  vocab = {enc(b): r for b, r in ranks.items()}
  merges = [(enc(a), enc(b)) for a, b in _tiktoken_merges(ranks)]
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
  if os.path.exists(cfg_path):
    with open(cfg_path) as f:
      added = json.load(f).get("added_tokens_decoder", {})
    # HF assigns added tokens the next free id, so add them in id order filling any gaps.
    nxt = len(ranks)
    for i in sorted(added, key=int):
      while nxt < int(i):
        tok.add_special_tokens([f"<|reserved_token_{nxt}|>"])
        nxt += 1
      tok.add_special_tokens([tokenizers.AddedToken(added[i]["content"], special=True)])
      nxt += 1
  return Tokenizer(tok)


def load_tokenizer(path: str) -> Tokenizer:
  if path.endswith(".json"):
    return Tokenizer(tokenizers.Tokenizer.from_file(path))
  return load_tiktoken(path)

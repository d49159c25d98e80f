"""Text sources: Python source found on this machine, text / JSONL files, and weighted mixtures.

A source is a list of ``Doc`` records in a deterministic order (sorted by a hash of the path, so a
file cap samples across the whole tree rather than the alphabetically first packages). Each record
is assigned to the held-out split by a hash of its *content*, so identical files in two places land
on the same side and never leak into validation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig

from composer_jax.config import ConfigError
from composer_jax.data import repeats

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".jsonl")
BUILTIN = ("stdlib", "site-packages")
GENERATED = (repeats.NAME, repeats.CODE_NAME)  # made in memory (data/repeats.py), not read from files
GENERATED_DOCS = 20000  # documents of a generated source (one repeated line each; ~1.2M tokens)


@dataclasses.dataclass(frozen=True)
class Doc:
  """One document: the file it lives in and, for JSONL, the line number (-1 = the whole file)."""
  path: str
  line: int = -1
  field: str = "text"

  def read(self) -> str:
    if self.line >= 0:
      return read_docs([self])[0]
    with open(self.path, encoding="utf-8", errors="replace") as f:
      return f.read()


def _hash_unit(data: bytes) -> float:
  """A number in [0, 1) from the data's SHA-256, stable across machines and Python versions."""
  return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0 ** 64


def is_heldout(text: str, fraction: float) -> bool:
  return _hash_unit(text.encode("utf-8", errors="replace")) < fraction


def builtin_root(name: str) -> str:
  paths = sysconfig.get_paths()
  return paths["stdlib"] if name == "stdlib" else paths["purelib"]


def _walk(root: str, suffixes: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")
                   and d != "__pycache__"]
    files += [os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes)]
  return files


def _ordered(files: list[str], root: str, max_files: int) -> list[str]:
  key = lambda p: hashlib.sha256(os.path.relpath(p, root).encode()).hexdigest()
  files = sorted(files, key=key)
  return files[:max_files] if max_files > 0 else files


def list_docs(source: str, *, max_files: int = 0, text_field: str = "text") -> list[Doc]:
  """The documents of one source ("stdlib", "site-packages", a file, or a directory)."""
  if source in BUILTIN:
    root = builtin_root(source)
    # The stdlib tree contains site-packages; keep the two sources disjoint.
    skip = ("site-packages", "dist-packages") if source == "stdlib" else ()
    files = _ordered(_walk(root, (".py",), skip), root, max_files)
    return [Doc(p) for p in files]
  if not os.path.exists(source):
    raise ConfigError(f"data.sources: {source!r} does not exist; give 'stdlib', 'site-packages', "
                      "'repeats', 'code_repeats', or a path to a .txt/.jsonl file or a directory")
  if os.path.isdir(source):
    files = _ordered(_walk(source, TEXT_SUFFIXES), source, max_files)
  else:
    files = [source]
  docs: list[Doc] = []
  for p in files:
    if p.endswith(".jsonl"):
      with open(p, encoding="utf-8", errors="replace") as f:
        docs += [Doc(p, i, text_field) for i, line in enumerate(f) if line.strip()]
    else:
      docs.append(Doc(p))
  return docs


def read_docs(docs: list[Doc]) -> list[str]:
  """The documents' texts, in order; each JSONL file is read once (not once per line)."""
  lines: dict[str, list[str]] = {}
  out = []
  for d in docs:
    if d.line < 0:
      out.append(d.read())
      continue
    if d.path not in lines:
      with open(d.path, encoding="utf-8", errors="replace") as f:
        lines[d.path] = f.readlines()
    raw = lines[d.path][d.line] if d.line < len(lines[d.path]) else ""
    out.append(str(json.loads(raw).get(d.field, "")) if raw.strip() else "")
  return out


def split_texts(texts: list[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
  """Split into (train texts, held-out texts) by a hash of each text; empty texts dropped."""
  train, heldout = [], []
  for text in texts:
    if not text.strip():
      continue
    (heldout if is_heldout(text, heldout_fraction) else train).append(text)
  return train, heldout


def mixture_weights(sources: list[str], weights: list[float]) -> list[float]:
  if not weights:
    return [1.0 / len(sources)] * len(sources)
  if any(w < 0 for w in weights) or sum(weights) <= 0:
    raise ConfigError(f"data.weights={weights} must be non-negative with a positive sum")
  total = float(sum(weights))
  return [w / total for w in weights]


@dataclasses.dataclass
class Corpus:
  """All sources read into memory: per-source train texts, and the pooled held-out texts."""
  names: list[str]
  train: list[list[str]]
  heldout: list[str]
  weights: list[float]


def load_corpus(sources: list[str], weights: list[float], *, heldout_fraction: float,
                max_files: int = 0, text_field: str = "text") -> Corpus:
  weights = mixture_weights(sources, weights)
  train, heldout = [], []
  read: dict[str, tuple[list[str], list[str]]] = {}  # each file source read and split once

  def split(source: str) -> tuple[list[str], list[str]]:
    if source not in read:
      texts = read_docs(list_docs(source, max_files=max_files, text_field=text_field))
      read[source] = split_texts(texts, heldout_fraction)
    return read[source]

  for s in sources:
    if s == repeats.NAME:
      tr, ho = split_texts(repeats.documents(GENERATED_DOCS), heldout_fraction)
    elif s == repeats.CODE_NAME:  # lines of the stdlib's training split only
      tr, ho = split_texts(repeats.code_documents(split("stdlib")[0], GENERATED_DOCS), heldout_fraction)
    else:
      tr, ho = split(s)
    if not tr:
      raise ConfigError(f"data.sources: {s!r} has no training documents; check the path or lower "
                        "data.heldout_fraction")
    train.append(tr)
    heldout += ho
  return Corpus(list(sources), train, heldout, weights)

"""The ``repeats`` pretraining source: lines of random one-token words, each written 3-4 times.

An agent copies all the time: a file name from the prompt into a call, the old text of an edit from
the file it just viewed. A transformer copies with induction heads (attend to the token that followed
the earlier occurrence of the current token). The tiny config does not form them on its own: after
its SFT it predicted the old text of an edit from memorised variable names, not from the file shown
just above (docs/tiny_base.md, "Copying"). This source makes copying the only way to lower most of
its loss: a fresh random line, then the same line again. Mix a share of it into pretraining
(``data.sources: [stdlib, repeats]``); the tokenizer is trained on the first source only.
``code_repeats`` (below) repeats lines of the stdlib's training split instead: copying in code tokens.

Measured on the tiny config (2 CPU cores, 2026-11-24; docs/tiny_base.md, "Copying"): up to 1,500
steps at 70 % repeats did not form induction heads (greedy accuracy on the 2nd/3rd copy 0.07, as on
the 1st), so the source is not yet in configs/tiny.yaml. On repeats alone (batch 16,
model.init_std=0.1) the circuit forms between steps 6,000 and 8,000 (2nd-copy accuracy 0.43 ->
0.996; 48 min on 2 cores): longer than the 30-min job affords. That circuit does not copy code
tokens; ``code_repeats`` (from that checkpoint, 85 % of the mix, lr 2e-3) formed one that does:
Python lines copied at 0.83 / 0.96 on copies 2 / 3 after 7,000 more steps (docs/tiny_base.md,
"Copying in code tokens"). That run is the shipped base (configs/tiny-base), and configs/tiny.yaml's
pretraining keeps ``code_repeats`` at half of its mix so that the copying survives.
The alphabet is small so that every token's embedding is updated often (a copy circuit over 1,500
random ids formed far later than over 150-250 in a bare loop). Deterministic in the seed.
"""

from __future__ import annotations

import random
import string

NAME = "repeats"
# A small alphabet of one-token words (each token's embedding needs many updates before a copy
# circuit forms over it; see the module docstring).
_ALPHABET = list(string.ascii_letters + string.digits) + ["=", "+", "-", "*", "(", ")", ",", ":",
                                                           "[", "]", "<", ">", "%", "/"]


def _word(rng: random.Random) -> str:
  return rng.choice(_ALPHABET)


def unit(rng: random.Random, words: tuple[int, int] = (8, 20), copies: tuple[int, int] = (3, 4)) -> str:
  """One random line written ``copies`` times, one per line."""
  line = " ".join(_word(rng) for _ in range(rng.randint(*words)))
  return "\n".join([line] * rng.randint(*copies))


def documents(n: int, seed: int = 0, units: int = 1) -> list[str]:
  """``n`` documents of ``units`` repeated lines each (blank line between units)."""
  rng = random.Random(f"repeats/{seed}")
  return ["\n\n".join(unit(rng) for _ in range(units)) for _ in range(n)]


# ``code_repeats``: the same lesson in the code's own tokens. A circuit learned on the 76 symbols
# above did not carry over to code: continued pretraining on stdlib from a checkpoint that copied
# them (2nd copy 0.996) left lines of Python copied at chance (docs/tiny_base.md, "Copying in code
# tokens").
CODE_NAME = "code_repeats"


def code_documents(texts: list[str], n: int, seed: int = 0) -> list[str]:
  """``n`` documents of 1-3 units; a unit is 1-2 consecutive lines (10-80 characters, stripped,
  then indented by 0 or 4 spaces) of one of ``texts``, written 2-3 times."""
  pools = [p for p in ([ln.strip() for ln in t.splitlines() if 10 <= len(ln.strip()) <= 80]
                       for t in texts) if len(p) >= 2]
  if not pools:
    raise ValueError("code_repeats: no text has two lines of 10-80 characters to repeat")
  rng = random.Random(f"code_repeats/{seed}")
  docs = []
  for _ in range(n):
    units = []
    for _ in range(rng.randint(1, 3)):
      pool = rng.choice(pools)
      i = rng.randrange(len(pool) - 1)
      indent = rng.choice(("", "    "))
      chunk = "\n".join(indent + ln for ln in pool[i: i + rng.randint(1, 2)])
      units.append("\n".join([chunk] * rng.randint(2, 3)))
    docs.append("\n\n".join(units))
  return docs

"""Edit drills: short generated agent chats in which every argument is copied from the chat itself.

An agent's calls are mostly copies: the file name from the task, the old text of an edit from the
file it just viewed, the new text from the task. The scripted-expert trajectories teach the format of
those calls, but with 200 of them over 20 module names a small model lowers its loss faster by
remembering which names go together than by reading the prompt, and SFT overwrote the copying a base
had learned (docs/tiny_base.md, "Copying in code tokens"). A drill asks for one edit to a file whose
name and lines are fresh code from the corpus, so only copying predicts its calls:

  user       Line 3 of `sock_opts.py` should read `    self.running = False`. Edit it.
  assistant  view(sock_opts.py)
  tool       the file, numbered
  assistant  str_replace(sock_opts.py, old=<line 3 as shown>, new=<the line from the prompt>)
  tool       the edit
  assistant  submit()

The observations are the real tools' output (a ToolBox over a temporary workspace), and the replies
are tool calls like the expert's, so drills teach copying without a second reply format (plain-text
copy chats made the policy write broken calls; docs/tiny_base.md). ``data.sft_copy_share`` mixes
them into SFT; they draw from the first source's training split only.
"""

from __future__ import annotations

import builtins
import keyword
import os
import random
import re
import tempfile
import textwrap

from composer_jax.env.protocol import ToolCall, format_call, format_observation
from composer_jax.env.sandbox import Sandbox
from composer_jax.env.tools import ToolBox

_IDENT = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b|\b[a-z]{4,}\b")


def _usable(line: str) -> bool:
  return 8 <= len(line.strip()) and len(line) <= 100 and "\t" not in line


def _chunks(texts: list[str]) -> list[list[str]]:
  """Runs of 3-8 consecutive usable lines from each text, dedented (the files a drill shows)."""
  out = []
  for t in texts:
    run: list[str] = []
    for ln in [*t.splitlines(), ""]:
      if _usable(ln) and len(run) < 8:
        run.append(ln.rstrip())
        continue
      if len(run) >= 3:
        out.append(textwrap.dedent("\n".join(run)).splitlines())
      run = [ln.rstrip()] if _usable(ln) else []
  return out


def edit_drills(texts: list[str], n: int, seed: int = 0, system: str | None = None) -> list[list[dict]]:
  """``n`` drill chats (message lists as in ``data/chat.py``) from lines of ``texts``."""
  chunks = _chunks(texts)
  if not chunks:
    raise ValueError("edit drills: the corpus has no runs of 3 short lines to edit")
  names = sorted({m for t in texts for m in _IDENT.findall(t)})
  rng = random.Random(f"drills/{seed}")
  out = []
  with tempfile.TemporaryDirectory(prefix="cj-drill-") as ws:
    tools = ToolBox(Sandbox(ws))  # drills never run a command
    while len(out) < n:
      lines = rng.choice(chunks)
      k = rng.randrange(len(lines))
      old = lines[k]
      donor = rng.choice(rng.choice(chunks)).strip()
      indent = old[: len(old) - len(old.lstrip())]
      new = indent + donor
      text = "\n".join(lines) + "\n"
      if text.count(old) != 1 or new == old or not donor:
        continue
      path = f"{rng.choice(names)}.py"
      tools.execute(ToolCall("create", {"path": path, "content": text}))
      out.append(_chat(tools, system, f"Line {k + 1} of `{path}` should read `{new}`. Edit it.",
                       [[("view", {"path": path})],
                        [("str_replace", {"path": path, "old": old, "new": new})], [("submit", {})]]))
      tools.submitted = False
  return out


def _chat(tools: ToolBox, system: str | None, prompt: str, turns: list[list[tuple[str, dict]]]) -> list[dict]:
  """The chat of an episode whose assistant turns make ``turns``' calls, observed by ``tools``."""
  msgs = [{"role": "system", "content": system}] if system else []
  msgs.append({"role": "user", "content": prompt})
  for calls in turns:
    obs = [tools.execute(ToolCall(name, args)) for name, args in calls]
    msgs.append({"role": "assistant", "content": "\n".join(format_call(n, a) for n, a in calls)})
    msgs.append({"role": "tool", "content": "\n".join(format_observation(n, o.text, o.ok)
                                                      for (n, _), o in zip(calls, obs))})
  return msgs


def spec_drills(n: int, seed: int = 0, system: str | None = None, levels: tuple = (2, 3)) -> list[list[dict]]:
  """``n`` chats that solve synthetic training-template instances at ``levels``: specs in words,
  a distractor beside the target, small logic, a bug to find (``env/synthetic/templates.py``).

  The expert trajectories hold about 17 instances of each such family, too few for a small model to
  learn that "p times 3, plus v" is ``p * 3 + v`` rather than a copy of the neighbouring function
  (docs/rl_tiny.md, "Spec drills"). A drill is the expert's plan for a fresh instance (view, then
  ``env.expert.edit_calls`` per file, then submit) with the real tools' observations; it runs no
  command, so it skips the test run. Instances come from the training split only (the held-out
  split, by content hash, never), drawn under a seed of their own.
  """
  from composer_jax.env.expert import edit_calls
  from composer_jax.env.synthetic import instances
  out = []
  with tempfile.TemporaryDirectory(prefix="cj-spec-") as root:
    for i, inst in enumerate(instances(n, seed=7_000_003 + seed, split="train", levels=list(levels))):
      ws = os.path.join(root, str(i))
      os.makedirs(ws)
      tools = ToolBox(Sandbox(ws))
      for rel, text in inst.files.items():
        tools.execute(ToolCall("create", {"path": rel, "content": text}))
      turns = []
      for rel in inst.edit_order:
        edits = edit_calls(inst.files[rel], inst.gold[rel])
        turns += [[("view", {"path": rel})], [(tool, {"path": rel, **args}) for tool, args in edits]]
      out.append(_chat(tools, system, inst.prompt, turns + [[("submit", {})]]))
  return out


def word_drills(texts: list[str], n: int, seed: int = 0, system: str | None = None) -> list[list[dict]]:
  """``n`` chats that implement or fix one function whose docstring says in words what it returns,
  in the phrases of the templates' level-2/3 specs: an arithmetic chain over every operator ("t
  modulo 9", "p times 3, plus v") or a condition ("the items of xs that are at most 4", "a if a is
  greater than b, else ...").

  The expert trajectories and spec drills state each operator and comparison phrase only 9-21
  times, and the policy wrote ``>`` for every comparison and ``-`` for "modulo" (docs/rl_gain.md,
  "Stop 39"). A word drill is one short view / edit / submit, so hundreds fit in a few SFT rows.
  Module and function names are identifiers from ``texts`` (never the templates' vocabulary), so no
  drill's file is a task's file, held-out ones included. Three in five are conditions (the level-3
  families', which the policy learned least), two in five operator chains. Half are "implement"
  (the old text is the ``raise NotImplementedError`` line) and half "fix the bug", whose old text is
  the viewed line with one operator changed: with implement drills alone the policy stopped copying
  the old text it saw (docs/rl_gain.md, "Stop 40"). Half the files hold a helper with a literal
  docstring beside the target, as the level-2 tasks do.
  """
  from composer_jax.env.expert import edit_calls
  from composer_jax.env.synthetic import templates as T
  taken = {*T.MODULES, *T.CONST_MODULES, *T.LISTS, *T.SCALARS, *dir(builtins),
           *(f"{v}_{n}" for v in T.VERBS for n in T.NOUNS)}
  idents = sorted({m for t in texts for m in _IDENT.findall(t)
                   if len(m) <= 24 and not keyword.iskeyword(m) and m not in taken
                   and not m.startswith("test")})
  if len(idents) < 3:
    raise ValueError("word drills: the corpus has fewer than 3 identifiers to name files and functions")
  rng = random.Random(f"word-drills/{seed}")
  out = []
  with tempfile.TemporaryDirectory(prefix="cj-word-") as root:
    while len(out) < n:
      mod, fn, helper = rng.sample(idents, 3)
      names = T.Names(rng)
      chain = None
      if rng.random() < 0.6:  # a condition: the level-3 families' phrases, the least learned
        doc = ""
        while not any(p in doc for p in T.CMPS.values()):
          names = T.Names(rng)
          args, doc, body = T.logic_spec(rng, names)
      else:
        args = [names.pick(T.SCALARS) for _ in range(rng.choice([1, 2]))]
        chain = T.arith(rng, args, 1 if len(args) == 2 else rng.choice([1, 2]), hard=True)
        doc, body = T.arith_doc(chain, words=True), [f"return {T.expr_text(chain)}"]
      fix = rng.random() < 0.5
      start = _near_miss(rng, body, chain) if fix else T.TODO
      blocks = [T.function_src(fn, args, doc, start), T.function_src(fn, args, doc, body)]
      if rng.random() < 0.5:
        h_args = [names.pick(T.SCALARS)]
        h_chain = T.arith(rng, h_args, 1)
        src = T.function_src(helper, h_args, T.arith_doc(h_chain, False),
                             [f"return {T.expr_text(h_chain)}"])
        first = rng.random() < 0.5
        blocks = [[src, b] if first else [b, src] for b in blocks]
      else:
        blocks = [[b] for b in blocks]
      before, after = (T.module(*b) for b in blocks)
      ws = os.path.join(root, str(len(out)))
      os.makedirs(ws)
      tools = ToolBox(Sandbox(ws))
      path = f"{mod}.py"
      tools.execute(ToolCall("create", {"path": path, "content": before}))
      turns = [[("view", {"path": path})],
               [(tool, {"path": path, **a}) for tool, a in edit_calls(before, after)], [("submit", {})]]
      prompt = (f"`{fn}` in `{path}` does not do what its docstring says. Fix the bug. {T.TEST_RUN}"
                if fix else f"Implement `{fn}` in `{path}` as its docstring says. {T.TEST_RUN}")
      out.append(_chat(tools, system, prompt, turns))
  return out


def _near_miss(rng: random.Random, body: list[str], chain: list | None) -> list[str]:
  """``body`` with one operator changed: another comparison for a condition, another arithmetic
  operator for a chain (the slips the templates' hidden tests tell apart)."""
  from composer_jax.env.synthetic.templates import CMPS, expr_text, mutate_op
  if chain is not None:
    return [f"return {expr_text(mutate_op(rng, chain))}"]
  cmp = next(c for c in CMPS if f" {c} " in body[0])
  other = rng.choice([c for c in CMPS if c != cmp])
  return [body[0].replace(f" {cmp} ", f" {other} ", 1)]

"""Synthetic task templates: tiny repositories whose fix is mostly copied from what the agent sees.

Each template is a function ``(rng, difficulty) -> Instance`` that draws names, constants and
operations, writes the module(s) before and after the reference change, and derives the tests'
expected values by running the reference code (our own generated code, in this process). Visible
tests hold a couple of examples; hidden tests (restored only at grading) hold more cases and check
exact result types, so hard-coding the visible examples or returning an always-equal object fails.
The hidden cases also tell the reference apart from each of its near misses (one operator,
comparison or constant changed on a line the change adds) wherever an input can
(``cases.hidden_steps``).

Prompts put file names in backticks: the BPE then splits a name as the tool call writes it
(`logic.py` -> 'log' 'ic' '.' 'py'; a bare " logic.py" starts with the space-prefixed ' log'), so
naming the file to open is a copy of the very tokens the prompt holds, which a small model learns far
sooner than a token-to-token mapping.

Difficulty: 1 = the spec is a literal Python expression in the docstring, 2 = the spec is in words
and a distractor function (already tested, PASS_TO_PASS) sits beside the target, 3 = a small piece
of logic (a filter, a count, a conditional, an off-by-one).
"""

from __future__ import annotations

import dataclasses
import random

from composer_jax.env.synthetic.cases import (
  TODO_BODY,
  branch_only,
  differing,
  flat,
  hidden_steps,
  returning,
  run_steps,
  trivial,
  varied,
)

# --------------------------------------------------------------------------------------------------
# Vocabulary (module names avoid the stdlib modules the runner imports: a local file would shadow them)
# --------------------------------------------------------------------------------------------------

MODULES = ["ops", "calc", "util", "mathx", "core", "logic", "metrics", "scores", "prices", "grid",
           "points", "ledger", "shapes", "geo", "bank", "shop", "helpers", "rules", "tally", "mixer"]
CONST_MODULES = ["consts", "config", "settings", "limits", "params", "defaults"]
VERBS = ["scale", "mix", "blend", "shift", "fold", "merge", "count", "pick", "step", "grow", "trim",
         "bump", "wrap", "spread", "pack", "score", "rate", "weigh", "tune", "clip", "lift", "drop"]
NOUNS = ["total", "value", "score", "price", "level", "size", "rate", "pair", "load", "tick", "span",
         "cost", "weight", "depth", "width", "count", "gain", "offset", "budget", "margin"]
SCALARS = ["a", "b", "x", "y", "n", "m", "k", "v", "w", "p", "q", "t", "u"]
LISTS = ["xs", "items", "values", "nums", "data", "vals"]
CLASSES = ["Counter", "Tank", "Wallet", "Meter", "Box", "Account", "Gauge", "Bucket", "Timer", "Cart",
           "Battery", "Garden", "Score", "Budget", "Queue"]
ATTRS = ["total", "level", "count", "value", "size", "amount", "charge", "stock", "points", "balance"]
CONSTS = ["SCALE", "RATE", "LIMIT", "BASE", "STEP", "FACTOR", "OFFSET", "BONUS", "MARGIN", "WIDTH",
          "DEPTH", "SHIFT", "UNIT", "CAP", "BIAS"]

OPS = {"+": "plus", "-": "minus", "*": "times", "//": "floor-divided by", "%": "modulo"}
CMPS = {">": "greater than", "<": "less than", ">=": "at least", "<=": "at most", "==": "equal to"}
TEST_RUN = "Tests: `python run_tests.py`."


@dataclasses.dataclass
class Instance:
  template: str
  difficulty: int
  files: dict  # path -> text before the change (sources only)
  gold: dict  # path -> text after the change (the files the reference solution changes)
  tests: dict  # visible test files
  hidden: dict  # hidden test files (absent from the workspace)
  fail_to_pass: list
  pass_to_pass: list
  prompt: str  # terse
  statement: str  # verbose
  edit_order: list  # files in the order the scripted expert edits them
  params: dict = dataclasses.field(default_factory=dict)


class Names:
  """Draws distinct identifiers."""

  def __init__(self, rng: random.Random):
    self.rng, self.used = rng, set()

  def pick(self, pool: list) -> str:
    choices = [p for p in pool if p not in self.used]
    name = self.rng.choice(choices)
    self.used.add(name)
    return name

  def func(self) -> str:
    while True:
      name = f"{self.rng.choice(VERBS)}_{self.rng.choice(NOUNS)}"
      if name not in self.used:
        self.used.add(name)
        return name


# --------------------------------------------------------------------------------------------------
# Specs: (docstring, body lines)
# --------------------------------------------------------------------------------------------------

def arith(rng: random.Random, operands: list, n_consts: int, hard: bool = False) -> list:
  """A left-to-right chain ``[first, (op, operand), ...]`` using every operand once plus constants.

  Python's precedence must agree with reading left to right (so the words form is unambiguous):
  never ``+``/``-`` followed by a tighter operator. ``//`` and ``%`` only take constants (no zero
  divisors).
  """
  items = list(operands[1:]) + [rng.randint(2, 9) for _ in range(n_consts)]
  rng.shuffle(items)
  chain, prev = [operands[0]], "*"
  for item in items:
    ops = ["+", "-", "*"] + (["//", "%"] if hard and isinstance(item, int) else [])
    if prev in "+-":
      ops = [o for o in ops if o in "+-"]
    op = rng.choice(ops)
    chain.append((op, item))
    prev = op
  return chain


def expr_text(chain: list) -> str:
  return " ".join([str(chain[0])] + [f"{op} {x}" for op, x in chain[1:]])


def expr_words(chain: list) -> str:
  """``a times 3, plus b``: the comma marks that the first part is done first."""
  parts = [f"{OPS[op]} {x}" for op, x in chain[1:]]
  return f"{chain[0]} " + ", ".join(parts)


def arith_doc(chain: list, words: bool) -> str:
  return f"Return {expr_words(chain)}." if words else f"Return {expr_text(chain)}."


def logic_spec(rng: random.Random, names: Names) -> tuple[list, str, list]:
  """A filter / count / map / extreme / choice over a list or two scalars: (args, doc, body)."""
  kind = rng.choice(["filter_sum", "count", "map", "extreme", "choose"])
  c = rng.randint(2, 9)
  cmp = rng.choice(list(CMPS))
  op = rng.choice(["+", "-", "*"])
  if kind == "choose":
    a, b = names.pick(SCALARS), names.pick(SCALARS)
    return [a, b], (f"Return {a} if {a} is {CMPS[cmp]} {b}, else {b} {OPS[op]} {c}."), \
        [f"return {a} if {a} {cmp} {b} else {b} {op} {c}"]
  xs = names.pick(LISTS)
  if kind == "filter_sum":
    return [xs], f"Return the sum of the items of {xs} that are {CMPS[cmp]} {c}.", \
        [f"return sum(x for x in {xs} if x {cmp} {c})"]
  if kind == "count":
    return [xs], f"Return how many items of {xs} are {CMPS[cmp]} {c}.", \
        [f"return sum(1 for x in {xs} if x {cmp} {c})"]
  if kind == "map":
    return [xs], f"Return a list of each item of {xs} {OPS[op]} {c}.", \
        [f"return [x {op} {c} for x in {xs}]"]
  ext = rng.choice(["max", "min"])
  word = "largest" if ext == "max" else "smallest"
  return [xs], f"Return the {word} item of {xs} {OPS[op]} {c}.", [f"return {ext}({xs}) {op} {c}"]


def arg_values(rng: random.Random, args: list) -> list[str]:
  """Literal argument values: small ints for scalars, short int lists for list names."""
  out = []
  for a in args:
    if a in LISTS:
      out.append(repr([rng.randint(0, 9) for _ in range(rng.randint(3, 5))]))
    else:
      out.append(str(rng.randint(0, 9)))
  return out


# --------------------------------------------------------------------------------------------------
# Source and test rendering
# --------------------------------------------------------------------------------------------------

def function_src(name: str, args: list, doc: str, body: list, indent: str = "") -> str:
  lines = [f"{indent}def {name}({', '.join(args)}):", f'{indent}    """{doc}"""']
  lines += [f"{indent}    {b}" for b in body]
  return "\n".join(lines) + "\n"


TODO = [TODO_BODY]  # the unimplemented body that cases.trivial replaces


def module(*blocks: str, header: str = "") -> str:
  """Blocks separated by two blank lines (PEP 8), after an optional import header."""
  parts = ([header] if header else []) + list(blocks)
  return "\n\n\n".join(p.strip("\n") for p in parts) + "\n"


def render_test(name: str, steps: list, values: list, strict: bool, kept=()) -> str:
  """A test function: statements as they are, checks as ``assert e == v`` (or ``check(e, v)``, and
  ``kept(e, v)`` for the checks numbered in ``kept``)."""
  lines = [f"def {name}():"]
  it = enumerate(values)
  for kind, code in steps:
    if kind == "stmt":
      lines.append(f"    {code}")
    else:
      i, v = next(it)
      lines.append(f"    {'kept' if i in kept else 'check'}({code}, {v!r})" if strict
                   else f"    assert {code} == {v!r}")
  return "\n".join(lines) + "\n"


def hidden_test(name: str, lists: list, before: dict, after: dict, shortcuts=(), shown=()) -> str:
  """The hidden test of the step ``lists``: each check a ``check(e, v)`` with the reference's value,
  or a ``kept(e, v)`` where a shortcut gives that value too: the starting code, a body that does
  nothing (``trivial``), the reference with a branch forced (``branch_only``), ``shortcuts`` (a
  visible value returned as a constant), or a table of the visible cases (a list in ``shown``).
  Both must pass, but partial credit pays only for the checks no shortcut gets
  (``oracle.checks_right``): a ``rename`` left undone with one alias line got 3 of 4, and a
  ``method`` with its condition dropped 82 %."""
  steps = flat(lists)
  want = run_steps(after, steps)
  kept = shared(want, steps, [before, *trivial(before), *branch_only(before, after), *shortcuts])
  i = 0
  for one in lists:
    n = sum(kind == "check" for kind, _ in one)
    if one in shown:
      kept |= set(range(i, i + n))
    i += n
  return render_test(name, steps, want, True, kept)


def shared(want: list, steps: list, others) -> set:
  """The numbers of the checks of ``steps`` on which a source of ``others`` gives the value of
  ``want`` (of its type too)."""
  return {i for other in others for i, (w, s) in enumerate(zip(want, run_steps(other, steps)))
          if type(w) is type(s) and w == s}


CHECK = ("def check(got, want):\n"
         "    assert type(got) is type(want) and got == want, (got, want)\n\n\n"
         "kept = check  # a value a shortcut also gives: not paid as partial credit (hidden_test)\n")


def test_file(imports: list, tests: list) -> str:
  return module(*tests, header="\n".join(imports))


def call_steps(fn: str, args: list):
  return lambda rng: [("check", f"{fn}({', '.join(arg_values(rng, args))})")]


def _src(d: dict) -> dict:
  return {f"{m}.py": t for m, t in d.items()}


def mutate_op(rng: random.Random, chain: list) -> list:
  i = rng.randrange(1, len(chain))
  op, x = chain[i]
  choices = [o for o in ("+", "-", "*") if o != op]
  return chain[:i] + [(rng.choice(choices), x)] + chain[i + 1:]


def _mutate_const(rng: random.Random, chain: list) -> list:
  idx = [i for i in range(1, len(chain)) if isinstance(chain[i][1], int)]
  i = rng.choice(idx)
  op, c = chain[i]
  lo = 2 if op in ("//", "%") else 1
  c2 = c + 1 if c <= lo else c + rng.choice([-1, 1])
  return chain[:i] + [(op, c2)] + chain[i + 1:]


def _distractor(rng: random.Random, names: Names, prefix: list | None = None):
  """An implemented helper beside the target: (name, args, source)."""
  name, args = names.func(), [names.pick(SCALARS)]
  chain = arith(rng, args + (prefix or []), 1)
  return name, args, function_src(name, args, arith_doc(chain, False), [f"return {expr_text(chain)}"])


def paired(make_steps, avoid=()):
  """Step lists of one check that joins two draws of a call, ``(f(x), f(y))``: the reference with
  a branch forced gets a single call right whenever the call takes that branch, and two calls on
  either side of it only by being right (``implement``'s ``choose``). Neither draw is in ``avoid``
  (the visible lists, which a table can pass) where 20 tries find another."""
  def make(rng):
    calls = []
    for _ in range(2):
      one = make_steps(rng)
      for _ in range(20):
        if one not in avoid:
          break
        one = make_steps(rng)
      calls.append(one[0][1])
    return [("check", f"({calls[0]}, {calls[1]})")]
  return make


def _function_tests(rng, mod, fn, args, before, after, other=None, n_vis=2, n_hid=4,
                    header_extra=()):
  """Visible ``test_MOD.py`` (target test + a passing test of ``other``) and hidden tests."""
  shown = differing(before, after, call_steps(fn, args), rng, n_vis)
  vis = flat(shown)
  consts = returning(before, fn, run_steps(after, vis))
  make = paired(call_steps(fn, args), shown) if branch_only(before, after) else call_steps(fn, args)
  hid = hidden_steps(before, after, make, rng, n_hid, shortcuts=consts, shown=shown)
  tests = [render_test(f"test_{fn}", vis, run_steps(after, vis), False)]
  p2p = []
  imports = [fn]
  if other:
    oname, oargs = other
    steps = flat(call_steps(oname, oargs)(rng) for _ in range(2))
    tests.append(render_test(f"test_{oname}", steps, run_steps(after, steps), False))
    p2p.append(f"test_{mod}.py::test_{oname}")
    imports.append(oname)
  visible = {f"test_{mod}.py": test_file([*header_extra, f"from {mod} import {', '.join(imports)}"],
                                         tests)}
  hidden = {f"test_{mod}_hidden.py": test_file(
      [f"from {mod} import {fn}"],
      [CHECK, hidden_test(f"test_{fn}_hidden", hid, before, after, consts, shown)])}
  f2p = [f"test_{mod}.py::test_{fn}", f"test_{mod}_hidden.py::test_{fn}_hidden"]
  return visible, hidden, f2p, p2p


def _function_module(rng, names, d, target_before, target_after):
  """The target function, plus at difficulty >= 2 a tested helper above or below it."""
  if d < 2:
    return [target_before], [target_after], None
  oname, oargs, osrc = _distractor(rng, names)
  if rng.random() < 0.5:
    return [osrc, target_before], [osrc, target_after], (oname, oargs)
  return [target_before, osrc], [target_after, osrc], (oname, oargs)


def implement(rng: random.Random, d: int) -> Instance:
  names = Names(rng)
  mod, fn = names.pick(MODULES), names.func()
  for _ in range(50):  # a reference that takes few values is drawn again (cases.varied)
    used = set(names.used)
    if d >= 3:
      args, doc, body = logic_spec(rng, names)
    else:
      args = [names.pick(SCALARS) for _ in range(rng.choice([1, 2]))]
      chain = arith(rng, args, 1 if len(args) == 2 else rng.choice([1, 2]), hard=d >= 2)
      doc, body = arith_doc(chain, words=d == 2), [f"return {expr_text(chain)}"]
    if varied({mod: function_src(fn, args, doc, body)}, call_steps(fn, args), body[0],
              unlike=trivial({mod: function_src(fn, args, doc, TODO)})):
      break
    names.used = used
  b, a, other = _function_module(rng, names, d, function_src(fn, args, doc, TODO),
                                 function_src(fn, args, doc, body))
  before, after = {mod: module(*b)}, {mod: module(*a)}
  vis, hid, f2p, p2p = _function_tests(rng, mod, fn, args, before, after, other)
  prompt = f"Implement `{fn}` in `{mod}.py` as its docstring says. {TEST_RUN}"
  return Instance("implement", d, _src(before), _src(after), vis, hid, f2p, p2p, prompt,
                  prompt + f" The tests are in `test_{mod}.py`.", [f"{mod}.py"])


def _off_by_one(rng: random.Random, names: Names):
  """(args, doc, gold body, buggy body) with a boundary mistake."""
  kind = rng.choice(["range", "cmp", "slice"])
  if kind == "range":
    n, lo = names.pick(SCALARS), rng.randint(0, 3)
    return [n], f"Return the sum of the integers from {lo} to {n}, inclusive.", \
        [f"return sum(range({lo}, {n} + 1))"], [f"return sum(range({lo}, {n}))"]
  xs, c = names.pick(LISTS), rng.randint(2, 7)
  if kind == "slice":
    k = rng.randint(2, 3)
    if rng.random() < 0.5:
      return [xs], f"Return the first {k} items of {xs}.", [f"return {xs}[:{k}]"], \
          [f"return {xs}[:{k} - 1]"]
    return [xs], f"Return the items of {xs} after the first {k}.", [f"return {xs}[{k}:]"], \
        [f"return {xs}[{k} + 1:]"]
  cmp, bad = rng.choice([(">=", ">"), ("<=", "<")])
  if rng.random() < 0.5:
    return [xs], f"Return how many items of {xs} are {CMPS[cmp]} {c}.", \
        [f"return sum(1 for x in {xs} if x {cmp} {c})"], [f"return sum(1 for x in {xs} if x {bad} {c})"]
  return [xs], f"Return the sum of the items of {xs} that are {CMPS[cmp]} {c}.", \
      [f"return sum(x for x in {xs} if x {cmp} {c})"], [f"return sum(x for x in {xs} if x {bad} {c})"]


def fix_bug(rng: random.Random, d: int) -> Instance:
  names = Names(rng)
  mod, fn = names.pick(MODULES), names.func()
  if d >= 3:
    args, doc, gold, bug = _off_by_one(rng, names)
  else:
    args = [names.pick(SCALARS) for _ in range(rng.choice([1, 2]))]
    chain = arith(rng, args, 1 if len(args) == 2 else rng.choice([1, 2]))
    wrong = mutate_op(rng, chain) if d == 1 else _mutate_const(rng, chain)
    doc, gold, bug = arith_doc(chain, False), [f"return {expr_text(chain)}"], \
        [f"return {expr_text(wrong)}"]
  b, a, other = _function_module(rng, names, d, function_src(fn, args, doc, bug),
                                 function_src(fn, args, doc, gold))
  before, after = {mod: module(*b)}, {mod: module(*a)}
  vis, hid, f2p, p2p = _function_tests(rng, mod, fn, args, before, after, other)
  prompt = f"`{fn}` in `{mod}.py` does not do what its docstring says. Fix the bug. {TEST_RUN}"
  return Instance("fix_bug", d, _src(before), _src(after), vis, hid, f2p, p2p, prompt,
                  prompt + f" The tests are in `test_{mod}.py`.", [f"{mod}.py"])


# --------------------------------------------------------------------------------------------------
# Classes
# --------------------------------------------------------------------------------------------------

def _method_spec(rng: random.Random, attr: str, d: int, words: bool):
  """(doc, body, chain or None) of a method ``(self, n)`` on attribute ``attr``."""
  if d == 1:
    chain = arith(rng, [f"self.{attr}", "n"], 1)
    return arith_doc(chain, words), [f"return {expr_text(chain)}"], chain
  if d == 2:
    chain = arith(rng, ["n"], 1)
    amount = expr_words(chain) if words else expr_text(chain)
    return (f"Add {amount} to self.{attr}, then return self.{attr}.",
            [f"self.{attr} += {expr_text(chain)}", f"return self.{attr}"], chain)
  cmp, op, c = rng.choice(list(CMPS)), rng.choice(["+", "-", "*"]), rng.randint(2, 9)
  doc = f"If n is {CMPS[cmp]} self.{attr}, set self.{attr} to n {OPS[op]} {c}. Return self.{attr}."
  return (doc,
          [f"if n {cmp} self.{attr}:", f"    self.{attr} = n {op} {c}", f"return self.{attr}"], None)


def _class_src(cls: str, attr: str, methods: list) -> str:
  init = f"    def __init__(self, {attr}):\n        self.{attr} = {attr}\n"
  parts = [f'class {cls}:\n    """A {cls.lower()} that keeps its {attr}."""\n', init] + methods
  return "\n".join(p.rstrip("\n") + "\n" for p in parts)


def _class_task(rng, d, template, buggy: bool) -> Instance:
  names = Names(rng)
  mod, cls, attr, meth = names.pick(MODULES), names.pick(CLASSES), names.pick(ATTRS), names.pick(VERBS)
  doc, body, chain = _method_spec(rng, attr, min(d, 3), words=d >= 2 and not buggy)
  if buggy:
    wrong = mutate_op(rng, chain) if d == 1 else _mutate_const(rng, chain)
    start = [f"return {expr_text(wrong)}"] if d == 1 else \
        [f"self.{attr} += {expr_text(wrong)}", f"return self.{attr}"]
  else:
    start = TODO
  target_b = function_src(meth, ["self", "n"], doc, start, "    ")
  target_a = function_src(meth, ["self", "n"], doc, body, "    ")
  other = None
  extra = []
  if d >= 2:
    oname = names.pick(VERBS)
    ochain = arith(rng, [f"self.{attr}"], 1)
    extra = [function_src(oname, ["self"], arith_doc(ochain, False), [f"return {expr_text(ochain)}"],
                          "    ")]
    other = oname
  before = {mod: _class_src(cls, attr, extra + [target_b])}
  after = {mod: _class_src(cls, attr, extra + [target_a])}
  var = cls.lower()

  def steps(rng):
    out = [("stmt", f"{var} = {cls}({rng.randint(1, 9)})"), ("check", f"{var}.{meth}({rng.randint(0, 9)})")]
    return out + ([("check", f"{var}.{attr}")] if d >= 2 else [])

  vis = differing(before, after, steps, rng, 2)
  if d >= 3 and not buggy:  # show both branches: one example where the condition is false
    always = [b.strip() for b in body[1:]]
    alt = {mod: _class_src(cls, attr, extra + [function_src(meth, ["self", "n"], doc, always, "    ")])}
    vis = vis[:1] + differing(alt, after, steps, rng, 1)
  shown, vis = vis, flat(vis)

  def twice(rng):  # two calls on one object: a forced branch gets both only where both take it
    init, m1, m2 = rng.randint(1, 9), rng.randint(0, 9), rng.randint(0, 9)
    return [("stmt", f"{var} = {cls}({init})"),
            ("check", f"({var}.{meth}({m1}), {var}.{attr}, {var}.{meth}({m2}), {var}.{attr})")]

  consts = returning(before, meth, run_steps(after, vis))
  hid = hidden_steps(before, after, twice if branch_only(before, after) else steps, rng, 4,
                     shortcuts=consts, shown=shown)
  tests = [render_test(f"test_{meth}", vis, run_steps(after, vis), False)]
  p2p = []
  if other:
    ost = [("check", f"{cls}({rng.randint(1, 9)}).{other}()")]
    tests.append(render_test(f"test_{other}", ost, run_steps(after, ost), False))
    p2p.append(f"test_{mod}.py::test_{other}")
  vis_files = {f"test_{mod}.py": test_file([f"from {mod} import {cls}"], tests)}
  hid_files = {f"test_{mod}_hidden.py": test_file(
      [f"from {mod} import {cls}"], [CHECK, hidden_test(f"test_{meth}_hidden", hid, before, after,
                                                       consts, shown)])}
  f2p = [f"test_{mod}.py::test_{meth}", f"test_{mod}_hidden.py::test_{meth}_hidden"]
  if buggy:
    prompt = (f"`{cls}.{meth}` in `{mod}.py` does not do what its docstring says. Fix the bug. "
              f"{TEST_RUN}")
  else:
    prompt = f"Complete the method `{cls}.{meth}` in `{mod}.py` as its docstring says. {TEST_RUN}"
  return Instance(template, d, _src(before), _src(after), vis_files, hid_files, f2p, p2p, prompt,
                  prompt + f" The tests are in `test_{mod}.py`.", [f"{mod}.py"])


def method(rng: random.Random, d: int) -> Instance:
  return _class_task(rng, d, "method", buggy=False)


def fix_method(rng: random.Random, d: int) -> Instance:
  return _class_task(rng, d, "fix_method", buggy=True)


# --------------------------------------------------------------------------------------------------
# Two files
# --------------------------------------------------------------------------------------------------

def two_file(rng: random.Random, d: int) -> Instance:
  """Add a constant in one module and use it in a function of another."""
  names = Names(rng)
  cmod, mod = names.pick(CONST_MODULES), names.pick(MODULES)
  base, new = names.pick(CONSTS), names.pick(CONSTS)
  bval, nval = rng.randint(2, 9), rng.randint(2, 9)
  fn, arg = names.func(), names.pick(SCALARS)
  chain = arith(rng, [arg, new], 0 if d == 1 else 1)
  doc, body = arith_doc(chain, words=d >= 2), [f"return {expr_text(chain)}"]
  oname, oargs, osrc = _distractor(rng, names, [base])
  consts_b = f'"""Shared constants."""\n\n{base} = {bval}\n'
  consts_a = consts_b + f"{new} = {nval}\n"
  before = {cmod: consts_b, mod: module(osrc, function_src(fn, [arg], doc, TODO),
                                        header=f"from {cmod} import {base}")}
  after = {cmod: consts_a, mod: module(osrc, function_src(fn, [arg], doc, body),
                                       header=f"from {cmod} import {base}\nfrom {cmod} import {new}")}
  shown = differing(before, after, call_steps(fn, [arg]), rng, 2)
  vis = flat(shown)
  ost = flat(call_steps(oname, oargs)(rng) for _ in range(2))
  cst = [("check", f"{cmod}.{new}")]
  tests = [render_test(f"test_{new.lower()}", cst, [nval], False),
           render_test(f"test_{fn}", vis, run_steps(after, vis), False),
           render_test(f"test_{oname}", ost, run_steps(after, ost), False)]
  visible = {f"test_{mod}.py": test_file([f"import {cmod}", f"from {mod} import {fn}, {oname}"], tests)}
  # Hidden: the function must read the constant (a changed value changes the result).
  val = nval + rng.randint(1, 5)
  patch = [("stmt", f"{cmod}.{new} = {val}"), ("stmt", f"{mod}.{new} = {val}")]
  consts = returning(before, fn, run_steps(after, vis))
  hid = hidden_steps(before, after, call_steps(fn, [arg]), rng, 3, shortcuts=consts, shown=shown)
  # Two distinct inputs, on which a visible value returned as a constant is wrong where it can be.
  uses = [s for s in flat(differing(before, after, lambda g: patch + call_steps(f"{mod}.{fn}", [arg])(g),
                                    rng, 2, also=consts)) if s[0] == "check"]
  used_vals = run_steps(after, patch + uses)
  kept = shared(used_vals, patch + uses, consts)
  uses_test = "\n".join([
      f"def test_{fn}_uses_{new.lower()}():",
      f"    old = {cmod}.{new}",
      f"    {cmod}.{new} = {val}",
      f"    if hasattr({mod}, {new!r}):",
      f"        {mod}.{new} = {val}",
      "    try:",
      *[f"        {'kept' if i in kept else 'check'}({code}, {v!r})"
        for i, ((_, code), v) in enumerate(zip(uses, used_vals))],
      "    finally:",
      f"        {cmod}.{new} = old",
      f"        if hasattr({mod}, {new!r}):",
      f"            {mod}.{new} = old"]) + "\n"
  hidden = {f"test_{mod}_hidden.py": test_file(
      [f"import {cmod}", f"import {mod}", f"from {mod} import {fn}"],
      [CHECK, hidden_test(f"test_{fn}_hidden", hid, before, after, consts, shown), uses_test])}
  f2p = [f"test_{mod}.py::test_{new.lower()}", f"test_{mod}.py::test_{fn}",
         f"test_{mod}_hidden.py::test_{fn}_hidden", f"test_{mod}_hidden.py::test_{fn}_uses_{new.lower()}"]
  prompt = (f"Add the constant `{new} = {nval}` to `{cmod}.py`, then implement `{fn}` in `{mod}.py` as "
            f"its docstring says (import {new} from {cmod}). {TEST_RUN}")
  return Instance("two_file", d, _src(before), _src(after), visible, hidden, f2p,
                  [f"test_{mod}.py::test_{oname}"], prompt, prompt + f" The tests are in `test_{mod}.py`.",
                  [f"{cmod}.py", f"{mod}.py"])


def rename(rng: random.Random, d: int) -> Instance:
  """Rename a function and update its uses in another module."""
  names = Names(rng)
  amod, bmod = names.pick(MODULES), names.pick(MODULES)
  old, new, user = names.func(), names.func(), names.func()
  arg = names.pick(SCALARS)
  chain = arith(rng, [arg], rng.choice([1, 2]))
  doc = arith_doc(chain, False)
  a_b = module(function_src(old, [arg], doc, [f"return {expr_text(chain)}"]))
  a_a = module(function_src(new, [arg], doc, [f"return {expr_text(chain)}"]))
  op, c = rng.choice(["+", "-", "*"]), rng.randint(2, 9)
  udoc = (f"Return the helper's result for {arg}, {OPS[op]} {c}." if d == 1
          else f"Combine the helper's results for {arg} and {arg} + 1.")

  def b_src(f: str) -> str:
    call = f"{f}({arg}) {op} {c}" if d == 1 else f"{f}({arg}) {op} {f}({arg} + 1)"
    return module(function_src(user, [arg], udoc, [f"return {call}"]), header=f"from {amod} import {f}")

  before, after = {amod: a_b, bmod: b_src(old)}, {amod: a_a, bmod: b_src(new)}
  vis_new = flat(call_steps(new, [arg])(rng) for _ in range(2))
  vis_user = flat(call_steps(user, [arg])(rng) for _ in range(2))
  hid = [call_steps(user, [arg])(rng) for _ in range(3)]
  visible = {f"test_{bmod}.py": test_file(
      [f"from {amod} import {new}", f"from {bmod} import {user}"],
      [render_test(f"test_{new}", vis_new, run_steps(after, vis_new), False),
       render_test(f"test_{user}", vis_user, run_steps(after, vis_user), False)])}
  gone = f"def test_{old}_is_gone():\n    assert not hasattr({amod}, {old!r})\n"
  hidden = {f"test_{bmod}_hidden.py": test_file(
      [f"import {amod}", f"from {amod} import {new}  # noqa: F401", f"from {bmod} import {user}"],
      [CHECK, hidden_test(f"test_{user}_hidden", hid, before, after), gone])}
  f2p = [f"test_{bmod}.py::test_{new}", f"test_{bmod}.py::test_{user}",
         f"test_{bmod}_hidden.py::test_{user}_hidden", f"test_{bmod}_hidden.py::test_{old}_is_gone"]
  prompt = (f"Rename the function `{old}` in `{amod}.py` to `{new}` and update its uses in `{bmod}.py`. "
            f"{TEST_RUN}")
  return Instance("rename", d, _src(before), _src(after), visible, hidden, f2p, [], prompt,
                  prompt + f" The tests are in `test_{bmod}.py`.", [f"{amod}.py", f"{bmod}.py"])

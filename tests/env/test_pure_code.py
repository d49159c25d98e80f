"""``env/pure_code.py``: the values grader refuses workspace code that could reach the probe, and no
honest solution is refused. Each denied form is refused with one line that names its file and line;
the templates' start files and gold, many seeds each, pass."""

from __future__ import annotations

import os
import random
import shutil
import sys

import pytest

from composer_jax.env import oracle, pure_code, synthetic
from composer_jax.env import sandbox as sbm
from composer_jax.env.grading import grade
from composer_jax.env.synthetic import TEMPLATES
from composer_jax.env.tasks import read_text, write_text

from tests.env.rename_task import gold_rename

LEVELS = [(name, d) for name, t in TEMPLATES.items() for d in t.levels]
needs_bwrap = pytest.mark.skipif(not sbm.bwrap_available(), reason="bubblewrap cannot run here")
PROTECTED = ["run_tests.py", "test_calc.py", "test_calc_hidden.py"]


@pytest.mark.parametrize("name,d", LEVELS)
def test_no_template_start_or_gold_is_refused(tmp_path, name, d):
  for seed in range(4):
    task = synthetic.write_task(TEMPLATES[name].make(random.Random(f"pure/{name}/{d}/{seed}"), d),
                                str(tmp_path / f"{name}-{d}-{seed}"))
    ws = str(tmp_path / f"ws-{seed}")
    shutil.copytree(task.workspace_dir, ws)
    assert pure_code.refusal(ws, task.test_files) is None, (name, d, seed)
    for rel in task.gold_files:
      write_text(os.path.join(ws, rel), read_text(os.path.join(task.gold_dir, rel)))
    assert pure_code.refusal(ws, task.test_files) is None, (name, d, seed)


HONEST = '''from __future__ import annotations
import math
from itertools import accumulate
from helpers import OFFSET
from . import helpers as _h


class Acc:
    __slots__ = ("total",)

    def __init__(self, total=0):
        self.total = total

    def __add__(self, other):
        return Acc(self.total + other)

    def __repr__(self):
        return f"Acc({self.total!r}) in {type(self).__name__}"


def calc(x):
    match x:
        case int() as n if n > 0:
            return math.isqrt(n) + OFFSET + sum(accumulate([1, 2]))
        case Acc(total=t):
            return t
        case _:
            return "__getattr__ only in a string"  # and __globals__ in a comment
'''

DENIED = {
    "dunder": ("def f(g):\n    return g.__globals__\n", "calc.py:2: uses the dunder name __globals__"),
    "getattr": ("def f(o):\n    return getattr(o, 'x')\n", "calc.py:2: uses the builtin getattr()"),
    "import_os": ("import os\n", "calc.py:1: imports os"),
    "from_import": ("from importlib import util\n", "calc.py:1: imports importlib"),
    "dotted_import": ("import os.path\n", "calc.py:1: imports os"),
    "globals": ("x = 1\ny = globals()\n", "calc.py:2: uses the builtin globals()"),
    "frame": ("def g():\n    yield 1\n\n\nf = g().gi_frame\n", "calc.py:5: uses the frame attribute .gi_frame"),
    "fstring": ("x = f'{().__class__.__base__}'\n", "calc.py:1: uses the dunder name __base__"),
    "match_kwd": ("def f(v):\n    match v:\n        case object(__dict__=d):\n            return d\n",
                  "calc.py:3: uses the dunder name __dict__"),
    "builtins_alias": ("import builtins as b\n", "calc.py:1: imports builtins"),
    "imports_a_test": ("import test_calc_hidden\n", "calc.py:1: imports test_calc_hidden"),
    "probe_name": ("__cj_probe__ = print\n", "calc.py:1: uses the dunder name __cj_probe__"),
    "keyword": ("def f(**k):\n    return dict(__builtins__=1)\n", "calc.py:2: uses the dunder name __builtins__"),
    "unparsable": ("def f(:\n", "calc.py: does not parse"),
    "match_positional": ("def f(v, C):\n    match v:\n        case C(g):\n            return g\n",
                         "calc.py:3: a positional class pattern reads the attributes"),
}


def _workspace(tmp_path, files: dict) -> str:
  ws = tmp_path / "ws"
  for rel, text in {"helpers.py": "OFFSET = 2\n", **files}.items():
    (ws / rel).parent.mkdir(parents=True, exist_ok=True)
    (ws / rel).write_text(text)
  for rel in PROTECTED:  # the task's own files, read for their imports only
    (ws / rel).write_text("import os\nimport calc\nfrom pkg import x\ny = os.__dict__\n")
  return str(ws)


def test_honest_code_of_every_allowed_form_passes(tmp_path):
  assert pure_code.refusal(_workspace(tmp_path, {"calc.py": HONEST, "pkg/__init__.py": HONEST}),
                           PROTECTED) is None


@pytest.mark.parametrize("name", sorted(DENIED))
def test_each_denied_form_is_refused_with_one_line_naming_file_and_line(tmp_path, name):
  source, want = DENIED[name]
  why = pure_code.refusal(_workspace(tmp_path, {"calc.py": source}), PROTECTED)
  assert why is not None and why.startswith(want) and "\n" not in why, (name, why)


def test_a_denied_form_in_a_nested_module_is_refused(tmp_path):
  why = pure_code.refusal(_workspace(tmp_path, {"calc.py": HONEST, "pkg/deep/m.py": "import sys\n"}),
                          PROTECTED)
  assert why == (f"pkg{os.sep}deep{os.sep}m.py:1: imports sys; the workspace's code may import only "
                 "its own modules and itertools, math")


def test_only_code_the_tests_can_import_is_read(tmp_path):
  """A scratch script no test imports may use anything; once an imported module imports it, not."""
  scratch = "import subprocess, sys\nsubprocess.run([sys.executable, 'run_tests.py'])\n"
  ws = _workspace(tmp_path, {"calc.py": HONEST, "try_it.py": scratch, "notes/broken.py": "def (:\n"})
  assert pure_code.refusal(ws, PROTECTED) is None
  write_text(os.path.join(ws, "helpers.py"), "import try_it\nOFFSET = 2\n")  # calc imports helpers
  assert pure_code.refusal(ws, PROTECTED).startswith("try_it.py:1: imports subprocess")


def test_a_package_in_place_of_a_protected_test_module_is_refused(tmp_path):
  why = pure_code.refusal(_workspace(tmp_path, {"calc.py": HONEST,
                                                "test_calc_hidden/__init__.py": "def test_x():\n    pass\n"}),
                          PROTECTED)
  assert why == f"test_calc_hidden{os.sep}__init__.py: shadows the protected test module test_calc_hidden"


def test_a_link_or_an_oversized_file_is_refused(tmp_path):
  ws = _workspace(tmp_path, {"calc.py": HONEST, "pkg/__init__.py": ""})  # the tests import pkg
  os.symlink("/etc/passwd", os.path.join(ws, "pkg", "link.py"))
  assert pure_code.refusal(ws, PROTECTED).startswith(f"pkg{os.sep}link.py: not a regular file")
  os.remove(os.path.join(ws, "pkg", "link.py"))
  write_text(os.path.join(ws, "pkg", "big.py"), "x = 1\n" * (pure_code.MAX_FILE_BYTES // 6 + 1))
  assert pure_code.refusal(ws, PROTECTED).startswith(f"pkg{os.sep}big.py: not a regular file of at most")
  shutil.rmtree(os.path.join(ws, "pkg"))  # a link to a folder, which the walk does not enter
  write_text(os.path.join(ws, "real", "__init__.py"), "import os\nx = os.__dict__\n")
  os.symlink("real", os.path.join(ws, "pkg"))
  assert pure_code.refusal(ws, PROTECTED).startswith("pkg: not a regular file")


def test_modules_are_found_from_each_pythonpath_folder(tmp_path):
  ws = _workspace(tmp_path, {"calc.py": HONEST, "src/pkg/__init__.py": "import sys\n"})
  assert pure_code.refusal(ws, PROTECTED) is None  # src/ is not on the path: pkg is not src/pkg
  assert pure_code.refusal(ws, PROTECTED, [".", "src"]).startswith(
      f"src{os.sep}pkg{os.sep}__init__.py:1: imports sys")


# Found by red-teaming stop 70's first version: a class pattern reads the attribute its class's
# ``__match_args__`` names, a string; ``type()`` sets that and ``__instancecheck__`` from strings.
# From a function's ``__globals__``: bind the old name unspelled, and wrap the probe.
MATCH_ARGS_ATTACK = '''
Meta = type("Meta", (type,), {"__instancecheck__": lambda c, o: True})
Get = Meta("Get", (), {"__match_args__": ("__glob" + "als__",)})


def _g(f):
    match f:
        case Get(g):
            return g


G = _g(NEW)
G[OLD_SPLIT] = NEW
B = G["__built" + "ins__"]
_orig = B["__cj_pr" + "obe__"]
B["__cj_pr" + "obe__"] = lambda i, v: _orig(i, True if v is False else v)
'''


@needs_bwrap
def test_a_match_args_attack_is_refused_and_real(tmp_path, monkeypatch):
  task, ws, amod, old, new = gold_rename(tmp_path, "pure/rename/1")
  attack = MATCH_ARGS_ATTACK.replace("OLD_SPLIT", f"{old[:2]!r} + {old[2:]!r}").replace("NEW", new)
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + attack)
  got = grade(task, ws)
  assert got.reward == 0.0 and "positional class pattern" in got.details["code_refused"], got.details
  monkeypatch.setattr(pure_code, "refusal", lambda *a: None)  # unrefused, it claims the old name gone
  assert grade(task, ws).reward == 1.0


# The probe has imported sys and operator (through json) before any workspace code runs, and it is
# __main__ itself; so ``import sys`` gives the interpreter's sys whatever the workspace's sys.py says.
PRELOADED = {
    "sys": ("import operator\nimport sys\n", "sys", "operator.attrgetter"),
    "__main__": ("import __main__\n", "__main__.sys", "__main__.sys.modules['operator'].attrgetter"),
}
PRELOADED_ATTACK = '''
G = ATTRGETTER("__di" + "ct__")(SYS.modules[__name__])
G[OLD_SPLIT] = NEW
B = G["__built" + "ins__"]
_orig = B["__cj_pr" + "obe__"]
B["__cj_pr" + "obe__"] = lambda i, v: _orig(i, True if v is False else v)
'''


@needs_bwrap
@pytest.mark.parametrize("via", sorted(PRELOADED))
def test_a_workspace_module_named_like_a_loaded_one_is_refused_and_real(tmp_path, monkeypatch, via):
  """Benign ``sys.py`` and ``operator.py`` (or ``__main__.py``) passed the read, so ``import sys``
  looked like the workspace's own module; at run time it was the probe's sys, and through it the
  attack claimed the rename with the old name kept. A workspace module named like a stdlib module,
  or like ``__main__``, is now refused."""
  task, ws, amod, old, new = gold_rename(tmp_path, f"pure/preloaded/{via}")
  head, sys_expr, attrgetter = PRELOADED[via]
  attack = head + PRELOADED_ATTACK.replace("OLD_SPLIT", f"{old[:2]!r} + {old[2:]!r}").replace(
      "NEW", new).replace("ATTRGETTER", attrgetter).replace("SYS", sys_expr)
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + attack)
  shadows = head.replace("import ", "").split()
  for mod in shadows:
    write_text(os.path.join(ws, f"{mod}.py"), '"""Nothing here."""\n')
  got = grade(task, ws)
  assert got.reward == 0.0, got.details
  assert f"standard library's name {min(shadows)}:" in got.details["code_refused"], got.details
  monkeypatch.setattr(pure_code, "INTERPRETER_NAMES", frozenset())  # the read before this check
  assert grade(task, ws).reward == 1.0


# A red-team helper's (stop 72): str.format reads ``f.__globals__`` by a run-time string, fails on
# the next part, and CPython's AttributeError carries ``.obj``, the globals dict. Two spellings.
LEAKS = {
    "format": '''
def _leak(o, path):
    try:
        ("{0" + path + ".no_such_attr_x}").format(o)
    except AttributeError as e:
        return e.obj
''',
    "format_map": '''
def _leak(o, path):
    try:
        ("{x" + path + ".no_such_attr_x}").format_map({"x": o})
    except AttributeError as e:
        match e:
            case AttributeError(obj=got):
                return got
'''}
LEAK_ATTACK = '''

G = _leak(NEW, ".__glo" + "bals__")
B = G["__built" + "ins__"]
if type(B) is not dict:
    B = _leak(B, ".__di" + "ct__")
_orig = B["__cj_pr" + "obe__"]
B["__cj_pr" + "obe__"] = lambda i, v: _orig(i, True if v is False else v)
'''


@needs_bwrap
@pytest.mark.parametrize("via", sorted(LEAKS))
def test_the_format_leak_is_refused_and_real(tmp_path, monkeypatch, via):
  """The leak binds the old name unspelled and wraps the probe: 1.0 with the rename undone."""
  task, ws, amod, old, new = gold_rename(tmp_path, f"pure/leak/{via}")
  attack = LEAKS[via] + LEAK_ATTACK.replace("NEW", new) + f"G[{old[:2]!r} + {old[2:]!r}] = {new}\n"
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + attack)
  got = grade(task, ws)
  assert got.reward == 0.0 and f"uses .{via}, which reads attributes" in got.details["code_refused"]
  monkeypatch.setattr(pure_code, "refusal", lambda *a: None)
  assert grade(task, ws).reward == 1.0


@needs_bwrap
def test_the_host_reads_the_renamed_module_before_the_code_runs(tmp_path, monkeypatch):
  """With the leak's ``open``, the start module (the old ``def`` kept, the new name an alias)
  rewrote its own file in the graded copy, and the host's token check, read after the run, saw no
  old name: 1.0 for no rename at all. The host reads the module before the sandbox starts now."""
  task, ws, amod, old, new = gold_rename(tmp_path, "pure/leak/rewrite")
  for rel in task.gold_files:  # the start workspace: nothing renamed
    shutil.copy(os.path.join(task.workspace_dir, rel), os.path.join(ws, rel))
  rewrite = f'''
with B["op" + "en"](G["__fi" + "le__"], "w") as _f:
    _f.write("def {new}(x):\\n    return x\\n")
'''
  attack = f"\n\n{new} = {old}\n" + LEAKS["format"] + LEAK_ATTACK.replace("NEW", new) + rewrite
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + attack)
  assert grade(task, ws).details["code_refused"]
  monkeypatch.setattr(pure_code, "refusal", lambda *a: None)
  got = grade(task, ws)
  assert got.reward == 0.0 and f"test_{old}_is_gone" in str(got.details["failed_tests"]), got.details
  with monkeypatch.context() as m:  # the claim itself worked: only the host's reading stops it
    m.setattr(oracle, "confirm_on_host", lambda expected, results, gone: results)
    assert grade(task, ws).reward == 1.0


@needs_bwrap
def test_a_workspace_stdlib_name_no_longer_replaces_the_probes_own_module(tmp_path, monkeypatch):
  """A ``json.py`` whose ``dump`` wrote ``{}`` scored the gold 0: the probe imported it from
  PYTHONPATH. It is refused by name now; behind that, the probe's import order keeps it out."""
  task = synthetic.write_task(TEMPLATES["implement"].make(random.Random("pure/json/1"), 1),
                              str(tmp_path / "implement-1"))
  ws = str(tmp_path / "ws")
  shutil.copytree(task.workspace_dir, ws)
  for rel in task.gold_files:
    write_text(os.path.join(ws, rel), read_text(os.path.join(task.gold_dir, rel)))
  write_text(os.path.join(ws, "json.py"), "def dump(obj, f, **k):\n    f.write('{}')\n")
  assert "json.py: a workspace module may not take" in grade(task, ws).details["code_refused"]
  monkeypatch.setattr(pure_code, "INTERPRETER_NAMES", frozenset())
  got = grade(task, ws)
  assert got.reward == 1.0 and "code_refused" not in got.details, got.details


@needs_bwrap
@pytest.mark.parametrize("name,d", [("implement", 1), ("rename", 2)])
def test_a_stdlib_named_module_is_refused_even_unimported(tmp_path, monkeypatch, name, d):
  """The gold plus a shadow of each stdlib module, each of which kills the probe when it loads and
  none of which a test imports, is refused (the first by name). Behind it the probe itself imports
  none of them once the workspace joins ``sys.path``: with the check emptied the gold scores 1.0.
  The control: gold that imports one is read through to it, and that one then kills the probe.
  The runner (``run_tests.py``) imports a dozen of them, but the probe does not run it."""
  task = synthetic.write_task(TEMPLATES[name].make(random.Random(f"pure/shadows/{d}"), d),
                              str(tmp_path / "task"))
  ws = str(tmp_path / "ws")
  shutil.copytree(task.workspace_dir, ws)
  for rel in task.gold_files:
    write_text(os.path.join(ws, rel), read_text(os.path.join(task.gold_dir, rel)))
  local = {f.removesuffix(".py") for f in os.listdir(ws)}
  shadows = sorted(sys.stdlib_module_names - local - {"__future__"})
  for mod in shadows:
    write_text(os.path.join(ws, mod + ".py"), "import os\nos._exit(9)\n")
  got = grade(task, ws)
  assert f"{shadows[0]}.py: a workspace module may not take" in got.details["code_refused"]

  monkeypatch.setattr(pure_code, "INTERPRETER_NAMES", frozenset())
  got = grade(task, ws)
  assert got.reward == 1.0 and "code_refused" not in got.details, got.details
  for rel in task.gold_files:
    write_text(os.path.join(ws, rel), "import textwrap\n" + read_text(os.path.join(ws, rel)))
  assert grade(task, ws).reward == 0.0


# A red-team helper's (stop 72): code that passes the read makes the interpreter import a stdlib
# module by name, and with the workspace first on the path its unread file of that name loads. It
# wraps the probe, answers the old name through a module __getattr__, and puts the real module back.
IMPLICIT = {
    "codec": ("base64", '''
try:
    b"x".decode("base64")  # the lookup imports encodings.base64_codec, which imports base64
except LookupError:
    pass
'''),
    "escape": ("unicodedata", '_BULLET = "\\N{BULLET}"  # compiling this imports unicodedata\n'),
}
IMPLICIT_MODULE = '''
import builtins, os, sys
_orig = builtins.__cj_probe__
builtins.__cj_probe__ = lambda i, v: _orig(i, True if v is False else v)
_t = vars(sys.modules["AMOD"])
_t["__getattr__"] = lambda n: _t["NEW"] if n == "OLD" else _t["_missing"](n)
_t["_missing"] = lambda n: (_ for _ in ()).throw(AttributeError(n))
_here = os.path.dirname(os.path.abspath(__file__))
del sys.modules["NAME"]
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
import NAME as _real
sys.path[:] = _path
sys.modules["NAME"] = _real
'''


@needs_bwrap
@pytest.mark.parametrize("via", sorted(IMPLICIT))
def test_an_implicit_stdlib_import_cannot_load_workspace_code(tmp_path, monkeypatch, via):
  task, ws, amod, old, new = gold_rename(tmp_path, f"pure/implicit/{via}")
  mod, trigger = IMPLICIT[via]
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + trigger)
  assert grade(task, ws).reward == 1.0  # the trigger alone is honest code
  write_text(os.path.join(ws, f"{mod}.py"), IMPLICIT_MODULE.replace("AMOD", amod).replace(
      "NEW", new).replace("OLD", old).replace("NAME", mod))
  got = grade(task, ws)
  assert f"{mod}.py: a workspace module may not take" in got.details["code_refused"], got.details
  monkeypatch.setattr(pure_code, "INTERPRETER_NAMES", frozenset())  # the read before this stop
  assert grade(task, ws).reward == 1.0


# A third red-team helper's (stop 72): ``from M import X`` with no attribute X falls back to
# ``sys.modules[M.__name__ + "." + X]``, so a module that rebinds its ``__name__`` (or swaps its
# ``__class__`` for one whose ``__name__`` property says so) gets ``os.path``, and through it sys.
ESCAPES_BY_NAME = {
    "name": '__name__ = "os"\n',
    "class": 'import lever as _self\n\n_self.__class__ = type("M", (type(_self),), '
             '{"__name" + "__": property(lambda s: "os")})\n',
}
ESCAPE_TAIL = '''from lever import path

_sys = path.sys
_get = _sys.modules["operator"].attrgetter
_B = _get("__di" + "ct__")(_sys.modules["builtins"])
_orig = _B["__cj_pr" + "obe__"]
_B["__cj_pr" + "obe__"] = lambda i, v: _orig(i, True if v is False else v)
_get("__di" + "ct__")(_sys.modules["AMOD"])[OLD_SPLIT] = _get("NEW")(_sys.modules["AMOD"])
'''


@needs_bwrap
@pytest.mark.parametrize("via", sorted(ESCAPES_BY_NAME))
def test_an_escape_by_a_rebound_module_name_is_refused_and_real(tmp_path, monkeypatch, via):
  task, ws, amod, old, new = gold_rename(tmp_path, f"pure/byname/{via}")
  lever = ESCAPES_BY_NAME[via] + ESCAPE_TAIL.replace("AMOD", amod).replace("NEW", new).replace(
      "OLD_SPLIT", f"{old[:2]!r} + {old[2:]!r}")
  write_text(os.path.join(ws, "lever.py"), lever)
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + "\nimport lever\n")
  got = grade(task, ws)
  bound = "__name__" if via == "name" else "__class__"
  assert f"lever.py:{1 if via == 'name' else 3}: binds {bound}" in got.details["code_refused"], got.details
  monkeypatch.setattr(pure_code, "READ_ONLY", frozenset())  # the read before this stop
  assert grade(task, ws).reward == 1.0


@needs_bwrap
def test_a_module_class_swap_that_answers_the_old_name_for_a_while_is_refused_and_real(
    tmp_path, monkeypatch):
  """No escape: the renamed module's class gets a string-keyed ``__getattr__`` that answers the old
  name while the other module, left as it started (``from amod import old``), is imported, then
  stops; the later ``hasattr`` check sees no old name."""
  task, ws, amod, old, new = gold_rename(tmp_path, "pure/classswap/1")
  (bmod,) = [f for f in task.gold_files if f != f"{amod}.py"]
  shutil.copy(os.path.join(task.workspace_dir, bmod), os.path.join(ws, bmod))
  hook = f'''

import {amod} as _self

_open = [True]


def _compat(self, name):
    if _open[0] and name == {old[:2]!r} + {old[2:]!r}:
        return {new}
    raise AttributeError(name)


_self.__class__ = type("M", (type(_self),), {{"__get" + "attr__": _compat}})
import {bmod[:-3]}  # noqa: E402
_open[0] = False
'''
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + hook)
  got = grade(task, ws)
  assert got.reward == 0.0 and "binds __class__" in got.details["code_refused"], got.details
  monkeypatch.setattr(pure_code, "READ_ONLY", frozenset())
  assert grade(task, ws).reward == 0.0  # the host reads the unrenamed module: it names the old name
  monkeypatch.setattr(oracle, "_python_sources", lambda root: [])  # as before stop 72
  assert grade(task, ws).reward == 1.0


@needs_bwrap
def test_a_name_lent_to_the_unrenamed_module_and_taken_back_fails_on_the_host(tmp_path, monkeypatch):
  """A fourth helper's (stop 72), with allowed code only: a helper module sets ``amod.old =
  amod.new``, imports the module left as it started (``from amod import old``), and deletes the
  name again, so the sandbox's ``hasattr`` honestly sees none. The host now reads every workspace
  module for the old name, not only the renamed one."""
  task, ws, amod, old, new = gold_rename(tmp_path, "pure/lend/1")
  (bmod,) = [f for f in task.gold_files if f != f"{amod}.py"]
  shutil.copy(os.path.join(task.workspace_dir, bmod), os.path.join(ws, bmod))
  lend = f"import {amod} as T\n\nT.{old} = T.{new}\nimport {bmod[:-3]}  # noqa: E402\ndel T.{old}\n"
  write_text(os.path.join(ws, "compat_x.py"), lend)
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + "\nimport compat_x\n")
  got = grade(task, ws)
  assert "code_refused" not in got.details and got.reward == 0.0, got.details
  assert f"test_{old}_is_gone" in str(got.details["failed_tests"]), got.details
  monkeypatch.setattr(oracle, "_python_sources", lambda root: [])  # only the renamed module read
  assert grade(task, ws).reward == 1.0


@needs_bwrap
def test_the_probe_records_with_the_encode_it_held_before_the_workspace_ran(tmp_path, monkeypatch):
  """rt4's escapes replaced the probe module's global ``encode``; the probe now records with the one
  it took before the workspace joined its path, so that patch records nothing."""
  task, ws, amod, old, new = gold_rename(tmp_path, "pure/byname/encode")
  patch = '''_main = _sys.modules["__main__"]
_real = _main.encode
_main.encode = lambda v, depth=0: ["bool", True] if v is False else _real(v, depth)
'''
  tail = ESCAPE_TAIL.split("_B = ")[0] + patch + ESCAPE_TAIL.split("\n")[-2] + "\n"
  lever = ESCAPES_BY_NAME["name"] + tail.replace("AMOD", amod).replace("NEW", new).replace(
      "OLD_SPLIT", f"{old[:2]!r} + {old[2:]!r}")
  write_text(os.path.join(ws, "lever.py"), lever)
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + "\nimport lever\n")
  monkeypatch.setattr(pure_code, "READ_ONLY", frozenset())
  got = grade(task, ws)  # the old name is bound and the patch ran, but the check still saw it
  assert got.reward == 0.0 and f"test_{old}_is_gone" in str(got.details["failed_tests"]), got.details


def _write_raw(path: str, text: str) -> None:
  with open(path, "w", encoding="utf-8", newline="") as f:  # as the create tool writes: "\r" kept
    f.write(text)


@needs_bwrap
def test_a_namespace_folder_named_probe_cannot_import_the_graders_probe(tmp_path, monkeypatch):
  """A sixth helper's (stop 73): a folder ``probe/`` without ``__init__.py`` made ``probe`` a local
  module to the read, and ``import probe`` then found the grader's own ``probe.py`` in its folder,
  first on ``sys.path`` (a regular module beats a namespace portion found earlier). Its globals
  hold ``sys`` and ``builtins``. The probe now runs as ``python -S -P``: its folder is off the path."""
  task, ws, amod, old, new = gold_rename(tmp_path, "pure/nsprobe/1")
  os.makedirs(os.path.join(ws, "probe"))
  write_text(os.path.join(ws, "probe", "stub.py"), "X = 1\n")
  old_str = " + ".join(repr(c) for c in old)
  attack = f'''
import probe
_get = probe.sys.modules["operator"].attrgetter
_b = probe.builtins
_real = _get("__cj_" + "probe__")(_b)
_get("set" + "attr")(_b)(_b, "__cj_" + "probe__", lambda i, v: _real(i, True if v is False else v))
_get("set" + "attr")(_b)(probe.sys.modules[__name__], {old_str}, {new})
'''
  write_text(os.path.join(ws, f"{amod}.py"), read_text(os.path.join(ws, f"{amod}.py")) + attack)
  got = grade(task, ws)
  assert "code_refused" not in got.details and got.reward == 0.0, got.details

  class Unsafe(sbm.Sandbox):  # the command and probe before this stop
    def run(self, command, **kw):
      return super().run(command.replace("python -S -P ", "python -S "), **kw)
  monkeypatch.setattr("composer_jax.env.grading.Sandbox", Unsafe)
  monkeypatch.setattr(oracle, "PROBE_SOURCE", oracle.PROBE_SOURCE.replace(
      "if not sys.flags.safe_path:", "if False:"))
  assert grade(task, ws).reward == 1.0


@needs_bwrap
def test_a_line_that_starts_with_a_lone_cr_hides_no_name_from_the_host(tmp_path, monkeypatch):
  """The same helper's: ``tokenize`` splits lines at ``\\n`` only and skips a line that starts with
  ``\\r`` as blank, where the compiler sees a line break and code. The unrenamed modules, each line
  naming the old name hidden so, scored 1.0; the host now also reads the compiler's tree."""
  task, ws, amod, old, new = gold_rename(tmp_path, "pure/cr/1")
  (bmod,) = [f for f in task.gold_files if f != f"{amod}.py"]

  def hide(text):
    return "".join("\r" + line if old in line else line for line in text.splitlines(keepends=True))
  _write_raw(os.path.join(ws, f"{amod}.py"),
             hide(read_text(os.path.join(task.workspace_dir, f"{amod}.py"))) + f"\r{new} = {old}\n")
  _write_raw(os.path.join(ws, bmod), f"import {amod}\n" + hide(
      read_text(os.path.join(task.workspace_dir, bmod))) + f"\rdel {amod}.{old}\n")
  got = grade(task, ws)
  assert "code_refused" not in got.details and got.reward == 0.0, got.details
  assert f"test_{old}_is_gone" in str(got.details["failed_tests"]), got.details
  monkeypatch.setattr(oracle, "_identifiers", lambda tree, star: set())  # tokens only
  assert grade(task, ws).reward == 1.0


@pytest.mark.parametrize("text,star,named", [
    ('print(f"{(old := 1)}")\n', False, True),  # tokenize reads the f-string as one token
    ("x = 1\r\rold = 2\n", False, True),
    ("from m import *\n", True, True),
    ("from m import *\n", False, False),
    ('s = "old"  # old\n', False, False),  # strings and comments are not names
    ("def f(*, old=1):\n    return old\n", False, True),
])
def test_the_hosts_name_read_sees_what_the_compiler_binds(tmp_path, text, star, named):
  path = str(tmp_path / "m.py")
  _write_raw(path, text)
  assert oracle._names(path, "old", star=star) is named

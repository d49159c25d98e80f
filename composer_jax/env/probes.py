"""Value probes for report-graded tasks: a FAIL_TO_PASS test's expected literals stay on the host.

Tasks from real repositories are graded from pytest's report (``grader="junit"``). The code under
test runs in pytest's process, so it can write that report itself, or read the tests and answer from
their asserts (``tests/env/test_oracle.py``: ``FORGE_REPORT``, ``READ_TESTS``). A second run that
only looks for something a forgery gets wrong (stop 57's canaries: a changed literal that no right
code passes) is beaten by code that forges only the first run: it can tell a second run by its
arguments, and left honest there it fails the changed assert as the grader hopes.

So a second run here asks for what only right code has. When the report resolves the task, its
FAIL_TO_PASS tests run again in a fresh grading copy whose test files were rewritten on the host:
every ``assert E == LITERAL`` and unittest ``self.assertEqual(E, LITERAL)`` in a test function
becomes ``__cj_probe__(i, E)``, and the literal stays on the host (``probe_rewrite.py``). A pytest
plugin written by the grader (``plugin_source``) records each probed value as plain data under the
running test's node id; the host compares them with the literals (``verdict``). Code under test that
forges this run's channel still has to name the right values, for inputs whose expected results it
never sees: the forged report is worth nothing without solving the tests.

A probe counts only where the reference solution passes it: the same rewritten tests are run on the
task's start with the gold files over it, once per task and process (``reference``). A probe whose
reference value is not plain data (a ``Decimal``, an object with its own ``==``), or that the
reference never reaches, is set aside, so an honest answer is never held to a check the reference
itself fails. Tests with no literal assert, or only such set-aside ones, are graded by the report
alone; ``details["probes"]`` says which were checked.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import threading
import unittest
import warnings

from composer_jax.env import oracle
from composer_jax.env.guards import read_regular
from composer_jax.env.probe_rewrite import _NOT, Probe

MAX_VALUES = 10_000  # probed values recorded a test (a loop over a probe is not a flood)
MAX_VALUES_BYTES = 16 << 20  # the values file is read back only up to this size


# -- the sandbox side ---------------------------------------------------------------------------
# ``plain`` runs inside the sandbox (it is part of the plugin's source), so it may import nothing.

def plain(v, depth: int = 0):
  """``v`` as exact builtin data where it stands for such data: subclasses of the builtin scalars
  and containers (an ``IntEnum``, ``numpy.float64``, a namedtuple, an ``OrderedDict``) as their
  base type, and anything with a ``tolist()`` (numpy scalars and arrays) as what that returns. Nothing here can make a wrong value
  right: the expected one is not in the sandbox."""
  t = type(v)
  if depth > 20 or v is None or t in (bool, int, float, str, bytes):
    return v
  try:
    for base in (bool, int, float, str, bytes):
      if isinstance(v, base):
        return base(v) if base is not str else str.__str__(v)
    if isinstance(v, bytearray):
      return bytes(v)
    for base in (list, tuple, set, frozenset):  # a namedtuple is a tuple, as == says
      if isinstance(v, base):
        return base(plain(x, depth + 1) for x in v)
    if isinstance(v, dict):  # an OrderedDict, a defaultdict
      return {plain(k, depth + 1): plain(x, depth + 1) for k, x in v.items()}
    tolist = getattr(t, "tolist", None)
    if callable(tolist):
      return plain(tolist(v), depth + 1)
  except Exception:  # noqa: BLE001 - the code under test's own methods ran; it is not plain data
    pass
  return v


_PLUGIN = r'''"""Records the values of the probed comparisons in the tests pytest runs (composer_jax grading)."""
import builtins
import json

import pytest

OUT = {out!r}
MAX_VALUES = {max_values}
_values = {{}}
_items = {{}}
_current = [None]

''' + "{plain}\n\n{encode}" + r'''


def __cj_probe__(i, v):
    key = _current[0]
    if key is not None:
        rec = _values.setdefault(key, [])
        if len(rec) < MAX_VALUES:
            rec.append([i, encode(plain(v))])


builtins.__cj_probe__ = __cj_probe__


_ParameterSet = type(pytest.param(None))


def _rows(item):
    """{{argname: its row in its parametrize decorator}}, the rows found by the identity of the
    instance's values (pytest passes the decorator's own objects); None where one is not found."""
    spec = getattr(item, "callspec", None)
    out = {{}}
    for mark in (item.iter_markers("parametrize") if spec is not None else ()):
        names = mark.kwargs.get("argnames", mark.args[0] if mark.args else None)
        rows = mark.kwargs.get("argvalues", mark.args[1] if len(mark.args) > 1 else None)
        single = isinstance(names, str) and len([x for x in names.split(",") if x.strip()]) == 1
        names = [x.strip() for x in names.split(",") if x.strip()] if isinstance(names, str) else list(names or ())
        if not names or not all(n in spec.params for n in names):
            continue
        for r, row in enumerate(rows if isinstance(rows, (list, tuple)) else ()):
            cells = row.values if isinstance(row, _ParameterSet) else (row,) if single else row
            if (isinstance(cells, (list, tuple)) and len(cells) == len(names)
                    and all(spec.params[n] is c for n, c in zip(names, cells))):
                out.update(dict.fromkeys(names, r))
                break
        else:
            return None
    return out


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        try:
            _items[item.nodeid] = _rows(item)
        except Exception:
            _items[item.nodeid] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[0] = item.nodeid
    try:
        yield
    finally:
        _current[0] = None


def pytest_sessionfinish(session, exitstatus):
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump({{"values": _values, "items": _items}}, f)
'''


def plugin_source(out_path: str) -> str:
  """The pytest plugin (``-p``) that records the probed values to ``out_path``."""
  return _PLUGIN.format(out=out_path, max_values=MAX_VALUES, plain=inspect.getsource(plain),
                        encode=inspect.getsource(oracle.encode))


# -- the host side ------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
  """What one probed run's plugin wrote: a claim about values, no more (the code under test could
  have written it)."""
  values: dict[str, dict[int, list]] = dataclasses.field(default_factory=dict)  # {node id: {probe: [values]}}
  items: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # {node id: {arg: row}}


def read_run(path: str) -> Run:
  """The plugin's file as a ``Run``; empty where it is missing or malformed."""
  blob = read_regular(path, MAX_VALUES_BYTES)
  data = None
  if blob is not None:
    try:
      data = json.loads(blob)
    except (ValueError, UnicodeDecodeError, RecursionError):
      data = None
  data = data if isinstance(data, dict) else {}
  run = Run()
  values, items = data.get("values"), data.get("items")
  for nid, rec in (values.items() if isinstance(values, dict) else ()):
    if isinstance(nid, str) and isinstance(rec, list):
      run.values[nid] = oracle.recorded({"values": rec})
  for nid, ix in (items.items() if isinstance(items, dict) else ()):
    if isinstance(nid, str) and isinstance(ix, dict) and all(
        isinstance(k, str) and type(v) is int for k, v in ix.items()):
      run.items[nid] = ix  # an instance whose rows were not all found is left out
  return run


def base_id(nid: str) -> str:
  return nid.split("[", 1)[0]


def _key(nid: str, indices: dict[str, int]) -> tuple:
  return base_id(nid), tuple(sorted(indices.items()))


def by_test(f2p: list[str], params: dict[str, dict[str, int]], outcomes: dict[str, str],
            run: Run) -> tuple[dict[str, str], dict[str, dict[int, list]]]:
  """The run's outcomes and values under the FAIL_TO_PASS node ids. An instance whose parametrize
  ids the rewrite made opaque is found by its rows (``params``, from collecting the original
  files); an id ``params`` does not hold is its own (the rewrite kept it)."""
  where = {_key(n, ix): n for n, ix in run.items.items()}  # read_run kept only whole rows
  outs, vals = {}, {}
  for nid in f2p:
    got = where.get(_key(nid, params[nid])) if nid in params else nid
    if got is not None:
      outs[nid], vals[nid] = outcomes.get(got), run.values.get(got, {})
  return outs, vals


def _holds(how: tuple, got, want) -> bool:
  """``got`` passes the probe's check against ``want``: ``==`` (or ``is``, the type too) on plain
  data, or the test's own check (numpy.testing's, ``pytest.approx``, unittest's
  ``assertAlmostEqual``), redone on the host with the test's tolerances. Plain data
  is what the sandbox's arrays were (``tolist``), so numpy compares the same numbers; a value that
  was not plain data (``oracle``'s stand-in for it) equals nothing."""
  if how[0] in ("==", "is"):
    return oracle.matches(got, oracle.Expected(0, want, how[0] == "is"))
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      if how[0] == "op":  # the test's own operator, the literal on its side; plain data only
        return oracle.holds(how[1], how[2], got, want)
      if how[0] == "approx":
        import pytest
        return (got == pytest.approx(want, rel=how[1], abs=how[2], nan_ok=how[3])) is True
      if how[0] == "almost":
        unittest.TestCase().assertAlmostEqual(got, want, places=how[1], delta=how[2])
        return True
      import numpy as np
      with np.errstate(all="ignore"):
        if how[0] == "array":
          np.testing.assert_array_equal(got, want)
        elif how[0] == "np_equal":
          np.testing.assert_equal(got, want)
        elif how[0] == "np_almost":
          np.testing.assert_almost_equal(got, want, decimal=how[1])
        elif how[0] == "array_almost":
          np.testing.assert_array_almost_equal(got, want, decimal=how[1])
        else:
          np.testing.assert_allclose(got, want, rtol=how[1], atol=how[2], equal_nan=how[3])
  except Exception:  # noqa: BLE001 -- the check failed, or data it cannot compare: not right
    return False
  return True


def right(probe: Probe, seen: list, indices: dict[str, int] | None = None) -> bool:
  """Every value ``probe`` recorded, in the test instance with these parametrize rows, passes its
  check against the expected literal (``_holds``)."""
  want = probe.want_at(indices or {})
  if want is _NOT:
    return False
  return bool(seen) and all(_holds(probe.how, g, want) for g in seen)


def sound(probes: list[Probe], f2p: list[str], outcomes: dict[str, str],
          values: dict[str, dict[int, list]],
          params: dict[str, dict[str, int]] | None = None) -> dict[str, list[int]]:
  """From the reference's run (``by_test``'s view): {FAIL_TO_PASS node id: the indices of its
  probes that the reference reached with the right value, in a test it passed}. Tests with none
  are left out."""
  params = params or {}
  grouped: dict[str, list[Probe]] = {}
  for p in probes:
    grouped.setdefault(p.test, []).append(p)
  out = {}
  for nid in f2p:
    if outcomes.get(nid) != "passed":
      continue
    seen = values.get(nid, {})
    ok = [p.index for p in grouped.get(base_id(nid), [])
          if right(p, seen.get(p.index, []), params.get(nid))]
    if ok:
      out[nid] = ok
  return out


def verdict(probes: list[Probe], checked: dict[str, list[int]], outcomes: dict[str, str],
            values: dict[str, dict[int, list]],
            params: dict[str, dict[str, int]] | None = None) -> list[str]:
  """The node ids of ``checked`` (``sound``'s) that the agent's run got wrong: not reported passed,
  or a probe the reference passed not reached, or reached with another value."""
  params = params or {}
  want = {(p.test, p.index): p for p in probes}
  wrong = []
  for nid, indices in checked.items():
    seen = values.get(nid, {})
    if outcomes.get(nid) != "passed" or not all(
        right(want[(base_id(nid), i)], seen.get(i, []), params.get(nid)) for i in indices):
      wrong.append(nid)
  return wrong


class ReferenceCache:
  """The reference's ``sound`` probes by task, computed once per process (graders run in threads:
  a task's first grading computes them while the others wait)."""

  def __init__(self):
    self._lock, self._done, self._busy = threading.Lock(), {}, {}

  def get(self, key, compute):
    with self._lock:
      if key in self._done:
        return self._done[key]
      ev = self._busy.get(key)
      mine = ev is None
      if mine:
        ev = self._busy[key] = threading.Event()
    if not mine:
      ev.wait()
      with self._lock:
        if key in self._done:
          return self._done[key]
      return compute()  # the first try raised: try again here
    try:
      value = compute()
      with self._lock:
        self._done[key] = value
      return value
    finally:
      with self._lock:
        self._busy.pop(key, None)
      ev.set()


def reference_key(task, files: list[str]) -> tuple:
  """What the reference's probes depend on: the task store and its protected test files' bytes."""
  stamp = []
  for rel in files:
    try:
      st = os.stat(os.path.join(task.protected_dir, rel))
      stamp.append((rel, st.st_size, st.st_mtime_ns))
    except OSError:
      stamp.append((rel, None, None))
  return (task.path, task.instance_id, tuple(task.FAIL_TO_PASS), tuple(stamp))

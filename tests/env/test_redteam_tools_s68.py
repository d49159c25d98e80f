"""Red-team of the tools and the sandbox: each test is an attack a policy could learn, and checks
that it fails with a clear error and leaves the host as it was."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import signal
import time

import pytest

from composer_jax.env import sandbox as sbm
from composer_jax.env.protocol import ToolCall
from composer_jax.env.sandbox import Limits, Sandbox
from composer_jax.env.tools import ToolBox

needs_bwrap = pytest.mark.skipif(not sbm.bwrap_available(), reason="bubblewrap cannot run here")
QUICK = Limits(timeout_s=10, memory_mb=1024, max_procs=64, max_file_mb=64, max_output_chars=4000)


def call(tb, name, **args):
  return tb.execute(ToolCall(name, args))


@contextlib.contextmanager
def deadline(seconds: int):
  """Fail, rather than hang the test run, when a call blocks (an open of a FIFO does)."""
  def stop(*_):
    raise TimeoutError(f"blocked for {seconds} s")
  old = signal.signal(signal.SIGALRM, stop)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def box(tmp_path):
  ws = tmp_path / "ws"
  ws.mkdir()
  (ws / "m.py").write_text("a = 1\nb = 2\n")
  return ToolBox(Sandbox(str(ws), QUICK, mode="off")), ws


@needs_bwrap
def test_root_inside_the_sandbox_has_no_power_over_host_mounts(tmp_path):
  """Run by root, bwrap kept every capability inside: ``mount -o remount,rw,bind /usr`` then
  ``touch /usr/x`` wrote the host's /usr, and ``umount`` of a hide tmpfs showed what it hid. Hard
  links and device nodes stay refused by the kernel (mount boundary, user namespace)."""
  ws, env = tmp_path / "ws", tmp_path / "env"
  ws.mkdir()
  (env / "hidden").mkdir(parents=True)
  (env / "hidden" / "gold.py").write_text("GOLD-SECRET\n")
  (env / "lib.py").write_text("x = 1\n")
  sb = Sandbox(str(ws), QUICK, mode="required", ro_binds=[str(env)], hide=[str(env / "hidden")])
  r = sb.run(f"grep CapEff /proc/self/status; mount -o remount,rw,bind {env}; touch {env}/pwn; "
             f"echo pwned > {env}/lib.py; umount {env}/hidden; cat {env}/hidden/gold.py; "
             f"mount -t tmpfs none {env}/hidden; ln {env}/lib.py hard.py; mknod disk b 8 0; ls")
  assert "CapEff:\t0000000000000000" in r.output, r.output
  assert "GOLD-SECRET" not in r.output
  assert sorted(os.listdir(env)) == ["hidden", "lib.py"] and (env / "lib.py").read_text() == "x = 1\n"
  assert (env / "hidden" / "gold.py").read_text() == "GOLD-SECRET\n"
  assert os.listdir(ws) == []  # no hard link to a host file, no device node


@needs_bwrap
def test_host_sysctls_are_read_only_inside(tmp_path):
  """uid 0 inside is the host's root, and the kernel lets root write a sysctl with no capability:
  764 files of /proc/sys were writable (``echo 1 > /proc/sys/vm/drop_caches`` worked), so
  ``kernel.core_pattern`` could name a workspace program for the host kernel to run as root."""
  sb = Sandbox(str(tmp_path), QUICK, mode="required")
  r = sb.run("find /proc/sys /proc/sysrq-trigger -writable 2>/dev/null | head -3; echo found; "
             "v=$(cat /proc/sys/vm/swappiness); echo $v > /proc/sys/vm/swappiness && echo WROTE")
  assert r.output.startswith("found"), r.output  # write-back of the same value: harmless if it ran
  assert "WROTE" not in r.output and "Read-only" in r.output


def test_undo_onto_a_fifo_the_terminal_made_does_not_block(box):
  """``rm f; mkfifo f`` after an edit of ``f``: ``undo`` opened the FIFO for writing and blocked
  the worker for good (no reader ever comes)."""
  tb, ws = box
  assert call(tb, "str_replace", path="m.py", old="b = 2", new="b = 3").ok
  (ws / "m.py").unlink()
  os.mkfifo(ws / "m.py")
  with deadline(10):
    o = call(tb, "undo", path="m.py")
  assert not o.ok and "not a regular file" in o.text
  (ws / "m.py").unlink()
  (ws / "m.py").write_text("a = 1\nb = 3\n")
  assert call(tb, "undo", path="m.py").ok and (ws / "m.py").read_text() == "a = 1\nb = 2\n"  # kept


def test_arguments_of_the_wrong_type_are_one_clear_error(box):
  """``execute`` is the boundary: a list for a path raised AttributeError, a dict for content
  TypeError, an unknown or missing argument TypeError, out of the tool, failing the rollout."""
  tb, ws = box
  cases = [("view", {"path": ["m.py"]}, "must be text"), ("view", {"path": "m.py", "start": "1"},
                                                          "must be an integer"),
           ("create", {"path": "n.py", "content": {"x": 1}}, "must be text"),
           ("insert", {"path": "m.py", "line": True, "text": "x"}, "must be an integer"),
           ("terminal", {"command": 5}, "must be text"), ("terminal", {"command": "true", "timeout": 1.5},
                                                          "must be an integer"),
           ("search", {"pattern": None}, "must be text"), ("view", {}, "needs argument"),
           ("view", {"path": "m.py", "bogus": 1}, "no argument <bogus>"), ("submit", {"x": ""}, "no argument")]
  for name, args, why in cases:
    o = tb.execute(ToolCall(name, args))
    assert not o.ok and why in o.text, (name, args, o.text)
  assert sorted(os.listdir(ws)) == ["m.py"] and not tb.submitted


def test_a_pattern_with_an_inline_version_flag_is_an_error_not_a_crash(box):
  """``(?V1)`` in a pattern compiled as V0 raised KeyError from ``regex``'s parser, out of the tool."""
  tb, _ = box
  for pattern in ("(?V1)[[a-z]--[aeiou]]", "((?V1)b7{e<=.u][]"):
    o = call(tb, "search", pattern=pattern)
    assert not o.ok and "bad regular expression" in o.text, o.text


def test_a_search_over_many_fast_lines_stops_at_its_deadline(box):
  """The deadline bounded each line's match only: a line that matches fast never reaches it, and
  96 MB of short lines took 47 s under a 2 s bound (a 1 GB workspace: minutes of a stalled worker)."""
  tb, ws = box
  for i in range(4):
    (ws / f"f{i}.txt").write_bytes(b"x\n" * (3 << 20))
  tb.search_timeout_s = 0.5
  t0 = time.perf_counter()
  o = call(tb, "search", pattern="zz")
  assert not o.ok and "took more than 0.5 s" in o.text and time.perf_counter() - t0 < 4, o.text
  assert call(tb, "search", pattern="a = 1", path="m.py").ok  # a narrow search still runs


def test_undo_copies_are_bounded_in_all(box):
  """Each edit kept the whole old text for undo: 100 inserts into an 8 MB file, one 8 KB turn,
  held 800 MB in the worker. The oldest copies go once the budget is spent; the newest stay."""
  tb, ws = box
  tb.max_undo_chars = 1 << 20
  (ws / "big.py").write_text("x = 0\n" * 50_000)  # 300 KB
  for i in range(20):
    assert call(tb, "insert", path="big.py", line=0, text=f"# {i}").ok
  kept = [c for stack in tb.history.values() for c in stack]
  assert 1 <= len(kept) < 20 and sum(len(c or "") for c in kept) <= tb.max_undo_chars
  undone = 0
  while call(tb, "undo", path="big.py").ok:
    undone += 1
  assert undone == len(kept) and (ws / "big.py").read_text().startswith(f"# {19 - undone}\n")


def test_patterns_the_model_writes_are_not_kept_in_the_worker(box):
  """fnmatch keeps 32768 compiled globs for the life of the process (2000 distinct 8 KB globs held
  155 MB), and ``re`` keeps an escaped ``<old>`` of str_replace; neither grows now."""
  tb, ws = box
  (ws / "tests").mkdir()
  (ws / "tests" / "test_a.py").write_text(("a = 1 #" + "z" * 60 + "\n") * 2)
  re.purge()  # else a full cache (512) stays full, whatever is added
  fnmatch._compile_pattern.cache_clear()
  call(tb, "find", pattern="*[ab].py")  # warm: the constant pattern fnmatch.translate uses
  fn_before, re_before = fnmatch._compile_pattern.cache_info().currsize, len(re._cache)
  for i in range(50):
    call(tb, "find", pattern=f"*[ab]*{i}" + "?" * 500)
    call(tb, "search", pattern="zz", glob=f"*{i}.py")
    o = call(tb, "str_replace", path="tests/test_a.py", old="a = 1 #" + "z" * i, new="")
    assert not o.ok and "lines 1, 2" in o.text
  assert fnmatch._compile_pattern.cache_info().currsize == fn_before and len(re._cache) == re_before
  assert call(tb, "find", pattern="**/test_*.py").text == "1 files\ntests/test_a.py"


@needs_bwrap
def test_links_the_terminal_makes_never_lead_the_host_tools_out(tmp_path):
  """Links made inside name host paths when the host tools resolve them: /proc/self/root (the
  host's root, seen from the worker), the scratch folder of a sibling episode, a dangling link to
  create a file outside, and a link loop followed by ``..`` (``realpath`` takes the loop for a
  plain name, so ``..`` is lexical: ``loop/../../x`` is outside and refused)."""
  ws, sibling = tmp_path / "ws", tmp_path / "other-episode"
  ws.mkdir()
  sibling.mkdir()
  (sibling / "gold.py").write_text("GOLD-SECRET\n")
  tb = ToolBox(Sandbox(str(ws), QUICK, mode="required"))
  o = call(tb, "terminal", command=f"ln -s /proc/self/root/etc root; ln -s {sibling} sib; "
           f"ln -s {tmp_path}/planted.py drop.py; ln -s loop loop; ln -s sib/gold.py g.py")
  assert o.ok, o.text
  for path in ("root/passwd", "sib/gold.py", "g.py", "loop/../other-episode/gold.py",
               "loop/../../" + tmp_path.name + "/other-episode/gold.py"):
    o = call(tb, "view", path=path)
    assert not o.ok and "GOLD-SECRET" not in o.text and "root:" not in o.text, (path, o.text)
  for path in ("drop.py", "loop/../../planted.py", "sib/new.py"):
    o = call(tb, "create", path=path, content="PLANTED")
    assert not o.ok, (path, o.text)
  assert "GOLD-SECRET" not in call(tb, "search", pattern="GOLD").text
  assert sorted(os.listdir(tmp_path)) == ["other-episode", "ws"]
  assert os.listdir(sibling) == ["gold.py"]

"""The product's tools: view, create, str_replace, insert, undo, search, find, lint, terminal, submit.

File tools act on the workspace from the host (fast, and confined to the workspace: paths may not
escape it or touch ``.git``); ``terminal`` and ``lint`` run inside the sandbox. Every result is an
``Observation`` whose text is what the model sees.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import re._constants as _sre
import re._parser as _sre_parse
import shutil
import stat
import time

import regex

from composer_jax.env import guards, quota
from composer_jax.env.protocol import Arg, ToolCall, ToolSpec
from composer_jax.env.sandbox import Sandbox, clip_output

SPECS: dict[str, ToolSpec] = {s.name: s for s in (
    ToolSpec("view", "show a file with numbered lines (optionally a range), or list a directory",
             (Arg("path", doc="file or directory, relative to the workspace"),
              Arg("start", "int", False, "first line (1-based)"),
              Arg("end", "int", False, "last line (inclusive; -1 = end of file)"))),
    ToolSpec("create", "write a new file (or overwrite one) with the given content",
             (Arg("path"), Arg("content", required=False, doc="the whole file text"))),
    ToolSpec("str_replace", "replace text that occurs exactly once in a file",
             (Arg("path"), Arg("old", doc="exact text to find (must match once)"),
              Arg("new", required=False, doc="replacement (empty = delete)"))),
    ToolSpec("insert", "insert text after a line (0 = at the top)",
             (Arg("path"), Arg("line", "int"), Arg("text"))),
    ToolSpec("undo", "revert the last edit to a file", (Arg("path"),)),
    ToolSpec("search", "regex search in files: matches per file, first matches shown",
             (Arg("pattern", doc="Python regular expression"),
              Arg("path", required=False, doc="file or directory (default: workspace)"),
              Arg("glob", required=False, doc="only files whose name matches, e.g. *.py"))),
    ToolSpec("find", "find files whose path matches a glob, e.g. **/test_*.py or *duration*",
             (Arg("pattern"), Arg("path", required=False))),
    ToolSpec("lint", "run the ruff linter on a file or directory", (Arg("path", required=False),)),
    ToolSpec("terminal", "run a shell command in the sandboxed workspace (no network)",
             (Arg("command"), Arg("timeout", "int", False, "seconds"))),
    ToolSpec("submit", "finish: the workspace is graded as it is now", ()),
)}

SKIP_DIRS = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", ".venv",
             "node_modules", ".deps"}


# ``regex`` writes a counted repeat out in full when it compiles (``(?:a{1000}){1000}`` holds a million
# items, 260 MB; one more level ran the host out of memory in a second), and the search runs on the
# host, outside every sandbox bound and before its deadline starts. 5-10 MB at this bound.
MAX_PATTERN_ITEMS = 20_000
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT)


def pattern_items(pattern: str) -> int:
  """About how many items ``regex`` builds for ``pattern``: nested repeat counts (the minimum, the
  one it writes out) multiply. Syntax ``re`` cannot parse counts every ``{m`` as nested."""
  try:
    tree = _sre_parse.parse(pattern)
  except (re.error, RecursionError, OverflowError, ValueError):
    n = 1
    for m in re.findall(r"\{\s*(\d+)", pattern):
      n *= max(int(m), 1)
    return n

  def inner(av):
    if isinstance(av, _sre_parse.SubPattern):
      yield av
    elif isinstance(av, (tuple, list)):
      for x in av:
        yield from inner(x)

  def items(sub) -> int:
    total = 0
    for op, av in sub:
      n = sum(items(s) for s in inner(av))
      total += max(av[0], 1) * max(n, 1) if op in _REPEATS else 1 + n
    return total

  try:
    return items(tree)
  except RecursionError:
    return MAX_PATTERN_ITEMS + 1


def utf8_text(text: str) -> str:
  """``text`` as valid UTF-8. File names from ``os.listdir`` and ``os.walk`` keep bytes that are not
  UTF-8 as lone surrogates (``touch $'x\\xff'``), and the tokenizer raises on those: a listing of such
  a name made the RL rollout that encoded the observation fail."""
  try:
    raw = text.encode("utf-8", "surrogateescape")
  except UnicodeEncodeError:
    raw = text.encode("utf-8", "surrogatepass")
  return raw.decode("utf-8", "replace")


def _bad_args(spec: ToolSpec, args: dict) -> str:
  """Why ``args`` do not fit ``spec`` (names, types, required ones), or "". ``parse`` gives only
  strings and ints, but ``execute`` is the boundary: a list for a path raised AttributeError."""
  for name, value in args.items():
    a = spec.arg(name)
    if a is None:
      return f"{spec.name} has no argument <{name}>"
    want = int if a.kind == "int" else str
    if not isinstance(value, want) or isinstance(value, bool):
      return f"argument <{name}> of {spec.name} must be {'an integer' if want is int else 'text'}"
  missing = [a.name for a in spec.args if a.required and a.name not in args]
  return f"{spec.name} needs argument(s) {', '.join(missing)}" if missing else ""


def _glob(pattern: str):
  """``pattern``'s matcher, compiled without fnmatch's cache: it keeps 32768 patterns for the life of
  the worker, and 2000 distinct 8 KB globs held 155 MB there."""
  return regex.compile(fnmatch.translate(pattern), cache_pattern=False).match


def _encodable(text: str) -> bool:
  try:
    text.encode("utf-8")
    return True
  except UnicodeEncodeError:
    return False


@dataclasses.dataclass
class Observation:
  tool: str
  text: str
  ok: bool = True


class ToolError(Exception):
  pass


class ToolBox:
  """Executes parsed tool calls against one workspace."""

  def __init__(self, sandbox: Sandbox, max_output_chars: int = 8000, max_matches: int = 50,
               max_view_lines: int = 400, search_timeout_s: float = 10.0,
               max_file_bytes: int = 8 << 20, max_undo_chars: int = 64 << 20):
    self.sandbox = sandbox
    self.max_file_bytes = max_file_bytes
    self.search_timeout_s = search_timeout_s
    self.root = sandbox.workspace
    self.max_output_chars = max_output_chars
    self.max_matches = max_matches
    self.max_view_lines = max_view_lines
    self.history: dict[str, list[str | None]] = {}  # path -> earlier contents (None = absent)
    self._edits: list[str] = []  # the path of each kept copy, oldest first
    self._undo_chars, self.max_undo_chars = 0, max_undo_chars
    self.submitted = False

  # ---------------------------------------------------------------------------------------------
  def execute(self, call: ToolCall) -> Observation:
    fn = getattr(self, f"_tool_{call.name}", None)
    spec = SPECS.get(call.name)
    if fn is None or spec is None:
      return Observation(call.name, f"unknown tool {call.name!r}", False)
    for name, value in call.args.items():  # what no path, file or command can hold
      if isinstance(value, str) and ("\x00" in value or not _encodable(value)):
        return Observation(call.name, f"argument {name!r} holds a NUL or an unpaired surrogate "
                           "character; remove it", False)
    bad = _bad_args(spec, call.args)
    if bad:
      return Observation(call.name, bad, False)
    try:
      text = fn(**call.args)
      ok = True
    except ToolError as e:
      text, ok = str(e), False
    except (OSError, ValueError, RecursionError) as e:  # a tool's failure is the model's
      # observation, never a crash (RecursionError: Python 3.11's recursive os/shutil helpers)
      text, ok = f"{type(e).__name__}: {e}", False
    text, _ = clip_output(utf8_text(text), self.max_output_chars)
    return Observation(call.name, text, ok)

  def _resolve(self, path: str | None, write: bool = False) -> str:
    path = (path or ".").strip()
    full = os.path.realpath(os.path.join(self.root, path))
    if not self._inside(full):
      raise ToolError(f"{path}: outside the workspace; use a path inside it")
    rel = os.path.relpath(full, self.root)
    if write and (rel == ".git" or rel.startswith(".git" + os.sep)):
      raise ToolError(f"{path}: .git is read-only for the tools")
    return full

  def _inside(self, real: str) -> bool:
    return guards.within(self.root, real)

  def _rel(self, full: str) -> str:
    return os.path.relpath(full, self.root)

  def _read(self, full: str) -> str:
    if not os.path.isfile(full):
      raise ToolError(f"{self._rel(full)}: no such file")
    self._check_size(full)
    with self._open(full) as f:
      return f.read()

  def _open(self, full: str, write: bool = False):
    """``full`` as text, only if it is a regular file: the terminal can swap an edited file for a
    FIFO (``rm f; mkfifo f``), and ``undo``'s plain open of it blocked the worker for good."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
    fd = os.open(full, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      os.close(fd)
      raise ToolError(f"{self._rel(full)}: not a regular file")
    return open(fd, "w" if write else "r", encoding="utf-8", errors="replace", newline="")

  def _check_size(self, full: str) -> None:
    """The file tools hold what they read in the worker's memory (and each edit's undo copy): a file
    the terminal made as large as RLIMIT_FSIZE, edited every turn, would be gigabytes."""
    size = os.path.getsize(full)
    if size > self.max_file_bytes:
      raise ToolError(f"{self._rel(full)}: {size / 1e6:.1f} MB, more than the file tools read "
                      f"({self.max_file_bytes / 1e6:g} MB); use the terminal (head, sed -n, grep)")

  def _write(self, full: str, text: str) -> None:
    old = None
    if os.path.exists(full):
      if not os.path.isfile(full):  # a FIFO would block both opens
        raise ToolError(f"{self._rel(full)}: not a regular file")
      self._check_size(full)
      with self._open(full) as f:
        old = f.read()
    parent = os.path.dirname(full)
    rel = os.path.relpath(parent, self.root)
    depth = 0 if rel == "." else len(rel.split(os.sep))
    # The sandbox stops a command that nests folders past quota.MAX_DEPTH; this write runs on the
    # host, outside it: one ``create`` of d/d/.../x.py 900 deep made grading's copytree raise
    # RecursionError out of Episode.close, failing the rollout.
    if not os.path.isdir(parent) and depth > quota.MAX_DEPTH:
      raise ToolError(f"{self._rel(full)}: {depth} folders deep, more than {quota.MAX_DEPTH}; use a "
                      "shallower path")
    self._remember(full, old)
    os.makedirs(parent, exist_ok=True)
    with self._open(full, write=True) as f:
      f.write(text)

  def _remember(self, full: str, old: str | None) -> None:
    """Keep ``old`` for undo within ``max_undo_chars`` in all, dropping the oldest copies: 100
    inserts into an 8 MB file, one 8 KB turn, held 800 MB of copies in the worker."""
    self.history.setdefault(full, []).append(old)
    self._edits.append(full)
    self._undo_chars += len(old or "")
    while self._undo_chars > self.max_undo_chars and len(self._edits) > 1:
      gone = self.history[self._edits.pop(0)].pop(0)
      self._undo_chars -= len(gone or "")

  # ---------------------------------------------------------------------------------------------
  def _tool_view(self, path: str, start: int | None = None, end: int | None = None) -> str:
    full = self._resolve(path)
    if os.path.isdir(full):
      entries = []
      for name in sorted(os.listdir(full)):
        if name in SKIP_DIRS:
          continue
        p = os.path.join(full, name)  # a link out of the workspace is listed, never followed
        entries.append(name + ("/" if os.path.isdir(p) and self._inside(os.path.realpath(p)) else ""))
      return f"{self._rel(full)}/ ({len(entries)} entries)\n" + "\n".join(entries)
    lines = self._read(full).splitlines()
    n = len(lines)
    lo = 1 if start is None else start
    hi = n if end is None or end == -1 else end
    if n == 0:
      return f"{self._rel(full)} is empty"
    if not 1 <= lo <= n or hi < lo:
      raise ToolError(f"line range {lo}..{hi} is outside {self._rel(full)} (1..{n})")
    hi = min(hi, n)
    note = ""
    if hi - lo + 1 > self.max_view_lines:
      hi = lo + self.max_view_lines - 1
      note = f"\n[showing {lo}..{hi} of {n} lines; view a range to see more]"
    body = "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, hi + 1))
    return body + note

  def _tool_create(self, path: str, content: str = "") -> str:
    full = self._resolve(path, write=True)
    if os.path.isdir(full):
      raise ToolError(f"{path}: is a directory")
    existed = os.path.exists(full)
    self._write(full, content)
    n = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    return f"{'overwrote' if existed else 'created'} {self._rel(full)} ({n} lines)"

  def _tool_str_replace(self, path: str, old: str, new: str = "") -> str:
    full = self._resolve(path, write=True)
    text = self._read(full)
    if not old:
      raise ToolError("<old> is empty; give the exact text to replace")
    count = text.count(old)
    if count != 1:
      if count == 0:
        raise ToolError(f"no match for <old> in {self._rel(full)}; nothing changed (check whitespace)")
      starts, at = [], text.find(old)
      while at >= 0 and len(starts) < 20:  # str.find: re's cache would keep each <old> compiled
        starts.append(at)
        at = text.find(old, at + len(old))
      lines = [text.count("\n", 0, s) + 1 for s in starts]
      raise ToolError(f"<old> matches {count} times in {self._rel(full)} (lines "
                      f"{', '.join(map(str, lines[:20]))}); nothing changed: include more context")
    at = text.index(old)
    self._write(full, text[:at] + new + text[at + len(old):])
    first = text.count("\n", 0, at) + 1
    new_lines = text[:at].count("\n") + new.count("\n")
    return f"edited {self._rel(full)}\n" + self._snippet(full, first, new_lines + 1)

  def _snippet(self, full: str, first: int, last: int, ctx: int = 3) -> str:
    lines = self._read(full).splitlines()
    lo, hi = max(1, first - ctx), min(len(lines), last + ctx)
    return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, hi + 1))

  def _tool_insert(self, path: str, line: int, text: str) -> str:
    full = self._resolve(path, write=True)
    old = self._read(full)
    lines = old.splitlines(keepends=True)
    if not 0 <= line <= len(lines):
      raise ToolError(f"<line> {line} is outside 0..{len(lines)} for {self._rel(full)}")
    if lines and not lines[-1].endswith("\n") and line == len(lines):
      lines[-1] += "\n"
    block = text if text.endswith("\n") else text + "\n"
    lines.insert(line, block)
    self._write(full, "".join(lines))
    added = block.count("\n")
    return f"inserted {added} line(s) after line {line} of {self._rel(full)}\n" + \
        self._snippet(full, line + 1, line + added)

  def _tool_undo(self, path: str) -> str:
    full = self._resolve(path, write=True)
    stack = self.history.get(full)
    if not stack:
      raise ToolError(f"no edit to undo for {self._rel(full)}")
    if os.path.lexists(full) and not os.path.isfile(full):  # checked before the copy is spent
      raise ToolError(f"{self._rel(full)}: not a regular file")
    old = stack.pop()
    del self._edits[len(self._edits) - 1 - self._edits[::-1].index(full)]
    self._undo_chars -= len(old or "")
    if old is None:
      os.remove(full)
      return f"undid the creation of {self._rel(full)} (file removed)"
    with self._open(full, write=True) as f:
      f.write(old)
    return f"reverted the last edit to {self._rel(full)}"

  def _walk(self, full: str):
    if os.path.isfile(full):
      yield full
      return
    for dirpath, dirnames, filenames in os.walk(full):
      dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
      for name in sorted(filenames):
        # The tools run on the host: a link the agent made in the sandbox (``ln -s /etc/shadow x``)
        # resolves against the host's files, so a file whose target leaves the workspace is skipped;
        # so are FIFOs and sockets (``mkfifo``: opening one would block the episode for good).
        p = os.path.join(dirpath, name)
        if os.path.isfile(p) and self._inside(os.path.realpath(p)):
          yield p

  def _small(self, full: str) -> bool:
    try:
      return os.path.getsize(full) <= self.max_file_bytes
    except OSError:
      return False

  def _tool_search(self, pattern: str, path: str | None = None, glob: str | None = None) -> str:
    # It runs on the host, so a pattern that backtracks without end (``(a|aa)+$`` over a line of
    # a's: days under ``re``) would hang the worker: ``regex`` (re's syntax, V0) takes a deadline.
    if pattern_items(pattern) > MAX_PATTERN_ITEMS:
      raise ToolError(f"the pattern {pattern[:80]!r} repeats too much to compile (counted repeats "
                      f"like {{1000}} multiply when nested); use smaller counts, or + and *")
    try:
      rx = regex.compile(pattern, regex.V0, cache_pattern=False)  # not kept in the worker
    except Exception as e:  # regex's parser on the model's text: '(' * 3000 raised RecursionError,
      # '(?V1)' KeyError, out of the tool, failing the rollout
      raise ToolError(f"bad regular expression {pattern!r}: {e}") from None
    full = self._resolve(path)
    deadline = time.monotonic() + self.search_timeout_s
    shown, total, per_file = [], 0, []
    name_ok = _glob(glob) if glob else None
    for f in self._walk(full):
      if name_ok and not name_ok(os.path.basename(f)) or not self._small(f):
        continue  # a file over max_file_bytes is skipped as a binary is
      try:
        with open(f, encoding="utf-8") as fh:
          lines = fh.read().splitlines()
      except (UnicodeDecodeError, OSError):
        continue  # binary
      hits = 0
      for i, line in enumerate(lines, 1):
        try:  # the timeout bounds one line: a fast pattern over a 1 GB workspace ran for minutes
          left = deadline - time.monotonic()
          if left <= 0:
            raise TimeoutError
          found = rx.search(line, timeout=left)
        except TimeoutError:
          raise ToolError(f"the search for {pattern!r} took more than {self.search_timeout_s:g} s "
                          "(a pattern that backtracks too much, or too many files?); use a simpler "
                          "pattern, or narrow it with <path> or <glob>") from None
        if found:
          hits += 1
          if len(shown) < self.max_matches:
            shown.append(f"{self._rel(f)}:{i}: {line[:200]}")
      if hits:
        per_file.append((self._rel(f), hits))
        total += hits
    if not total:
      return f"no matches for {pattern!r}"
    head = f"{total} matches in {len(per_file)} files"
    counts = "\n".join(f"  {p}: {c}" for p, c in per_file[:self.max_matches])
    more = f"\n[showing the first {len(shown)} of {total} matches]" if total > len(shown) else ""
    return f"{head}\n{counts}\n\n" + "\n".join(shown) + more

  def _tool_find(self, pattern: str, path: str | None = None) -> str:
    full = self._resolve(path)
    hits = []
    match = _glob(pattern)
    for f in self._walk(full):
      rel = self._rel(f)
      if match(rel) or match(os.path.basename(f)):
        hits.append(rel)
    if not hits:
      return f"no files match {pattern!r}"
    more = f"\n[showing {self.max_matches} of {len(hits)}]" if len(hits) > self.max_matches else ""
    return f"{len(hits)} files\n" + "\n".join(hits[:self.max_matches]) + more

  def _tool_lint(self, path: str | None = None) -> str:
    full = self._resolve(path)
    ruff = getattr(self.sandbox, "which", shutil.which)("ruff")  # a host shim is not visible inside
    cmd = ([ruff] if ruff else ["python", "-m", "ruff"]) + [
        "check", "--no-cache", "--output-format", "concise", "--isolated", "--select", "E9,F", "--",
        os.path.relpath(full, self.root)]
    r = self.sandbox.run(cmd, max_output_chars=self.max_output_chars)
    # ruff exits 1 for "problems found"; bwrap also exits 1 when it cannot start the program.
    if r.exit_code not in (0, 1) or r.output.startswith("bwrap:"):
      raise ToolError(f"the linter failed (exit {r.exit_code}):\n{r.output}")
    return r.output.strip() or "no problems found"

  def _tool_terminal(self, command: str, timeout: int | None = None) -> str:
    limit = self.sandbox.limits.timeout_s
    t = limit if timeout is None else max(1, min(timeout, limit))
    r = self.sandbox.run(command, timeout=t, max_output_chars=self.max_output_chars)
    if r.timed_out:
      raise ToolError(r.output)
    return f"{r.output.rstrip()}\n[exit code {r.exit_code}]"

  def _tool_submit(self) -> str:
    self.submitted = True
    return "submitted; the workspace will be graded"

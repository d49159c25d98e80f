"""Run one command in a bubblewrap sandbox with resource limits, a wall-clock timeout and clipped output.

bubblewrap gives namespaces (no network, private pids/ipc/uts), a read-only view of the system, the
task workspace bound read-write and a private tmpfs ``/tmp``. It has no resource limits of its own, so
rlimits (address space, processes, file size, CPU seconds) are set on the bwrap process before exec
(children inherit them), and the whole process group is killed when the wall-clock timeout fires.

Where bwrap cannot run (no user namespaces, not installed) ``sandbox="auto"`` prints a loud warning
once and falls back to rlimits only; ``sandbox="required"`` refuses; ``sandbox="off"`` skips bwrap
on purpose (trusted code, debugging).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

_BWRAP_OK: bool | None = None
_WARNED = False


class SandboxError(RuntimeError):
  """The sandbox cannot run as configured; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout_s: float = 30.0
  memory_mb: int = 4096  # RLIMIT_AS
  max_procs: int = 256  # RLIMIT_NPROC
  max_file_mb: int = 256  # RLIMIT_FSIZE
  cpu_s: int = 0  # RLIMIT_CPU; 0 = 2 x timeout
  max_output_chars: int = 8000

  @classmethod
  def from_config(cls, env) -> "Limits":
    return cls(timeout_s=env.timeout_s, memory_mb=env.memory_mb, max_procs=env.max_procs,
               max_file_mb=env.max_file_mb, max_output_chars=env.max_output_chars)


@dataclasses.dataclass
class ExecResult:
  exit_code: int  # -signal when killed by a signal; 124 on timeout
  output: str  # stdout and stderr interleaved, clipped
  timed_out: bool
  clipped: bool
  seconds: float
  sandboxed: bool  # False when it ran under the rlimit-only fallback

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out


def bwrap_available() -> bool:
  """Whether bubblewrap is installed and can create its namespaces here (checked once)."""
  global _BWRAP_OK
  if _BWRAP_OK is None:
    exe = shutil.which("bwrap")
    if exe is None:
      _BWRAP_OK = False
    else:
      try:
        r = subprocess.run([exe, "--unshare-all", "--ro-bind", "/", "/", "true"],
                           capture_output=True, timeout=20)
        _BWRAP_OK = r.returncode == 0
      except (OSError, subprocess.TimeoutExpired):
        _BWRAP_OK = False
  return _BWRAP_OK


def clip_output(text: str, max_chars: int) -> tuple[str, bool]:
  """Keep the head and the tail (errors are usually at the end) and say how much was cut."""
  if max_chars <= 0 or len(text) <= max_chars:
    return text, False
  head = max_chars // 2
  tail = max_chars - head
  cut = len(text) - head - tail
  return f"{text[:head]}\n[... {cut} characters clipped ...]\n{text[-tail:]}", True


_ADDR_NO_RANDOMIZE = 0x0040000


def _load_personality():
  try:
    import ctypes
    return ctypes.CDLL(None, use_errno=True).personality
  except (OSError, AttributeError):
    return None


_PERSONALITY = _load_personality()  # loaded once: the child after fork must stay cheap


def _no_aslr() -> None:
  """Turn off address randomisation for the command: on Python < 3.12 ``hash(None)`` is an address,
  so sets holding None (test parametrisations!) change order, and test ids with them, between runs."""
  if _PERSONALITY is not None:
    cur = _PERSONALITY(0xFFFFFFFF)
    if cur != -1:
      _PERSONALITY(cur | _ADDR_NO_RANDOMIZE)


_PRLIMIT, _SETARCH = shutil.which("prlimit"), shutil.which("setarch")


def _limit_values(limits: Limits) -> dict:
  mb = 1 << 20
  return {"as": limits.memory_mb * mb, "nproc": limits.max_procs, "fsize": limits.max_file_mb * mb,
          "cpu": limits.cpu_s or max(1, int(2 * limits.timeout_s) + 1), "core": 0}


def _limit_prefix(limits: Limits) -> list[str]:
  """``setarch -R prlimit --as=... --`` (same limits and no-ASLR as ``_set_limits``), or []."""
  if not (_PRLIMIT and _SETARCH):
    return []
  vals = _limit_values(limits)
  return [_SETARCH, os.uname().machine, "-R", _PRLIMIT,
          *(f"--{k}={v}" for k, v in vals.items() if v or k == "core"), "--"]


def _set_limits(limits: Limits):
  def apply():
    _no_aslr()
    names = {"as": resource.RLIMIT_AS, "nproc": resource.RLIMIT_NPROC, "fsize": resource.RLIMIT_FSIZE,
             "cpu": resource.RLIMIT_CPU, "core": resource.RLIMIT_CORE}
    for key, val in _limit_values(limits).items():
      if val > 0 or key == "core":
        try:
          resource.setrlimit(names[key], (val, val))
        except (ValueError, OSError):
          pass  # cannot raise above the hard limit; keep the stricter one
  return apply


class Sandbox:
  """Runs commands inside ``workspace``.

  ``binds`` are extra read-write host paths (e.g. a report directory); ``hide`` are host paths made
  empty inside (task stores, installed copies of the package under test); ``network`` keeps the host
  network (only for set-up commands that install dependencies).
  """

  def __init__(self, workspace: str, limits: Limits = Limits(), mode: str = "auto",
               binds: Sequence[str] = (), hide: Sequence[str] = (), network: bool = False,
               env: dict | None = None):
    if mode not in ("auto", "required", "off"):
      raise SandboxError(f"env.sandbox={mode!r}: choose auto, required or off")
    self.workspace = os.path.realpath(workspace)
    if not os.path.isdir(self.workspace):
      raise SandboxError(f"workspace {workspace!r} is not a directory: pass an existing directory")
    self.limits = limits
    self.binds = [os.path.realpath(b) for b in binds]
    self.hide = [os.path.realpath(h) for h in hide if os.path.exists(h)]
    self.network = network
    self.extra_env = dict(env or {})
    self.use_bwrap = False
    if mode != "off":
      if bwrap_available():
        self.use_bwrap = True
      elif mode == "required":
        raise SandboxError("env.sandbox=required but bubblewrap cannot run here: "
                           "install it (apt-get install -y bubblewrap) or set env.sandbox=auto")
      else:
        _warn_fallback()

  def _env(self, extra: dict | None) -> dict:
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": "/tmp" if self.use_bwrap else tempfile.gettempdir(),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",  # no bytecode left for a later agent to decompile
        "PYTHONHASHSEED": "0",
        "TERM": "dumb",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    if "PYENV_VERSION" in os.environ:
      env["PYENV_VERSION"] = os.environ["PYENV_VERSION"]
    env.update(self.extra_env)
    env.update(extra or {})
    return env

  def _argv(self, cmd: list[str], cwd: str) -> list[str]:
    if not self.use_bwrap:
      return cmd
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    # An interpreter or virtualenv living under /tmp (hidden by the tmpfs above) stays usable.
    for prefix in sorted({sys.prefix, sys.base_prefix, sys.exec_prefix}):
      if prefix == "/tmp" or prefix.startswith("/tmp/"):
        argv += ["--ro-bind", prefix, prefix]
    if self.network:
      argv += ["--share-net"]
    for h in self.hide:  # before the binds, so a bound workspace under a hidden store stays visible
      argv += (["--tmpfs", h] if os.path.isdir(h) else ["--ro-bind", "/dev/null", h])
    argv += ["--bind", self.workspace, self.workspace]
    for b in self.binds:
      argv += ["--bind", b, b]
    argv += ["--chdir", cwd, "--"]
    return argv + cmd

  def run(self, command: str | Sequence[str], timeout: float | None = None, cwd: str | None = None,
          env: dict | None = None, max_output_chars: int | None = None) -> ExecResult:
    """Run ``command`` (a shell string or an argv list); never raises on the command's failure."""
    cmd = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    cwd = os.path.realpath(os.path.join(self.workspace, cwd)) if cwd else self.workspace
    timeout = self.limits.timeout_s if timeout is None else timeout
    max_chars = self.limits.max_output_chars if max_output_chars is None else max_output_chars
    limits = dataclasses.replace(self.limits, timeout_s=timeout)
    t0 = time.perf_counter()
    timed_out = False
    # Output goes to an unlinked file (bounded by RLIMIT_FSIZE), not a pipe a flood could stall.
    with tempfile.TemporaryFile() as out:
      try:
        argv = self._argv(cmd, cwd)
        prefix = _limit_prefix(limits)
        # With util-linux's prlimit/setarch there is no preexec_fn, so Python can vfork: a fork of a
        # big parent (an RL worker holding a model) is what makes a sandboxed call slow.
        proc = subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=cwd, env=self._env(env),
                                start_new_session=True,
                                preexec_fn=None if prefix else _set_limits(limits))
      except OSError as e:
        return ExecResult(127, f"cannot start command: {e}", False, False, 0.0, self.use_bwrap)
      try:
        code = proc.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        code = 124
      total = out.seek(0, os.SEEK_END)
      out.seek(0)
      cap = max(max_chars, 1 << 12)
      if max_chars <= 0 or total <= 4 * cap:
        text = out.read().decode("utf-8", errors="replace")
        text, clipped = clip_output(text, max_chars)
      else:  # a flood: read only the head and the tail
        head = out.read(max_chars // 2).decode("utf-8", errors="replace")
        out.seek(total - (max_chars - max_chars // 2))
        tail = out.read().decode("utf-8", errors="replace")
        text = f"{head}\n[... {total - max_chars} bytes clipped ...]\n{tail}"
        clipped = True
    if timed_out:
      text += f"\n[command timed out after {timeout:g} s; its process group was killed]"
    return ExecResult(code, text, timed_out, clipped, time.perf_counter() - t0,
                      self.use_bwrap)


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  try:
    proc.wait(timeout=5)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


def _warn_fallback() -> None:
  global _WARNED
  if not _WARNED:
    _WARNED = True
    bar = "!" * 78
    print(f"{bar}\nWARNING: bubblewrap (bwrap) cannot run here; commands run with rlimits ONLY — no\n"
          "namespace isolation, the network and the whole file system are reachable. Install it\n"
          f"(apt-get install -y bubblewrap) or set env.sandbox=required to refuse.\n{bar}",
          file=sys.stderr)

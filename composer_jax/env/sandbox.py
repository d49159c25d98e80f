"""Run one command in a bubblewrap sandbox with resource limits, a wall-clock timeout and clipped output.

What a command sees is an allow-list, built on an empty root (anything not listed does not exist):

- the system runtime, read-only: ``/usr`` and the top-level ``/bin``, ``/sbin``, ``/lib*`` (symlinks
  kept as symlinks), and from ``/etc`` only what a toolchain needs to start: the loader cache and
  config (``ld.so.*``), ``alternatives``, ``ssl`` and ``ca-certificates`` (TLS for set-up steps),
  ``localtime``, ``passwd``/``group`` (names for uids; no shadow files), ``nsswitch.conf``, ``hosts``,
  and ``resolv.conf`` only when the network is on;
- the running interpreter, read-only, derived from it rather than from a distribution's layout:
  ``sys.prefix``, ``base_prefix``, ``exec_prefix``, the ``sysconfig`` stdlib and site directories,
  the user site directory when it is on ``sys.path``, and the shared libraries a bare interpreter maps
  (``/proc/self/maps``) outside those. Under pyenv that is one ``versions/X.Y.Z`` directory, not the
  home directory holding it;
- the task's environment read-only (``ro_binds``), with ``hide`` paths (installed copies of the
  package under test, task stores) made empty;
- the workspace and ``binds`` read-write; a private tmpfs ``/tmp`` with ``HOME=/tmp/home``; a minimal
  ``/dev`` and the ``/proc`` of the sandbox's own pid namespace.

No home directories, caches, task stores, gold files, other workspaces, project checkout, host
``/var``, ``/opt``, ``/srv``, ``/mnt``. Namespaces: own pids (host processes invisible), ipc, uts,
user, and no network unless ``network=True`` (set-up steps that install dependencies); no capabilities
(run by root, bwrap would keep them) and a read-only ``/proc/sys`` (uid 0 inside is the host's root,
which writes sysctls without one). Environment
variables are built from scratch (``PATH`` from the allowed directories; nothing of the host's passes).
A link the command makes in the workspace may name any host path; host-side readers of the workspace
never follow one out of it (``guards.drop_outside_links``, ``guards.within``).

Limits: bubblewrap has none, so rlimits (address space, processes, file size, CPU seconds) are set
before exec, and where a pids cgroup can be made (v1, or a delegated v2) each call gets one with
``pids.max`` — root ignores RLIMIT_NPROC, a cgroup also bounds a fork bomb run as root. Where a
memory cgroup can be made, it bounds the call's resident memory as a whole at ``memory_mb``
(RLIMIT_AS bounds each process alone, and 256 of them fill any host); either way every process of a
call asks the OOM killer to take it first (``oom_score_adj`` 1000), so memory pressure ends the
sandboxed command, not the learner. The private ``/tmp`` is a tmpfs of at most ``tmp_mb``. The
workspace and ``binds`` may grow by ``workspace_mb`` and ``workspace_files`` over their size when
the sandbox was made, and nest ``quota.MAX_DEPTH`` folders deep (``env/quota.py``): measured before,
during (every 0.2 s) and after a call, and a call that passes them is stopped and
``ExecResult.stopped`` says why; one that would start over them does not run.

Nothing outlives a call, in every mode: when the command returns (or times out) its process group is
killed, then every process left in its cgroup; under bwrap the pid namespace dies with its init. In
the rlimit-only fallback without a cgroup, processes that left the group (setsid) are found by a
per-call marker in their environment (random bytes: nothing of the host, such as its pid).

Modes: where bwrap cannot run, ``sandbox="auto"`` prints a loud warning once and falls back to rlimits
only (no namespaces: network and file system reachable); ``"required"`` refuses; ``"off"`` skips bwrap
on purpose. Only scripted policies and trusted set-up may run unisolated: anything a model drives goes
through ``require_isolation`` (or ``Sandbox(model_driven=True)``), which refuses whatever the mode.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence

from composer_jax.env import quota, scratch
from composer_jax.env.reaper import (
  _kill_cgroup,
  _kill_group,
  _kill_marked,
  _make_call_cgroups,
  _release_cgroup,
  _under,
  _wait_exit,
)

_BWRAP_OK: bool | None = None
_WARNED = False
_NOTED_OFF = False
INSTALL_HINT = "install bubblewrap (apt-get install -y bubblewrap) on a host with user namespaces"


class SandboxError(RuntimeError):
  """The sandbox cannot run as configured; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout_s: float = 30.0
  memory_mb: int = 4096  # RLIMIT_AS
  max_procs: int = 256  # RLIMIT_NPROC and the call's pids cgroup
  max_file_mb: int = 256  # RLIMIT_FSIZE
  cpu_s: int = 0  # RLIMIT_CPU; 0 = 2 x timeout
  max_output_chars: int = 8000
  tmp_mb: int = 512  # the private /tmp (a tmpfs: host memory) under bwrap
  # What the workspace and binds together may grow by over their size when the sandbox was made;
  # a call that passes it is stopped. The same in files and folders; 0 = no bound (either).
  workspace_mb: int = 1024
  workspace_files: int = 50000

  @classmethod
  def from_config(cls, env) -> Limits:
    return cls(timeout_s=env.timeout_s, memory_mb=env.memory_mb, max_procs=env.max_procs,
               max_file_mb=env.max_file_mb, max_output_chars=env.max_output_chars,
               tmp_mb=env.tmp_mb, workspace_mb=env.workspace_mb, workspace_files=env.workspace_files)


@dataclasses.dataclass
class ExecResult:
  exit_code: int  # -signal when killed by a signal; 124 on timeout
  output: str  # stdout and stderr interleaved, clipped
  timed_out: bool
  clipped: bool
  seconds: float
  sandboxed: bool  # False when it ran under the rlimit-only fallback
  stopped: str = ""  # why the call was stopped, or not run, for its disk use (``quota.over``)

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out


# --------------------------------------------------------------------------------------------------
# The allow-list
# --------------------------------------------------------------------------------------------------

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
        "ca-certificates.conf", "localtime", "passwd", "group", "nsswitch.conf", "hosts")
_ETC_NET = ("resolv.conf", "gai.conf", "host.conf")


# Inside, uid 0 is the host's root, and the kernel lets root write a sysctl without any capability
# (bwrap did not cover these here): kernel.core_pattern runs a program as host root, sysrq reboots.
_PROC_RO = tuple(a for n in ("sys", "sysrq-trigger") if os.path.exists(f"/proc/{n}")
                 for a in ("--ro-bind", f"/proc/{n}", f"/proc/{n}"))


@functools.cache
def _system_args(network: bool) -> tuple[str, ...]:
  """Read-only binds (and symlinks) of the system runtime and the few /etc files it needs."""
  args: list[str] = []
  for d in _SYSTEM_DIRS:
    if os.path.islink(d):
      args += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d):
      args += ["--ro-bind", d, d]
  for name in _ETC + (_ETC_NET if network else ()):
    p = os.path.join("/etc", name)
    if os.path.lexists(p) and os.path.exists(p):  # a dangling link cannot be bound
      args += ["--ro-bind", p, p]
  return tuple(args)


def _mapped_libraries() -> list[str]:
  """Files a bare interpreter (``-S -E``: no site, no env) maps at start: libpython, libc, the loader."""
  code = "import sys; sys.stdout.write(open('/proc/self/maps').read())"
  try:
    r = subprocess.run([sys.executable, "-S", "-E", "-c", code], capture_output=True, text=True,
                       timeout=30, env={"PATH": "/usr/bin:/bin"})
  except (OSError, subprocess.TimeoutExpired):
    return []
  libs = {line.split(None, 5)[5].strip() for line in r.stdout.splitlines() if len(line.split(None, 5)) == 6}
  return sorted(p for p in libs if p.startswith("/") and os.path.isfile(p))


@functools.cache
def interpreter_paths() -> tuple[str, ...]:
  """Host paths the running interpreter needs, minimal (none lies under another) and existing."""
  cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, getattr(sys, "base_exec_prefix", sys.prefix),
           os.path.dirname(sys.executable)]
  cands += [v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib",
                                                                  "platlib", "scripts")]
  cands += site.getsitepackages() if hasattr(site, "getsitepackages") else []
  user = _user_site()
  if user:
    cands.append(user)
  cands += _mapped_libraries()
  real = sorted({os.path.realpath(p) for p in cands if p and os.path.exists(p)})
  system = [d for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
  out: list[str] = []
  for p in real:  # sorted: a parent comes before its children
    if not _under(p, out) and not _under(p, system):
      out.append(p)
  return tuple(out)


def _user_site() -> str | None:
  """The user site directory, only when the host interpreter actually uses it."""
  user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
  return user if user and user in sys.path and os.path.isdir(user) else None


@functools.cache
def _interpreter_args() -> tuple[str, ...]:
  args: list[str] = []
  for p in interpreter_paths():
    args += ["--ro-bind", p, p]
  for p in sorted({sys.prefix, sys.base_prefix}):  # a symlinked prefix keeps working by its name
    if os.path.islink(p) and not _under(p, interpreter_paths()):
      args += ["--symlink", os.path.realpath(p), p]
  return tuple(args)


@functools.cache
def search_path() -> str:
  """``PATH`` inside: the interpreter's script directories first, then the system's."""
  dirs = [os.path.dirname(sys.executable), os.path.join(sys.prefix, "bin"),
          os.path.join(sys.base_prefix, "bin"), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
          "/usr/bin", "/sbin", "/bin"]
  return ":".join(d for d in dict.fromkeys(dirs) if os.path.isdir(d))


def bwrap_available() -> bool:
  """Whether bubblewrap is installed and can create its namespaces here (checked once)."""
  global _BWRAP_OK
  if _BWRAP_OK is None:
    exe = shutil.which("bwrap")
    if exe is None:
      _BWRAP_OK = False
    else:
      try:
        r = subprocess.run([exe, "--unshare-all", *_system_args(False), "--proc", "/proc", "true"],
                           capture_output=True, timeout=20, env={"PATH": "/usr/bin:/bin"})
        _BWRAP_OK = r.returncode == 0
      except (OSError, subprocess.TimeoutExpired):
        _BWRAP_OK = False
  return _BWRAP_OK


@functools.cache
def _bwrap_sizes() -> bool:
  """Whether this bubblewrap takes ``--size`` for a tmpfs (0.6 and later)."""
  try:
    r = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return "--size" in r.stdout + r.stderr


def require_isolation(mode: str = "auto", what: str = "a model-driven run") -> str:
  """For anything a model drives: bubblewrap must work, whatever ``env.sandbox`` says (``off`` and
  ``auto`` fall back only for scripted policies and trusted set-up). Returns the mode to use."""
  if not bwrap_available():
    raise SandboxError(f"{what} needs the bubblewrap sandbox (env.sandbox={mode} does not apply to "
                       f"model-driven runs), and bwrap cannot run here: {INSTALL_HINT}")
  return "required"


# --------------------------------------------------------------------------------------------------
# Limits and clean-up
# --------------------------------------------------------------------------------------------------


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


# The call's first process: join the cgroups named by $1..$n (n = $0), fail closed if it cannot, and
# make the OOM killer take the call's processes first (raising oom_score_adj needs no privilege).
_JOIN = ('{ echo 1000 >/proc/self/oom_score_adj; } 2>/dev/null; n=$0; while [ "$n" -gt 0 ]; do '
         'echo $$ >"$1/cgroup.procs" || exit 125; shift; n=$((n-1)); done; exec "$@"')


def _wait_watched(proc: subprocess.Popen, timeout: float, watch) -> tuple[bool, str]:
  """Wait for ``proc`` (without reaping it) up to ``timeout``, running ``watch()`` between waits:
  (exited, why ``watch`` stopped it). The waits are 0.2 s, or ten times ``watch``'s own cost."""
  deadline = time.monotonic() + timeout
  interval = 0.2
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return False, ""
    if _wait_exit(proc, min(left, interval)):
      return True, ""
    t = time.monotonic()
    why = watch()
    if why:
      return False, why
    interval = max(0.2, 10 * (time.monotonic() - t))


# --------------------------------------------------------------------------------------------------
# The sandbox
# --------------------------------------------------------------------------------------------------


class Sandbox:
  """Runs commands inside ``workspace``.

  ``binds`` are extra read-write host paths (e.g. a report directory); ``ro_binds`` read-only ones
  (the task's environment); ``hide`` are host paths made empty inside (task stores, installed copies
  of the package under test); ``network`` keeps the host network (only for set-up commands that
  install dependencies). ``model_driven=True`` refuses to run without bubblewrap, whatever ``mode``.
  """

  def __init__(self, workspace: str, limits: Limits = Limits(), mode: str = "auto",
               binds: Sequence[str] = (), hide: Sequence[str] = (), network: bool = False,
               env: dict | None = None, ro_binds: Sequence[str] = (), model_driven: bool = False):
    if mode not in ("auto", "required", "off"):
      raise SandboxError(f"env.sandbox={mode!r}: choose auto, required or off")
    self.workspace = os.path.realpath(workspace)
    if not os.path.isdir(self.workspace):
      raise SandboxError(f"workspace {workspace!r} is not a directory: pass an existing directory")
    self.limits = limits
    self.binds = [os.path.realpath(b) for b in binds]
    self.ro_binds = [os.path.realpath(b) for b in ro_binds if os.path.exists(b)]
    self.hide = [os.path.realpath(h) for h in hide if os.path.exists(h)]
    self.network = network
    self.extra_env = dict(env or {})
    self.stopped: list[str] = []  # why each call stopped for its disk use (the episode ends on one)
    self._roots = [self.workspace, *self.binds]  # what a call may write to on the host
    bounded = limits.workspace_mb or limits.workspace_files
    self._base = quota.usage(self._roots) if bounded else quota.Usage(0, 0, 0)
    self.use_bwrap = False
    if model_driven:
      mode = require_isolation(mode, "a model-driven sandbox")
    if mode != "off":
      if bwrap_available():
        self.use_bwrap = True
      elif mode == "required":
        raise SandboxError(f"env.sandbox=required but bubblewrap cannot run here: {INSTALL_HINT}, "
                           "or set env.sandbox=auto (scripted policies only)")
      else:
        _warn_fallback()
    else:
      _note_off()

  @staticmethod
  def which(name: str) -> str | None:
    """Where ``name`` is found on the sandbox's ``PATH`` (host shims such as pyenv's are not on it)."""
    return shutil.which(name, path=search_path())

  def _env(self, extra: dict | None, home: str, tmp: str, marker: str) -> dict:
    env = {
        "PATH": search_path(),
        "HOME": home,
        "TMPDIR": tmp,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",  # no bytecode left for a later agent to decompile
        "PYTHONHASHSEED": "0",
        "TERM": "dumb",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "COMPOSER_JAX_SANDBOX_CALL": marker,
    }
    if _user_site():
      env["PYTHONUSERBASE"] = site.getuserbase()
    env.update(self.extra_env)
    env.update(extra or {})
    return env

  def _argv(self, cmd: list[str], cwd: str) -> list[str]:
    if not self.use_bwrap:
      return cmd
    sized = _bwrap_sizes()  # bubblewrap < 0.6 has no --size: the memory cgroup still bounds /tmp
    tmp_size = ["--size", str(self.limits.tmp_mb << 20)] if self.limits.tmp_mb > 0 and sized else []
    # /dev/shm (POSIX shared memory: multiprocessing's locks) is a tmpfs of the same size as /tmp.
    shm = [*tmp_size, "--tmpfs", "/dev/shm"] if tmp_size else []
    # --cap-drop ALL: run by root, bwrap keeps every capability inside, and CAP_SYS_ADMIN remounts
    # a read-only bind (/usr, the interpreter, ro_binds) read-write or unmounts a hide tmpfs.
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            *_system_args(self.network), "--dev", "/dev", *shm, "--proc", "/proc", *_PROC_RO, *tmp_size,
            "--tmpfs", "/tmp", "--dir", "/tmp/home", *_interpreter_args()]
    if self.network:
      argv += ["--share-net"]
    # Parents before children, so the most specific mount wins: a hidden store above a workspace
    # leaves the workspace visible, a hidden copy inside site-packages or the workspace stays empty.
    mounts = [(p, 0, ["--ro-bind", p, p]) for p in self.ro_binds]
    mounts += [(p, 0, ["--bind", p, p]) for p in [self.workspace, *self.binds]]
    visible = [*interpreter_paths(), *self.ro_binds, self.workspace, *self.binds, *_SYSTEM_DIRS]
    for h in self.hide:  # a path outside every visible mount does not exist inside anyway
      if _under(h, visible):
        # an empty read-only tmpfs: a hidden folder is no place to write (nor a sink of host memory)
        mounts.append((h, 1, [*(["--size", "4096"] if sized else []), "--tmpfs", h, "--remount-ro", h]
                       if os.path.isdir(h) else ["--ro-bind", "/dev/null", h]))
    for _, _, args in sorted(mounts, key=lambda m: (m[0].rstrip("/").count("/"), m[1])):
      argv += args
    # bubblewrap's root and /dev are tmpfs of up to half the host's memory each: read-only, they
    # are no place to write. What stays writable is bounded: the workspace and binds (``quota``),
    # /tmp and /dev/shm (``tmp_mb``; without --size, /dev stays writable and the cgroup bounds it).
    argv += ["--remount-ro", "/", *(["--remount-ro", "/dev"] if shm else []), "--chdir", cwd, "--"]
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
    watch = functools.partial(quota.over, self._roots, limits.workspace_mb, limits.workspace_files,
                              self._base)
    stopped = watch()
    if stopped:  # left over by an earlier call: nothing runs until the files are gone
      self.stopped.append(stopped)
      return ExecResult(125, f"[not run: {stopped}]", False, False, 0.0, self.use_bwrap, stopped)
    timed_out = False
    # Random only: the sandboxed process can read its own environment, and the host's pid or call
    # count is nothing it needs to see.
    marker = os.urandom(12).hex()
    # Without bwrap, HOME and TMPDIR are a fresh folder removed after the call (best effort).
    private = None if self.use_bwrap else tempfile.mkdtemp(prefix="cj-sb-")
    home, tmp = ("/tmp/home", "/tmp") if self.use_bwrap else (private, private)
    cgroup, joined = _make_call_cgroups(limits.max_procs, limits.memory_mb << 20)
    # Output goes to an unlinked file (bounded by RLIMIT_FSIZE), not a pipe a flood could stall.
    with tempfile.TemporaryFile() as out:
      try:
        argv = self._argv(cmd, cwd)
        limit_prefix = _limit_prefix(limits)
        # The first process joins the call's cgroups before anything runs, and puts itself (so every
        # process of the call) first in line for the OOM killer, before the learner or a worker.
        prefix = ["/bin/sh", "-c", _JOIN, str(len(joined)), *joined] + limit_prefix
        # With util-linux's prlimit/setarch there is no preexec_fn, so Python can vfork: a fork of a
        # big parent (an RL worker holding a model) is what makes a sandboxed call slow.
        proc = subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=cwd,
                                env=self._env(env, home, tmp, marker), start_new_session=True,
                                preexec_fn=None if limit_prefix else _set_limits(limits))
      except OSError as e:
        self._cleanup(None, cgroup, joined, private, marker)
        return ExecResult(127, f"cannot start command: {e}", False, False, 0.0, self.use_bwrap)
      exited, stopped = _wait_watched(proc, timeout, watch)
      timed_out = not exited and not stopped
      self._cleanup(proc, cgroup, joined, private, marker)
      stopped = stopped or watch()
      set_id = quota.drop_set_id(self._roots)
      code = 124 if timed_out else 125 if stopped else proc.returncode
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
    if set_id:
      text += f"\n[setuid/setgid bits cleared on {len(set_id)} file(s): the workspace keeps none]"
    if stopped:
      self.stopped.append(stopped)
      text += f"\n[command stopped: {stopped}]"
    return ExecResult(code, text, timed_out, clipped, time.perf_counter() - t0,
                      self.use_bwrap, stopped)

  def _cleanup(self, proc: subprocess.Popen | None, cgroup: str | None, joined: list[str],
               private: str | None, marker: str) -> None:
    """Nothing outlives the call: the group first (its leader is still an unreaped zombie, or alive
    on a timeout, so the id cannot have been reused), then reap, then whatever is left in the
    cgroup or, in the fallback without one, marked strays; last the private folder."""
    if proc is not None:
      _kill_group(proc.pid)
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if cgroup:
      _kill_cgroup(cgroup)
    for path in joined:
      _release_cgroup(path)
    if not cgroup and not self.use_bwrap:
      _kill_marked(f"COMPOSER_JAX_SANDBOX_CALL={marker}".encode())
    if private:
      scratch.remove_tree(private)


def _warn_fallback() -> None:
  global _WARNED
  if not _WARNED:
    _WARNED = True
    bar = "!" * 78
    print(f"{bar}\nWARNING: bubblewrap (bwrap) cannot run here; commands run with rlimits ONLY — no\n"
          "namespace isolation, the network and the whole file system are reachable. Only scripted\n"
          "policies and trusted set-up may run like this; model-driven runs refuse. Install it\n"
          f"(apt-get install -y bubblewrap) or set env.sandbox=required to refuse.\n{bar}",
          file=sys.stderr)


def _note_off() -> None:
  global _NOTED_OFF
  if not _NOTED_OFF:
    _NOTED_OFF = True
    print("composer-jax: env.sandbox=off: commands run with rlimits only (no bubblewrap); for scripted "
          "policies and trusted set-up only", file=sys.stderr)

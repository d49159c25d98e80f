"""A fake cluster for the multi-host tests: one `composer-jax` command as ``n`` processes of one
jax.distributed job on this machine (gloo collectives, 8 // n fake CPU devices each)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_cluster(args: list, n: int = 2, env: dict | None = None, timeout: float = 900) -> list:
  """`python -m composer_jax.cli ARGS` as ``n`` processes (``n`` = 1: a plain single-process run,
  8 devices); each process's (returncode, output)."""
  port = free_port()
  procs = []
  for i in range(n):
    e = dict(env or os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // n}")
    multi = []
    if n > 1:
      e.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(n),
               JAX_PROCESS_ID=str(i))
      multi = ["mesh.distributed=true"]
    procs.append(subprocess.Popen([sys.executable, "-m", "composer_jax.cli", *args, *multi], env=e,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      text, _ = p.communicate(timeout=timeout)
      outs.append((p.returncode, text))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs

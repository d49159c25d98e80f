"""Shared helpers for benchmarks: the machine's measured matmul peak and the results JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine_info() -> dict:
  import jax
  info = {
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }
  try:
    import flax
    info["flax"] = flax.__version__
  except ImportError:
    pass
  try:
    import jaxlib
    info["jaxlib"] = jaxlib.__version__
  except ImportError:
    pass
  if jax.default_backend() == "gpu":
    info["device_kind"] = jax.devices()[0].device_kind
  return info


def time_fn(fn, *args, warmup: int = 2, iters: int = 5) -> float:
  """Median wall seconds of ``fn(*args)`` (outputs blocked on)."""
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  times.sort()
  return times[len(times) // 2]


def matmul_peak_flops(n: int = 2048, dtype: str = "float32", iters: int = 5) -> float:
  """The machine's measured dense matmul FLOP/s (jitted n×n×n product), the denominator of MFU."""
  import jax
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  sec = time_fn(f, a, b, iters=iters)
  return 2.0 * n ** 3 / sec


class CpuMeter:
  """Machine-wide CPU use over a ``with`` block, every process counted (Ray's workers, the sandboxes,
  XLA's threads): ``busy_core_s`` (core-seconds not idle), ``wall_s``, ``busy_frac`` = busy /
  (wall x cores), ``steal_frac`` and ``own_core_s`` (the part spent by this process). The idle
  share is the most that overlapping more work could still use: a loop whose busy fraction is U
  cannot run more than 1 / U times faster on these cores doing the same CPU work."""

  def __enter__(self):
    import psutil
    self._t0, self._c0, self._own0 = time.perf_counter(), psutil.cpu_times(), self._own()
    return self

  @staticmethod
  def _own() -> float:  # this process's threads and its reaped children (e.g. the sync sandboxes)
    import psutil
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system

  def __exit__(self, *exc):
    import psutil
    c1, c0 = psutil.cpu_times(), self._c0
    self.wall_s = time.perf_counter() - self._t0
    d = lambda f: getattr(c1, f, 0.0) - getattr(c0, f, 0.0)  # guest time is already in user
    self.busy_core_s = sum(d(f) for f in ("user", "nice", "system", "irq", "softirq"))
    cores = self.wall_s * (os.cpu_count() or 1)
    self.busy_frac = self.busy_core_s / max(cores, 1e-9)
    self.steal_frac = d("steal") / max(cores, 1e-9)  # the hypervisor's: cores we asked for, not had
    self.own_core_s = self._own() - self._own0
    return False


def write_result(name: str, data: dict) -> str:
  os.makedirs(RESULTS_DIR, exist_ok=True)
  out = {
      "name": name,
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "machine": machine_info(),
      **data,
  }
  path = os.path.join(RESULTS_DIR, f"{name}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=2, default=float)
  print(f"wrote {path}")
  return path

"""Does one training step fit in the devices' memory? Asked before anything is compiled or allocated,
so a config that cannot fit stops with one line naming the fix, not with an XLA out-of-memory error
after the compile (or, on CPU, the kernel's OOM killer ending the process minutes in).

The need is a floor of ``train/plan.py``'s per-device plan of the step: parameters, optimizer state
and gradients are exact (shapes and partition specs), plus half the larger of the activation
estimate and the optimizer update. The activation model is within 0.98-1.26x of the temp bytes XLA
really allocates (tests/train/test_memory.py), so half of it stays below them: a refusal is a step
that cannot run, never a guess that it might not.

A device's memory: what its allocator may still take (``memory_stats``: bytes_limit - bytes_in_use)
on GPU/TPU; on CPU, where the devices share the host, this process's available host memory
(``available_memory_bytes``) split evenly between the local devices.
"""

from __future__ import annotations

import math
import os

import jax

from composer_jax.config import Config, ConfigError

# (mount, its /proc/self/cgroup controller field, limit file, usage file) of cgroup v2, then v1.
_CGROUPS = (("/sys/fs/cgroup", "", "memory.max", "memory.current"),
            ("/sys/fs/cgroup/memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))


def available_memory_bytes() -> int:
  """Memory this process can still get: /proc/meminfo's MemAvailable, lowered to what its memory
  cgroup's limit leaves (v2 or v1), so a container's limit counts, not the host's memory."""
  avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          avail = int(line.split()[1]) * 1024
  except OSError:
    pass
  left = _cgroup_left()
  return max(min(avail, left) if left is not None else avail, 0)


def _cgroup_left() -> int | None:
  """Bytes left under this process's memory cgroup limit; None without a limit or a cgroup."""
  try:
    with open("/proc/self/cgroup") as f:
      fields = {c: path for _, cs, path in (ln.rstrip("\n").split(":", 2) for ln in f)
                for c in cs.split(",")}
  except (OSError, ValueError):
    return None
  for mount, controller, limit_file, usage_file in _CGROUPS:
    if controller not in fields:
      continue
    # Inside a container the recorded path is the host's; the container sees its cgroup at the mount.
    for base in (os.path.join(mount, fields[controller].lstrip("/")), mount):
      try:
        with open(os.path.join(base, limit_file)) as f:
          limit = f.read().strip()
        with open(os.path.join(base, usage_file)) as f:
          usage = int(f.read())
      except (OSError, ValueError):
        continue
      if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
        return None
      return int(limit) - usage
  return None


def device_memory_bytes() -> tuple[int, str]:
  """(bytes the smallest local device can still allocate, what they are, in words)."""
  devs = jax.local_devices()
  stats = [d.memory_stats() for d in devs]
  if all(s and "bytes_limit" in s for s in stats):
    left = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    return left, f"{devs[0].platform.upper()} device ({left / 2**30:.1f} GiB free)"
  host = available_memory_bytes()
  share = host // len(devs)
  return share, (f"CPU device's share of the host ({share / 2**30:.1f} GiB: {host / 2**30:.1f} GiB "
                 f"available / {len(devs)} device(s))")


def step_floor(cfg: Config, seq_len: int, batch: int | None = None,
               n_devices: int | None = None) -> dict:
  """{"parts": the plan's per-device bytes, "floor": bytes one step needs at least, "mesh": sizes}
  for ``batch`` sequences of ``seq_len`` per batch shard per micro-step (default: data.batch_size
  over train.grad_accum and the batch shards)."""
  from composer_jax.parallel.rules import make_rules
  from composer_jax.train import plan as plan_lib
  sizes, n = plan_lib.mesh_sizes(cfg, n_devices or jax.device_count())
  cp = math.prod(sizes[a] for a in make_rules(cfg.mesh.rules)["act_seq"])
  if cp > 1:  # round down to what zigzag context parallelism can cut: still a floor
    seq_len = max(2 * cp, seq_len - seq_len % (2 * cp))
  step = plan_lib.memory_plan(cfg, n, seq_len, batch)["step"]
  b = step["bytes"]
  floor = b["params"] + b["optimizer"] + b["gradients"] + max(b["activations"], b["update"]) // 2
  return {"parts": b, "floor": floor, "mesh": sizes, "seq_len": seq_len}


def check_fits(cfg: Config, seq_len: int, batch: int | None, what: str,
               available: tuple[int, str] | None = None, extra=None, extra_fixes: str = "") -> dict:
  """Raise a one-line ConfigError when ``step_floor`` exceeds ``available`` (default: the local
  devices' memory, ``device_memory_bytes``); ``what`` says which step (e.g. "a data.seq_len=4096
  step"). ``extra(parts)`` gives {what: (bytes per device, devices)} held beside the step on its
  first device (the RL learner's sampler: ``rl/preflight.learner_extras``), and ``extra_fixes`` the
  fields that shrink them. Returns the floor, with ``extra`` and ``need`` (floor + extras)."""
  got = step_floor(cfg, seq_len, batch)
  got["extra"] = extra(got["parts"]) if extra else {}
  got["need"] = got["floor"] + sum(each for each, _ in got["extra"].values())
  have, where = available or device_memory_bytes()
  if got["need"] <= have:
    return got
  b = got["parts"]
  gib = lambda n: f"{n / 2**30:.2f}"
  mesh = " x ".join(f"{a}={s}" for a, s in got["mesh"].items() if s > 1) or "one device"
  beside = "".join(f", {name} {gib(each)}" for name, (each, _) in got["extra"].items() if each)
  raise ConfigError(
      f"{what} needs at least {gib(got['need'])} GiB per device (params {gib(b['params'])}, "
      f"optimizer {gib(b['optimizer'])}, gradients {gib(b['gradients'])}, half the activations "
      f"{gib(max(b['activations'], b['update']) // 2)}{beside}; mesh {mesh}), more than the {where}: "
      f"spread it over more devices (mesh.fsdp, mesh.expert), or set model.remat=full, or a smaller "
      f"batch per micro-step (train.grad_accum){', or ' + extra_fixes if extra_fixes and beside else ''}, "
      f"or plan a layout with `composer-jax params CONFIG --sharding --devices N --search`")


def check_training(cfg: Config, prefix: str = "") -> dict:
  """``check_fits`` for a language-model training step of ``cfg.data`` (pretraining, SFT)."""
  d = cfg.data
  return check_fits(cfg, d.seq_len, None, f"{prefix}a training step of data.seq_len={d.seq_len}, "
                    f"data.batch_size={d.batch_size} (train.grad_accum={cfg.train.grad_accum})")


__all__ = ["available_memory_bytes", "check_fits", "check_training", "device_memory_bytes",
           "step_floor"]

"""How much a busy rollout-worker-like process slows a learner-like XLA job on the same cores, at each
``rl.worker_priority`` (normal, low = nice 19, idle = SCHED_IDLE).

The learner stand-in is a jitted chain of small matmuls and tanh (the tiny config's ops are this
size), on XLA's default thread pool over every core. The worker stand-in is another process running
the same chain in a loop with XLA's Eigen pool on one thread, as ``configs/tiny.yaml`` runs its
rollout worker, put at each priority by ``rl/cpus.py::lower_priority`` itself. Prints and writes the
learner's median time beside each competitor divided by its time alone ->
results/cpu_priority.json.

  python experiments/cpu_priority.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import write_result

CHAIN = """
import jax, jax.numpy as jnp
x = jnp.ones((256, 256)); w = jnp.ones((256, 256)) * 1e-3
@jax.jit
def f(x):
  for _ in range(20):
    x = jnp.tanh(x @ w)
  return x
f(x).block_until_ready()
"""

WORKER = """
import os, sys
sys.path.insert(0, {root!r})
from composer_jax.rl.cpus import lower_priority
lower_priority({prio!r})  # before XLA starts its threads, as the rollout worker does
""" + CHAIN + """
while True:
  f(x).block_until_ready()
"""


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5, help="timed batches of 400 calls per setting")
  a = ap.parse_args(argv)
  ns: dict = {}
  exec(CHAIN, ns)  # noqa: S102 - our own constant
  f, x = ns["f"], ns["x"]

  def batch() -> float:
    t = time.perf_counter()
    for _ in range(400):
      y = f(x)
    y.block_until_ready()
    return time.perf_counter() - t

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false", JAX_PLATFORMS="cpu")
  times: dict = {}
  for name in ["alone", "normal", "low", "idle", "alone_again"]:
    p = None
    if not name.startswith("alone"):
      p = subprocess.Popen([sys.executable, "-c", WORKER.format(root=root, prio=name)], env=env)
      time.sleep(3.0)  # its compile done, its loop running
    ts = sorted(batch() for _ in range(a.reps))
    if p is not None:
      p.kill()
      p.wait()
    times[name] = ts[len(ts) // 2]
  alone = min(times["alone"], times["alone_again"])
  res = {"seconds_per_400_calls": times,
         "slowdown": {k: times[k] / alone for k in ("normal", "low", "idle")},
         "load_avg_at_start": os.getloadavg()}
  for k, v in res["slowdown"].items():
    print(f"learner beside a worker at priority {k}: {v:.2f}x its time alone")
  write_result("cpu_priority", res)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

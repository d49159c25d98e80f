"""Sandboxed tool calls per second on this machine (goal >= 40/s on 2 cores).

Two workloads through ToolBox.execute, each run by 1 and by 2 threads (one workspace each): `terminal`
only (every call starts a bubblewrap sandbox), and the agent's usual mix (view, search, str_replace +
undo, find, terminal, lint). Writes experiments/results/env_toolcalls.json.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax.env.demo import write_demo_repo
from composer_jax.env.protocol import ToolCall
from composer_jax.env.reaper import _cgroup_base
from composer_jax.env.sandbox import Limits, Sandbox, bwrap_available
from composer_jax.env.tools import ToolBox
from experiments.common import write_result

TERMINAL = [ToolCall("terminal", {"command": "ls calc && echo ok"})]
MIX = [ToolCall("view", {"path": "calc/core.py", "start": 1, "end": 20}),
       ToolCall("search", {"pattern": "def ", "path": "."}),
       ToolCall("str_replace", {"path": "calc/core.py", "old": "result = a + b", "new": "result = b + a"}),
       ToolCall("undo", {"path": "calc/core.py"}),
       ToolCall("find", {"pattern": "*.py"}),
       ToolCall("terminal", {"command": "python -c 'import calc; print(calc.add(1, 2))'"}),
       ToolCall("lint", {"path": "calc"})]


def rate(calls, seconds: float, threads: int) -> dict:
  def worker(_):
    with tempfile.TemporaryDirectory() as d:
      write_demo_repo(d)
      tb = ToolBox(Sandbox(d, Limits(timeout_s=30)))
      n, t0 = 0, time.perf_counter()
      while time.perf_counter() - t0 < seconds:
        for c in calls:
          assert tb.execute(c).ok, c
          n += 1
      return n, time.perf_counter() - t0
  with cf.ThreadPoolExecutor(threads) as pool:
    res = list(pool.map(worker, range(threads)))
  total = sum(n for n, _ in res)
  wall = max(t for _, t in res)
  return {"calls": total, "seconds": round(wall, 2), "calls_per_s": round(total / wall, 1)}


def main() -> None:
  out = {"bwrap": bwrap_available(), "pids_cgroup": _cgroup_base() is not None,
         "load_avg_before": os.getloadavg()}
  for name, calls in (("terminal", TERMINAL), ("mix", MIX)):
    for threads in (1, 2):
      r = rate(calls, 8.0, threads)
      out[f"{name}_{threads}thr"] = r
      print(f"{name:8s} x{threads}: {r['calls_per_s']:6.1f} calls/s")
  out["load_avg_after"] = os.getloadavg()
  out["goal_calls_per_s"] = 40
  out["note"] = ("allow-list view, env from scratch, a pids cgroup per call where one can be made "
                 "(issue 10). The machine is shared: load averages are recorded because other jobs "
                 "slow bwrap start-up (a run at load ~2 measured 73 calls/s with one thread before "
                 "issue 10); a run at a load well above the 2 cores is a figure taken under load")
  write_result("env_toolcalls", out)


if __name__ == "__main__":
  main()

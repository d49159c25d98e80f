"""The training memory preflight (train/fit.py): its floor against what XLA allocates for the real
step, the devices' memory, and the one-line refusals before anything is allocated."""

from __future__ import annotations

import io
import types

import jax
import jax.numpy as jnp
import pytest

from composer_jax import cli
from composer_jax.config import ConfigError, load_config
from composer_jax.rl import preflight
from composer_jax.train import fit
from composer_jax.train import loop as train_loop


def tiny(*overrides):
  return load_config("configs/tiny.yaml", list(overrides))


@pytest.mark.parametrize("overrides", [[], ["data.seq_len=512", "data.batch_size=4", "train.grad_accum=2"]])
def test_the_floor_is_below_what_xla_allocates_for_the_real_step(overrides):
  """The jitted train step (optimizer and accumulation included) on one device: XLA's live bytes are
  its arguments (the state), the outputs it does not alias onto them, and its temporaries. The floor
  stays below them, and is no vacuous bound either. Measured: 0.72 (seq 128 x 8), 0.78 (512 x 4 in
  two micro-steps)."""
  from composer_jax.train.step import make_train_step
  cfg = tiny(*overrides)
  tr = train_loop.build_trainer(cfg, materialize=False)
  n, s = cfg.data.batch_size, cfg.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((n, s), jnp.int32) for k in ("tokens", "segment_ids", "positions", "loss_mask")}
  step = jax.jit(make_train_step(tr.graphdef, cfg, tr.tx, tr.lr_fn), donate_argnums=(0,))
  mem = step.lower(tr.state, batch).compile().memory_analysis()
  xla = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
         + mem.temp_size_in_bytes)
  got = fit.step_floor(cfg, s, n_devices=1)
  b = got["parts"]
  assert got["floor"] == (b["params"] + b["optimizer"] + b["gradients"]
                          + max(b["activations"], b["update"]) // 2)
  print(f"{overrides}: floor / XLA = {got['floor'] / xla:.2f}")
  assert 0.4 * xla <= got["floor"] <= xla


def test_a_cpu_device_gets_its_share_of_the_host_and_an_accelerator_what_its_allocator_has_left(monkeypatch):
  monkeypatch.setattr(fit, "available_memory_bytes", lambda: 12 << 30)
  n = len(jax.local_devices())
  have, where = fit.device_memory_bytes()
  assert have == (12 << 30) // n and where.startswith("CPU device's share of the host")
  gpu = lambda limit, used: types.SimpleNamespace(platform="gpu", memory_stats=lambda: {
      "bytes_limit": limit, "bytes_in_use": used})
  monkeypatch.setattr(jax, "local_devices", lambda: [gpu(80 << 30, 1 << 30), gpu(80 << 30, 3 << 30)])
  assert fit.device_memory_bytes() == (77 << 30, "GPU device (77.0 GiB free)")


def test_a_step_that_cannot_fit_is_one_line_before_the_run_writes_or_allocates(tmp_path, monkeypatch):
  cfg = tiny()
  need = fit.step_floor(cfg, cfg.data.seq_len)["floor"]
  monkeypatch.setattr(fit, "device_memory_bytes", lambda: (need - 1, "CPU device's share of the host"))
  monkeypatch.setattr(train_loop, "init_state", lambda *a: pytest.fail("weights were made"))
  out = tmp_path / "run"
  with pytest.raises(ConfigError) as e:
    train_loop.run(cfg, str(out))
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(
      "a training step of data.seq_len=128, data.batch_size=8 (train.grad_accum=1) needs at least")
  assert "more than the CPU device's share of the host" in msg and "--search" in msg
  assert list(out.iterdir()) == []  # no tokenizer, data or checkpoint
  monkeypatch.setattr(fit, "device_memory_bytes", lambda: (need, "enough"))
  assert fit.check_training(cfg)["floor"] == need  # exactly the floor fits


def test_a_pod_config_on_one_host_is_refused_with_what_it_needs():
  cfg = load_config("configs/kimi-k2.yaml", [])
  with pytest.raises(ConfigError) as e:
    fit.check_training(cfg)
  msg = str(e.value)
  assert "\n" not in msg and "needs at least" in msg and "spread it over more devices" in msg
  need = float(msg.split("needs at least ")[1].split(" GiB")[0])
  assert need > 1000  # a trillion parameters and their optimizer state on one device


def test_the_rl_learners_largest_step_counts_every_row_it_may_train_on():
  rl = ["rl.tasks_per_step=4", "rl.group_size=8", "rl.sft_mix_coef=0.5", "rl.sft_mix_rows=8",
        "rl.sft_mix_path=chats.jsonl"]
  # One device: 4 x 8 group rows + 8 chats, each up to rl.max_context.
  assert preflight.learner_shape(tiny(*rl), n_devices=1) == (2048, 40)
  # quantum = grad_accum 1 x minibatches 2 x data 2 x expert 2 = 8: 32 / 8 + 8 / 8 rows a shard.
  mesh = ["mesh.data=2", "mesh.expert=2", "mesh.fsdp=1", "rl.minibatches=2"]
  assert preflight.learner_shape(tiny(*rl, *mesh), n_devices=4) == (2048, 5)
  # Packed rows: at least one quantum of rl.pack_length; no chats without their coefficient.
  assert preflight.learner_shape(tiny(*rl[:2], "rl.pack_length=1024"), n_devices=1) == (1024, 1)


def test_the_main_job_refuses_an_rl_stage_that_cannot_fit_before_it_writes_anything(tmp_path, monkeypatch, capsys):
  base = tiny()
  pre = fit.step_floor(base, base.data.seq_len)["floor"]
  monkeypatch.setattr(fit, "device_memory_bytes", lambda: (4 * pre, "test device"))
  out = tmp_path / "run"
  assert cli.main(["run", "configs/tiny.yaml", "--out", str(out)]) == 2
  assert not out.exists()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "run.rl_overrides: the RL learner's step of " in err[0]


def test_available_memory_is_meminfo_lowered_to_the_cgroup_limit(monkeypatch):
  with open("/proc/meminfo") as f:
    fields = dict(ln.split(":", 1) for ln in f)
  meminfo = int(fields["MemAvailable"].split()[0]) * 1024
  got = fit.available_memory_bytes()
  assert 0 < got <= meminfo * 1.05  # MemAvailable moves between the two reads
  monkeypatch.setattr(fit, "_cgroup_left", lambda: 123 << 20)
  assert fit.available_memory_bytes() == 123 << 20


def test_cgroup_limit_is_read_from_v2_and_v1_layouts(monkeypatch):
  real_open = open

  def fake_files(files):
    def fake_open(path, *a, **kw):
      path = str(path)
      if path in files:
        return io.StringIO(files[path])
      if path.startswith("/proc/self/cgroup") or path.startswith("/sys/fs/cgroup"):
        raise FileNotFoundError(path)
      return real_open(path, *a, **kw)
    monkeypatch.setattr("builtins.open", fake_open)

  fake_files({"/proc/self/cgroup": "0::/job\n", "/sys/fs/cgroup/job/memory.max": "1000\n",
              "/sys/fs/cgroup/job/memory.current": "400\n"})
  assert fit._cgroup_left() == 600
  # A container: the recorded path is the host's, the limit sits at the mount's root.
  fake_files({"/proc/self/cgroup": "4:memory:/docker/abc\n0::/\n",
              "/sys/fs/cgroup/memory/memory.limit_in_bytes": "2000\n",
              "/sys/fs/cgroup/memory/memory.usage_in_bytes": "500\n"})
  assert fit._cgroup_left() == 1500
  fake_files({"/proc/self/cgroup": "4:memory:/\n", "/sys/fs/cgroup/memory/memory.limit_in_bytes":
              "9223372036854771712\n", "/sys/fs/cgroup/memory/memory.usage_in_bytes": "5\n"})
  assert fit._cgroup_left() is None  # v1's "no limit"
  fake_files({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": "max\n",
              "/sys/fs/cgroup/memory.current": "5\n"})
  assert fit._cgroup_left() is None

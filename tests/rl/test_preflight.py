"""The RL stage's machine checks (rl/preflight.py): a Ray address that answers, a store that fits, cores
to pin; each wrong input is one line naming the field, before the main job writes anything."""

import os
import socket

import pytest

from composer_jax import cli
from composer_jax.config import ConfigError, load_config
from composer_jax.rl import preflight


@pytest.fixture(autouse=True)
def _no_env_address(monkeypatch, tmp_path):
  monkeypatch.delenv("RAY_ADDRESS", raising=False)
  monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))  # no `ray start` record unless a test writes one
  monkeypatch.setattr(preflight, "_gcs_running", lambda: False)
  # A listening socket stands in for a head; the GCS probe has tests of its own below.
  monkeypatch.setattr(preflight, "cluster_metadata", lambda addr, timeout_s: {})


_PROBE = preflight.cluster_metadata


@pytest.fixture
def listening():
  """host:port of a socket that accepts connections, as a Ray head's GCS port would."""
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  s.listen()
  yield f"127.0.0.1:{s.getsockname()[1]}"
  s.close()


def _closed_port() -> int:
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()  # nothing listens there now
  return port


def _check(*overrides):
  preflight.check(load_config(None, list(overrides)), timeout_s=2.0)


def _error(*overrides) -> str:
  with pytest.raises(ConfigError) as e:
    _check(*overrides)
  msg = str(e.value)
  assert "\n" not in msg
  return msg


def test_an_address_that_answers_passes_in_both_forms(listening):
  _check(f"rl.ray_address={listening}")
  _check(f"rl.ray_address=ray://{listening}")
  _check("rl.ray_address=local")  # ray.init starts a new local cluster: nothing to reach


def test_an_address_where_nothing_listens_is_one_line_naming_the_field():
  port = _closed_port()
  msg = _error(f"rl.ray_address=127.0.0.1:{port}")
  assert msg.startswith(f"rl.ray_address='127.0.0.1:{port}': nothing answers at 127.0.0.1:{port}")
  assert f"ray start --head --port {port}" in msg and "leave rl.ray_address empty" in msg
  assert "client server listens on 10001" in _error(f"rl.ray_address=ray://127.0.0.1:{port}")


def test_a_name_the_resolver_never_answers_for_is_refused_within_the_timeout(monkeypatch):
  import threading
  import time
  seen, release = [], threading.Event()

  def hang(*a, **k):  # then fail as a resolver does, so the lookup thread ends quietly
    seen.append(a)
    release.wait(30)
    raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

  monkeypatch.setattr(preflight.socket, "getaddrinfo", hang)
  t0 = time.monotonic()
  with pytest.raises(ConfigError) as e:
    preflight.check(load_config(None, ["rl.ray_address=head.example:6379"]), timeout_s=0.5)
  release.set()
  assert time.monotonic() - t0 < 5 and seen[0][:2] == ("head.example", 6379)
  assert str(e.value) == ("rl.ray_address='head.example:6379': looking up 'head.example' took over "
                          "0.5 s: check the name and this machine's DNS, or give the head's IP address")


@pytest.mark.parametrize("addr", ["http://head:8265", "head", "head:port", "head:0", "head:70000", ":6379",
                                  "ray://head"])
def test_what_is_not_a_ray_address_says_which_forms_are(addr):
  assert _error(f"rl.ray_address={addr}") == (
      f"rl.ray_address={addr!r} is not a Ray address: give 'auto', 'host:port' (the head's GCS port, "
      "6379 by default) or 'ray://host:port'")


def test_auto_needs_a_cluster_started_on_this_machine(tmp_path, listening, monkeypatch):
  assert "finds no Ray cluster started on this machine" in _error("rl.ray_address=auto")
  monkeypatch.setattr(preflight, "_gcs_running", lambda: True)  # Ray's fallback finds a running head
  _check("rl.ray_address=auto")
  monkeypatch.setattr(preflight, "_gcs_running", lambda: False)
  (tmp_path / "raytmp" / "ray").mkdir(parents=True)
  record = tmp_path / "raytmp" / "ray" / "ray_current_cluster"
  record.write_text(listening + "\n")  # what `ray start --head` records
  _check("rl.ray_address=auto")
  record.write_text(f"127.0.0.1:{_closed_port()}")  # a head that has stopped
  assert "nothing answers" in _error("rl.ray_address=auto")


def test_ray_address_in_the_environment_is_the_address_ray_joins(monkeypatch, listening):
  port = _closed_port()
  monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
  msg = _error()
  assert msg.startswith(f"RAY_ADDRESS='127.0.0.1:{port}': nothing answers")
  assert "unset RAY_ADDRESS" in msg
  assert _error(f"rl.ray_address={listening}").startswith(f"rl.ray_address={listening!r} but RAY_ADDRESS=")
  monkeypatch.setenv("RAY_ADDRESS", listening)
  _check()
  assert preflight.ray_address(load_config(None, []).rl) == listening


def test_the_orchestrator_joins_ray_address_from_the_environment(monkeypatch, listening):
  """With RAY_ADDRESS set, ray.init joins it whatever it is passed, and then it refuses num_cpus and
  a store size: the orchestrator passes neither and pins nothing."""
  pytest.importorskip("ray")
  import ray

  from composer_jax.rl import orchestrator
  seen = {}

  class Stop(Exception):
    pass

  def fake_init(**kw):
    seen.update(kw)
    raise Stop

  monkeypatch.setattr(ray, "is_initialized", lambda: False)
  monkeypatch.setattr(ray, "init", fake_init)
  monkeypatch.setenv("RAY_ADDRESS", listening)
  with pytest.raises(Stop):
    orchestrator.Orchestrator(load_config(None, ["rl.object_store_mb=256"]), "", log=lambda m: None)
  assert seen["address"] == listening and "num_cpus" not in seen and "object_store_memory" not in seen
  monkeypatch.delenv("RAY_ADDRESS")
  with pytest.raises(Stop):
    orchestrator.Orchestrator(load_config(None, ["rl.object_store_mb=256"]), "", log=lambda m: None)
  assert seen["address"] == "local" and seen["object_store_memory"] == 256 << 20


def test_a_store_larger_than_memory_allows_and_cores_the_learner_needs_are_refused(monkeypatch):
  monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 1000 << 20)
  monkeypatch.setattr(preflight, "worker_bytes", lambda cfg: {"total": 1 << 20})  # its own test below
  _check("rl.object_store_mb=500")
  assert _error("rl.object_store_mb=501") == (
      "rl.object_store_mb=501 preallocates more than 50% of the 1000 MiB of memory available here: give "
      "at most 500, or 0 for Ray's default (sized and filled lazily)")
  _check("rl.object_store_mb=0")
  cores = len(os.sched_getaffinity(0))
  assert _error(f"rl.worker_cpus={cores}") == (
      f"rl.worker_cpus={cores} leaves the learner no core: this process may run on {cores}; give at "
      f"most {cores - 1}, or 0 for no pinning")
  if cores > 1:
    _check(f"rl.worker_cpus={cores - 1}")
  _check(f"rl.worker_cpus={cores}", "rl.object_store_mb=100000", "rl.async=false")  # no Ray at all
  # Joining a cluster, neither is this machine's business.
  monkeypatch.setattr(preflight, "_check_cluster", lambda *a: None)
  _check("rl.ray_address=head:6379", f"rl.worker_cpus={cores}", "rl.object_store_mb=100000")


GANG = ["rl.worker_hosts=2", "rl.worker_devices=1", "rl.learner_sampler=mesh"]  # one worker, two processes


def test_a_workers_memory_is_the_runtime_the_weights_and_a_cpu_samplers_latent_cache():
  cfg = load_config("configs/tiny.yaml", [])
  m, rl = cfg.model, cfg.rl
  got = preflight.worker_bytes(cfg)
  # Independent of the modules: float32 parameters as counted, and MLA's cache of one latent
  # (kv_lora_rank) and one shared rope key (qk_rope_dim) per token, layer and slot, plus each slot's
  # int32 fill index.
  from composer_jax.model.build import count_params
  assert got["params"] == 4 * count_params(cfg)["total"]
  latent = m.n_layers * rl.decode_batch * rl.max_context * (m.kv_lora_rank + m.qk_rope_dim) * 4
  latent += m.n_layers * rl.decode_batch * 4
  assert got["cache"] == int(preflight.CACHE_COPIES * latent)
  assert got["total"] == (preflight.WORKER_RUNTIME_MB << 20) + got["params"] + got["cache"]
  bigger = preflight.worker_bytes(load_config("configs/tiny.yaml", [f"rl.decode_batch={4 * rl.decode_batch}"]))
  assert bigger["cache"] == 4 * got["cache"] and bigger["params"] == got["params"]
  # A gang's member holds half of both; a GPU sampler's cache is on the device, not the host.
  gang = preflight.worker_bytes(load_config("configs/tiny.yaml", GANG))
  assert gang["total"] - gang["runtime"] == (got["params"] + got["cache"]) // 2
  gpu = preflight.worker_bytes(load_config("configs/tiny.yaml", ["rl.worker_platform=gpu", "rl.worker_devices=1"]))
  assert gpu["cache"] == 0 and gpu["params"] == got["params"]


def test_more_workers_than_memory_holds_are_refused_with_how_many_fit(monkeypatch):
  each = preflight.worker_bytes(load_config(None, []))["total"]
  monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 4 * each + (1 << 20))
  _check("rl.num_workers=4")
  msg = _error("rl.num_workers=5")
  assert msg.startswith(f"rl.num_workers=5: 5 rollout worker process(es) need at least {5 * each >> 20} MiB")
  assert "give at most 4," in msg and "\n" not in msg
  # Gangs count every member; a preallocated store takes its share first.
  assert "give at most 2," in _error("rl.num_workers=3", *GANG)
  assert "give at most 3," in _error("rl.num_workers=4", f"rl.object_store_mb={(each >> 20) + 1}")
  # A new local Ray sized by Ray itself still runs its workers here.
  assert _error("rl.num_workers=5", "rl.ray_address=local").startswith("rl.num_workers=5: 5 rollout")
  monkeypatch.setattr(preflight, "_check_cluster", lambda *a: None)
  _check("rl.num_workers=50", "rl.ray_address=head:6379")  # the cluster's memory, not this machine's


def test_the_main_job_refuses_a_dead_address_before_it_writes_anything(tmp_path, capsys):
  out = tmp_path / "run"
  port = _closed_port()
  assert cli.main(["run", "configs/tiny.yaml", "--out", str(out), f"rl.ray_address=127.0.0.1:{port}"]) == 2
  assert not out.exists()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"rl.ray_address='127.0.0.1:{port}': nothing answers" in err[0]
  # The RL stage's own overrides count: a store it would preallocate is checked as it would run.
  assert cli.main(["run", "configs/tiny.yaml", "--out", str(out), "run.rl_overrides=[rl.worker_cpus=999]"]) == 2
  assert not out.exists() and "rl.worker_cpus=999" in capsys.readouterr().err


def test_a_port_that_does_not_speak_gcs_is_refused_within_its_timeout(monkeypatch, listening):
  """The dashboard's port, say: it accepts TCP, and ray.init would retry there for a minute."""
  pytest.importorskip("ray")
  monkeypatch.setattr(preflight, "cluster_metadata", _PROBE)
  msg = _error(f"rl.ray_address={listening}")
  assert msg.startswith(f"rl.ray_address={listening!r}: {listening} accepts connections but does "
                        "not answer as a Ray GCS within 2 s")
  assert "give the GCS port, or leave rl.ray_address empty" in msg
  _check(f"rl.ray_address=ray://{listening}")  # the client server checks versions when joined


def test_a_cluster_of_other_versions_is_refused_as_ray_init_would(monkeypatch, listening):
  ray = pytest.importorskip("ray")
  import sys
  py = ".".join(map(str, sys.version_info[:3]))
  meta = {}
  monkeypatch.setattr(preflight, "cluster_metadata", lambda addr, timeout_s: meta)
  meta.update(ray_version="2.0.0", python_version=py)
  assert _error(f"rl.ray_address={listening}") == (
      f"rl.ray_address={listening!r}: the cluster runs Ray 2.0.0 on Python {py}, this process Ray "
      f"{ray.__version__} on Python {py}, and Ray joins only the same versions: install "
      f"ray==2.0.0 under Python {py} here, or leave rl.ray_address empty")
  other = f"{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2] + 1}"
  meta.update(ray_version=ray.__version__, python_version=other)
  assert "the cluster runs Ray" in _error(f"rl.ray_address={listening}")  # ray.init matches patches
  monkeypatch.setenv("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", "minor")  # ... unless told not to
  _check(f"rl.ray_address={listening}")
  meta.update(python_version=py)
  monkeypatch.delenv("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL")
  _check(f"rl.ray_address={listening}")


def test_a_running_gcs_answers_with_the_versions_it_recorded_and_checks_the_token(monkeypatch, tmp_path):
  ray = pytest.importorskip("ray")
  import tempfile
  monkeypatch.setattr(preflight, "cluster_metadata", _PROBE)
  monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="cj-ray-"))  # sockets: <= 107 bytes a path
  ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
           configure_logging=False)
  try:
    addr = ray.get_runtime_context().gcs_address
    meta = preflight.cluster_metadata(addr, 3.0)
    assert meta["ray_version"] == ray.__version__ and meta["python_version"] == preflight._ours()[1]
    _check(f"rl.ray_address={addr}")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-clusters")
    if "error" not in (preflight.cluster_metadata(addr, 3.0) or {"error": 1}):
      return  # a Ray without token authentication (before 2.5x): any token is let in
    assert _error(f"rl.ray_address={addr}") == (
        f"rl.ray_address={addr!r}: the cluster at {addr} refused this process's Ray auth token: put "
        "the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN, or leave "
        "rl.ray_address empty")
  finally:
    ray.shutdown()


def test_an_rl_learner_step_that_cannot_fit_is_refused_before_the_run_writes(world, tmp_path, monkeypatch):
  from composer_jax.env import sandbox
  from composer_jax.rl.loop import RLRun
  from composer_jax.train import fit
  from tests.rl.conftest import MODEL, RL
  if not sandbox.bwrap_available():
    pytest.skip("bubblewrap cannot run here (apt-get install -y bubblewrap)")
  _, init, tasks = world
  cfg = load_config(None, MODEL + RL + [f"rl.tasks={tasks}"])
  need = preflight.check_learner(cfg)["need"]  # fits this machine
  monkeypatch.setattr(fit, "device_memory_bytes", lambda: (need - 1, "test device"))
  out = tmp_path / "rl"
  with pytest.raises(ConfigError) as e:
    RLRun(cfg, str(out), init=init)
  assert "\n" not in str(e.value) and str(e.value).startswith("the RL learner's step of ")
  assert not out.exists()  # no tokenizer copy, config or rollout file


def test_on_cpu_the_workers_get_the_memory_the_learners_largest_step_leaves(monkeypatch):
  """The learner's CPU devices share the host with the local workers: its floor on each local
  device (train/fit.py) comes off the memory the workers may take, and the refusal says so."""
  import jax

  from composer_jax.train import fit
  cfg = load_config(None, [])
  got = fit.step_floor(cfg, *preflight.learner_shape(cfg))
  got["extra"] = preflight.learner_extras(cfg, got["parts"]["params"])
  (cache, _), = got["extra"].values()  # the learner's own sampler's cache, whole on one device
  learner = got["floor"] * len(jax.local_devices()) + cache
  assert preflight.learner_host_bytes(cfg, got) == learner > cache > 0
  each = preflight.worker_bytes(cfg)["total"]
  monkeypatch.setattr(preflight, "available_memory_bytes", lambda: learner + 2 * each + (1 << 20))
  monkeypatch.setattr(fit, "available_memory_bytes", lambda: 64 << 30)  # the step itself fits
  cfg2, cfg3 = (load_config(None, [f"rl.num_workers={n}"]) for n in (2, 3))
  preflight.check_learner(cfg2)
  with pytest.raises(ConfigError) as e:
    preflight.check_learner(cfg3)
  assert f"available here beside the learner's step ({learner >> 20} MiB): give at most 2," in str(e.value)
  with pytest.raises(ConfigError) as e:  # under `composer-jax run` the refusal names the override list
    preflight.check_learner(cfg3, "run.rl_overrides: ")
  assert str(e.value).startswith("run.rl_overrides: rl.num_workers=3: 3 rollout worker process(es)")
  assert "learner" not in _error("rl.num_workers=3")  # the config-time check reads no device
  # Workers on a cluster, or a learner on an accelerator, take nothing from this host's workers.
  assert preflight.learner_host_bytes(load_config(None, ["rl.ray_address=10.0.0.1:6379"]), got) == 0
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert preflight.learner_host_bytes(cfg3, got) == 0
  preflight.check_learner(cfg3)


def test_the_learner_jobs_sampler_and_frozen_policy_count_beside_its_step(monkeypatch):
  """Beside its step the learner job holds its own sampler's latent cache (sync rollouts, the
  evaluations), a copy of the policy for that sampler unless it reads the trainer's arrays, and the
  frozen policy of rl.kl_coef: counted per device as evenly as each layout splits, against an
  independent count of the cache's arrays."""
  import jax

  from composer_jax.train import fit
  cfg = load_config(None, [])
  m, rl = cfg.model, cfg.rl
  layer = rl.decode_batch * rl.max_context * (m.kv_lora_rank + m.qk_rope_dim) * 4 + rl.decode_batch * 4
  cache, params = m.n_layers * layer, preflight.worker_bytes(cfg)["params"]
  name = "the learner's own sampler's cache (on 1 device(s) of the leader: rl.decode_batch x rl.max_context)"
  assert preflight.learner_extras(cfg, 123) == {name: (cache, 1)}  # one process: the trainer's arrays
  kl = preflight.learner_extras(load_config(None, ["rl.kl_coef=0.1"]), 123)
  assert kl["the frozen policy (rl.kl_coef, rl.feedback_teacher=frozen)"] == (123, jax.device_count())
  four = preflight.learner_extras(load_config(None, ["rl.worker_devices=4"]), 123)
  assert sorted(four.values()) == sorted([(-(-cache // 4), 4), (-(-params // 4), 4)])
  n = jax.device_count()
  assert list(preflight.learner_extras(load_config(None, ["rl.learner_sampler=mesh"]), 123).values()) == [
      (-(-cache // n), n)]
  # The refusal: exactly the step and its extras fit; a byte less is one line naming the cache and
  # the fields that shrink it.
  got = preflight.check_learner(cfg)
  assert got["need"] == got["floor"] + cache
  monkeypatch.setattr(fit, "device_memory_bytes", lambda: (got["need"], "test device"))
  preflight.check_learner(cfg)
  monkeypatch.setattr(fit, "device_memory_bytes", lambda: (got["need"] - 1, "test device"))
  with pytest.raises(ConfigError) as e:
    preflight.check_learner(cfg, "run.rl_overrides: ")
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("run.rl_overrides: the RL learner's step of ")
  assert f", {name} {cache / 2**30:.2f}; mesh " in msg
  assert "or a smaller rl.decode_batch or rl.max_context, rl.learner_sampler=mesh or more rl.worker_devices" in msg

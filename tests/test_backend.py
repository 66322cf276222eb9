"""Device, dist backend, threads and precision resolution on this CPU machine."""

import os

import pytest
import torch

from rltpu.chips import backend
from rltpu.config import BackendConfig


@pytest.fixture
def restore_state(monkeypatch):
    """Keep global torch/jax/env state as it was after each test."""
    import jax

    prec = torch.get_float32_matmul_precision()
    jprec = jax.config.jax_default_matmul_precision
    threads = torch.get_num_threads()
    env = {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS")}
    yield
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.set_float32_matmul_precision(prec)
    jax.config.update("jax_default_matmul_precision", jprec)
    torch.set_num_threads(threads)


def test_resolve_device_cpu_here():
    assert backend.resolve_device("auto") == "cpu"
    assert backend.resolve_device("cpu") == "cpu"


def test_resolve_device_explicit_unavailable():
    with pytest.raises(backend.ChipUnavailableError, match="tpu"):
        backend.resolve_device("tpu")  # emulated chips: a TPU device is a contradiction, not a fallback
    if not torch.cuda.is_available():
        with pytest.raises(backend.ChipUnavailableError, match="cuda"):
            backend.resolve_device("cuda")
    with pytest.raises(ValueError):
        backend.resolve_device("gpu")


def test_dist_backend():
    assert backend.dist_backend("cpu") == "gloo"
    assert backend.dist_backend("cuda") == "nccl"
    assert backend.dist_backend("tpu") == "tpu"  # TorchTPU registers "tpu" (and "tpu_dist"), not "xla"
    with pytest.raises(ValueError):
        backend.dist_backend("xla")


@pytest.mark.parametrize("level", ["medium", "high", "highest"])
def test_precision_changes_torch_and_jax(level, restore_state):
    import jax

    out = backend.configure_precision(level)
    assert torch.get_float32_matmul_precision() == level
    assert jax.config.jax_default_matmul_precision == backend.JAX_PRECISION[level]
    assert out["jax_matmul_precision"] == {"medium": "bfloat16", "high": "tensorfloat32", "highest": "float32"}[level]


def test_precision_before_jax_is_imported_costs_no_jax_import():
    """A trainer process never imports JAX (its import took 1-4 s of its chip claim): the precision waits
    in the environment and a later import of JAX still gets it."""
    import subprocess
    import sys

    code = ("import sys; from rltpu.chips import backend; backend.configure_precision('high'); "
            "print('jax' in sys.modules); import jax; print(jax.config.jax_default_matmul_precision)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "tensorfloat32"]


def test_precision_rejects_unknown():
    with pytest.raises(ValueError):
        backend.configure_precision("fast")


def test_configure_threads_sets_torch_and_xla_flags(restore_state, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=true")
    out = backend.configure_threads(1)
    assert torch.get_num_threads() == 1 and out["threads"] == 1
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=2" in flags  # foreign flags are kept
    assert flags.count("--xla_cpu_multi_thread_eigen=false") == 1
    assert not any(f.startswith("--xla_cpu_multi_thread_eigen=true") for f in flags)
    assert out["interop_threads"] >= 1


def test_configure_threads_warns_after_jax_started(restore_state, monkeypatch):
    monkeypatch.setattr(backend, "_jax_backend_started", lambda: True)
    with pytest.warns(RuntimeWarning, match="after JAX initialised"):
        out = backend.configure_threads(1)
    assert out["xla_flags_applied"] is False


def test_merge_xla_flags():
    assert backend._merge_xla_flags("", {"--a": "1"}) == "--a=1"
    assert backend._merge_xla_flags("--a=0 --b=2", {"--a": "1"}) == "--b=2 --a=1"


def test_jax_platform_env():
    emu = backend.decide("sampler", True, BackendConfig())
    assert backend.jax_platform_env(emu) == {"JAX_PLATFORMS": "cpu"}
    real = backend.decide("sampler", False, BackendConfig(), probe_jax=lambda: None)
    assert backend.jax_platform_env(real) == {"JAX_PLATFORMS": "tpu"}


def test_apply_reports(restore_state):
    out = backend.apply(BackendConfig(matmul_precision="high", threads=1))
    assert out["device"] == "cpu" and out["dist_backend"] == "gloo" and out["emulated"] is True
    assert out["runtime"] == "cpu"
    assert out["threads"] == 1 and out["matmul_precision"] == "high"
    assert out["jax_matmul_precision"] == "tensorfloat32"
    assert torch.get_float32_matmul_precision() == "high"
    # reported as it is in this process (set here unless JAX had already started, e.g. earlier tests)
    assert os.environ.get("JAX_PLATFORMS") == out["jax_platforms"]


# -- the backend decision from a chip claim (issue 15, acceptance 2) ----------------------------------

class FakeAccelerator:
    """A visible TorchTPU device, as ``torch.accelerator.current_accelerator()`` reports one."""

    type = "tpu"


def _fake_tpu(monkeypatch, device_visible: bool):
    """torch_tpu imports for real (it is installed); only the device it would find is faked."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *a, **k: FakeAccelerator() if device_visible else None)


@pytest.mark.parametrize("role", ["trainer", "sampler", "reward"])
def test_emulated_chip_is_cpu_for_torch_and_jax(role):
    d = backend.decide(role, True, BackendConfig())
    assert (d.torch_device, d.jax_platforms, d.dist_backend, d.runtime) == ("cpu", "cpu", "gloo", "cpu")


def test_real_chip_with_a_visible_device_is_tpu_tpu(monkeypatch):
    pytest.importorskip("torch_tpu")
    _fake_tpu(monkeypatch, True)
    d = backend.decide("trainer", False, BackendConfig())
    assert (d.torch_device, d.jax_platforms, d.dist_backend, d.runtime) == ("tpu", "tpu", "tpu", "torch_tpu")
    s = backend.decide("sampler", False, BackendConfig())  # libtpu is installed with the tpu extra
    assert (s.torch_device, s.jax_platforms, s.dist_backend, s.runtime) == ("cpu", "tpu", "gloo", "jax")


def test_real_chip_without_a_device_is_one_line(monkeypatch):
    pytest.importorskip("torch_tpu")
    _fake_tpu(monkeypatch, False)  # what this CPU machine really shows: no accelerator
    assert torch.accelerator.current_accelerator() is None
    with pytest.raises(backend.ChipUnavailableError) as e:
        backend.decide("trainer", False, BackendConfig())
    msg = str(e.value)
    assert "\n" not in msg and "torch_tpu found no TPU device" in msg and msg.startswith("trainer claimed real")


def test_real_chip_without_torch_tpu_or_libtpu_names_the_package(monkeypatch):
    real_find = backend.importlib.util.find_spec
    monkeypatch.setattr(backend.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch_tpu", "libtpu") else real_find(name, *a))
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    with pytest.raises(backend.ChipUnavailableError, match=r"torch_tpu package is not installed .*rltpu\[tpu\]"):
        backend.decide("trainer", False, BackendConfig())
    with pytest.raises(backend.ChipUnavailableError, match="libtpu package is not installed"):
        backend.decide("sampler", False, BackendConfig())


def test_real_chip_refuses_cpu_device_and_colocated():
    with pytest.raises(backend.ChipUnavailableError, match="backend.device=cpu on real TPU chips"):
        backend.decide("trainer", False, BackendConfig(device="cpu"))
    with pytest.raises(backend.ChipUnavailableError, match="colocated on real TPU chips"):
        backend.decide("colocated", False, BackendConfig(), probe_torch=lambda: None, probe_jax=lambda: None)
    assert backend.decide("colocated", True, BackendConfig()).torch_device == "cpu"  # emulated: still allowed


def test_real_chip_overrides_a_stale_jax_platforms_cpu(restore_state, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # e.g. left by a runtime_env or a parent process
    d = backend.decide("sampler", False, BackendConfig(), probe_jax=lambda: None)
    out = backend.apply(BackendConfig(), decision=d)
    assert os.environ["JAX_PLATFORMS"] == "tpu" and out["jax_platforms"] == "tpu" and out["emulated"] is False


def test_only_the_backend_module_writes_jax_platforms_in_actor_code():
    """Every module an actor process runs: JAX_PLATFORMS is written in rltpu/chips/backend.py only,
    whose real-chip branch writes "tpu" (tested above). Planner micro-benchmarks and benchmarks/ are
    CPU tools that claim no chip."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dirs = ["actors", "learner", *(f"rltpu/{d}" for d in ("chips", "sync", "sampling", "models", "control", "data",
                                                          "observe"))]
    writers = [str(p.relative_to(root)) for d in dirs for p in (root / d).rglob("*.py")
               if "JAX_PLATFORMS" in p.read_text() and any(w in p.read_text() for w in (
                   'environ["JAX_PLATFORMS"]', "setdefault(\"JAX_PLATFORMS\"", "JAX_PLATFORMS=", "os.environ.update"))]
    assert [w for w in writers if w != "rltpu/chips/backend.py"] == [], writers


def test_torch_tpu_modes_map_the_config():
    pytest.importorskip("torch_tpu")
    backend._import_torch_tpu()
    for ours, theirs in backend.EAGER_MODES.items():
        assert hasattr(torch.tpu.EagerMode, theirs), ours
    for ours, theirs in backend.TPU_PRECISION.items():
        assert hasattr(torch.tpu.Precision, theirs), ours
    assert backend.EAGER_MODES == {"fuse": "DEFER_AND_FUSE", "strict": "DEFER_NEVER",
                                   "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING"}
    assert backend.spmd_region(len, "cpu") is len  # off TorchTPU nothing is wrapped
    assert backend.spmd_region(len, "tpu") is not len


_HOST_DEVICES = """
import json, os, sys
os.environ.pop("XLA_FLAGS", None)
os.environ.pop("JAX_PLATFORMS", None)
from rltpu.chips import backend
from rltpu.config import BackendConfig
info = backend.apply(BackendConfig(), "sampler", emulated=True, jax_devices=int(sys.argv[1]))
import jax
out = {"devices": [d.platform for d in jax.devices()], "reported": info["jax_devices"]}
try:  # a second claim for more devices once JAX runs: refused, never a silent 1-device engine
    backend.apply(BackendConfig(), "sampler", emulated=True, jax_devices=int(sys.argv[1]) + 1)
except backend.ChipUnavailableError as e:
    out["late"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("k", [1, 3])
def test_emulated_sampler_gets_one_host_device_per_chip(k):
    """A sampler claiming k emulated chips sees k JAX CPU devices (its tensor-parallel mesh has the
    shape it has on k real chips); JAX already running with another count is a one-line error."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, "-c", _HOST_DEVICES, str(k)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["devices"] == ["cpu"] * k and out["reported"] == k
    assert f"JAX started before the chip claim with {k} host devices, but the engine spans {k + 1} chips" in out["late"]
    assert "\n" not in out["late"]

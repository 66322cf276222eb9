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
    with pytest.raises(RuntimeError, match="tpu"):
        backend.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda"):
            backend.resolve_device("cuda")
    with pytest.raises(ValueError):
        backend.resolve_device("gpu")


def test_dist_backend():
    assert backend.dist_backend("cpu") == "gloo"
    assert backend.dist_backend("cuda") == "nccl"
    assert backend.dist_backend("xla") == "xla"
    with pytest.raises(ValueError):
        backend.dist_backend("mps")


@pytest.mark.parametrize("level", ["medium", "high", "highest"])
def test_precision_changes_torch_and_jax(level, restore_state):
    import jax

    out = backend.configure_precision(level)
    assert torch.get_float32_matmul_precision() == level
    assert jax.config.jax_default_matmul_precision == backend.JAX_PRECISION[level]
    assert out["jax_matmul_precision"] == {"medium": "bfloat16", "high": "tensorfloat32", "highest": "float32"}[level]


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
    assert backend.jax_platform_env("cpu") == {"JAX_PLATFORMS": "cpu"}
    assert backend.jax_platform_env("tpu") == {"JAX_PLATFORMS": "tpu"}


def test_apply_reports(restore_state):
    out = backend.apply(BackendConfig(matmul_precision="high", threads=1))
    assert out["device"] == "cpu" and out["dist_backend"] == "gloo" and out["emulated"] is True
    assert out["threads"] == 1 and out["matmul_precision"] == "high"
    assert out["jax_matmul_precision"] == "tensorfloat32"
    assert torch.get_float32_matmul_precision() == "high"
    # reported as it is in this process (set here unless JAX had already started, e.g. earlier tests)
    assert os.environ.get("JAX_PLATFORMS") == out["jax_platforms"]

"""The one place that decides device, process-group backend, threads and matmul precision.

Every actor calls :func:`apply` first thing, before it imports a model or touches JAX devices,
and puts the returned dict in its report, so a run shows what each process actually used.
Nothing else in rltpu should call ``torch.set_num_threads``, set ``XLA_FLAGS`` or pick a device.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import torch

from rltpu.config import BackendConfig
from rltpu.chips.topology import local_tpu_present

# torch.set_float32_matmul_precision level -> jax_default_matmul_precision value
# (hardware md "Matmul precision": medium = bf16 one pass, high = bf16_3x / tf32, highest = f32).
JAX_PRECISION = {"medium": "bfloat16", "high": "tensorfloat32", "highest": "float32"}

_DEVICES = ("auto", "tpu", "xla", "cuda", "cpu")


def _native_tpu() -> bool:
    """A PyTorch TPU backend registered as PrivateUse1 named "tpu" (TorchTPU). Unverified here."""
    try:
        if torch._C._get_privateuse1_backend_name() != "tpu":
            return False
    except AttributeError:
        return False
    mod = getattr(torch, "tpu", None)
    if mod is None:
        return False
    is_available = getattr(mod, "is_available", None)
    return bool(is_available()) if callable(is_available) else True


def _torch_xla() -> bool:
    """torch_xla is installed and a TPU (or an explicit PJRT_DEVICE) is there to drive.

    Importing torch_xla would start PJRT, so only its presence is checked; a CPU box that merely
    has the wheel installed stays on "cpu" unless PJRT_DEVICE says otherwise.
    """
    if importlib.util.find_spec("torch_xla") is None:
        return False
    return bool(os.environ.get("PJRT_DEVICE")) or local_tpu_present()


def resolve_device(pref: str = "auto") -> str:
    """Pick the torch device type: "tpu" (native), "xla" (torch_xla), "cuda" or "cpu".

    "auto" takes the first available in that order. An explicit preference that is not available
    raises RuntimeError rather than silently running elsewhere ("tpu" accepts torch_xla too).
    """
    if pref not in _DEVICES:
        raise ValueError(f"backend.device must be one of {_DEVICES}, got {pref!r}")
    if pref in ("auto", "tpu", "xla"):
        if pref != "xla" and _native_tpu():
            return "tpu"
        if _torch_xla():
            return "xla"
        if pref != "auto":
            raise RuntimeError(
                f"backend.device={pref!r} but no PyTorch TPU backend is usable here (no PrivateUse1 "
                f"'tpu' backend registered, torch_xla missing or no TPU/PJRT_DEVICE); use backend.device=auto or cpu"
            )
    if pref in ("auto", "cuda"):
        if torch.cuda.is_available():
            return "cuda"
        if pref == "cuda":
            raise RuntimeError("backend.device='cuda' but torch.cuda.is_available() is False; use auto or cpu")
    return "cpu"


def dist_backend(device: str) -> str:
    """torch.distributed backend for a device type.

    cpu -> gloo and cuda -> nccl are tested paths. "xla" is the backend torch_xla registers
    (``torch_xla.distributed.xla_backend``); for a native "tpu" PrivateUse1 backend the name is
    an assumption (unverified: no TPU and no TorchTPU build here).
    """
    table = {"cpu": "gloo", "cuda": "nccl", "xla": "xla", "tpu": "xla"}
    try:
        return table[device]
    except KeyError:
        raise ValueError(f"no torch.distributed backend known for device {device!r} (known: {sorted(table)})") from None


def _jax_backend_started() -> bool:
    import sys

    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # private API moved: assume the worst only if jax was used
        return False


def _merge_xla_flags(current: str, updates: dict[str, str]) -> str:
    kept = [f for f in current.split() if f.split("=", 1)[0] not in updates]
    return " ".join(kept + [f"{k}={v}" for k, v in updates.items()])


def configure_threads(n: int, cpus: list[int] | None = None) -> dict[str, Any]:
    """Cap torch (and ask XLA CPU) to ``n`` threads per process; optionally pin to ``cpus``.

    Must run before JAX initialises its backend (the first ``jax.devices()`` or computation):
    XLA reads ``XLA_FLAGS`` once, at client creation. If it already started, a warning says so.

    Measured on jax 0.10.2 CPU (2-core box): ``--xla_cpu_multi_thread_eigen=false`` is accepted
    but does not reduce the number of busy XLA threads; CPU affinity does (XLA sizes its pool from
    ``sched_getaffinity``), hence ``cpus``. ``intra_op_parallelism_threads=1``, often quoted next to
    it, is not an XLA flag: XLA aborts when it opens XLA_FLAGS, so it is not written here.
    """
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
        interop = n
    except RuntimeError:  # already set, or parallel work already started: torch forbids a change
        interop = torch.get_num_interop_threads()
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    flags = {"--xla_cpu_multi_thread_eigen": "false" if n == 1 else "true"}
    xla_applied = not _jax_backend_started()
    if not xla_applied:
        warnings.warn(
            "rltpu.chips.backend.configure_threads called after JAX initialised its backend; XLA_FLAGS "
            "changes take effect only in new processes",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["XLA_FLAGS"] = _merge_xla_flags(os.environ.get("XLA_FLAGS", ""), flags)
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": interop,
        "xla_flags": os.environ["XLA_FLAGS"],
        "xla_flags_applied": xla_applied,
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
    }


def configure_precision(level: str) -> dict[str, str]:
    """Set float32 matmul precision in torch and JAX to the same level.

    On TPU "medium" is one bf16 pass (the hardware default), "high" three, "highest" six; only
    float32 inputs are affected. On CPU both libraries compute float32 either way.
    """
    if level not in JAX_PRECISION:
        raise ValueError(f"matmul_precision must be one of {sorted(JAX_PRECISION)}, got {level!r}")
    torch.set_float32_matmul_precision(level)
    import jax  # lazy: importing jax is slow and does not start its backend

    jax.config.update("jax_default_matmul_precision", JAX_PRECISION[level])
    return {"matmul_precision": level, "jax_matmul_precision": JAX_PRECISION[level]}


def jax_platform_env(device: str) -> dict[str, str]:
    """Env for the JAX side of an actor on this device.

    CPU pins JAX_PLATFORMS=cpu (no probing for accelerators). TPU pins "tpu" so a process that
    cannot open its chips fails loudly instead of falling back to CPU (jax-ml/jax#10192). CUDA is
    left to JAX's own choice (the jax CUDA plugin may not be installed).
    """
    if device == "cpu":
        return {"JAX_PLATFORMS": "cpu"}
    if device in ("tpu", "xla"):
        return {"JAX_PLATFORMS": "tpu"}
    return {}


def apply(cfg: BackendConfig) -> dict[str, Any]:
    """Resolve the device, set threads and precision in this process; return what was done."""
    device = resolve_device(cfg.device)
    jax_env = jax_platform_env(device)
    for k, v in jax_env.items():
        if not _jax_backend_started():
            os.environ.setdefault(k, v)  # an actor's runtime_env may already have set it
    threads = configure_threads(cfg.threads)
    precision = configure_precision(cfg.matmul_precision)
    return {
        "device": device,
        "dist_backend": dist_backend(device),
        "emulated": device not in ("tpu", "xla"),
        "jax_platforms": os.environ.get("JAX_PLATFORMS"),
        **threads,
        **precision,
    }

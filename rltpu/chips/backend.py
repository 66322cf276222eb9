"""The one place that decides device, process-group backend, threads and matmul precision.

Every actor decides its backend once, from its chip claim (:func:`decide`: emulated chip -> CPU for
torch and JAX; real chip -> TorchTPU ``tpu`` / process group ``"tpu"`` for a trainer, JAX ``tpu``
for a sampler; a real chip it cannot open -> ChipUnavailableError, never a CPU fallback), then calls
:func:`apply` before it imports a model or touches JAX devices, and puts the returned dict in its
report, so a run shows what each process actually used. Nothing else in rltpu should call
``torch.set_num_threads``, set ``XLA_FLAGS`` or ``JAX_PLATFORMS``, or pick a device.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from rltpu.config import BackendConfig

# torch.set_float32_matmul_precision level -> jax_default_matmul_precision value
# (hardware md "Matmul precision": medium = bf16 one pass, high = bf16_3x / tf32, highest = f32).
JAX_PRECISION = {"medium": "bfloat16", "high": "tensorfloat32", "highest": "float32"}

_DEVICES = ("auto", "tpu", "cuda", "cpu")
# backend.eager_mode -> torch.tpu.EagerMode member (the design source's fuse / strict / debug)
EAGER_MODES = {"fuse": "DEFER_AND_FUSE", "strict": "DEFER_NEVER", "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING"}
# backend.matmul_precision -> torch.tpu.Precision member (1 / 3 / 6 bf16 MXU passes)
TPU_PRECISION = {"medium": "DEFAULT", "high": "HIGH", "highest": "HIGHEST"}
TCMALLOC_WARNING = "ignore:<TorchTpu/Performance/TcMalloc/"  # PYTHONWARNINGS entry for a CPU-only import
COLOCATED_ON_REAL_CHIPS = (
    "placement.mode=colocated on real TPU chips: TorchTPU (trainer) and JAX (sampler) would each open the same "
    "chip from one process, which libtpu does not allow (see docs/tpu.md); use placement.mode=disaggregated")


class ChipUnavailableError(RuntimeError):
    """A process claimed a real chip it cannot open (or a device the claim contradicts): one line, exit 2."""


@dataclass(frozen=True)
class Decision:
    """What one actor process computes on, decided once from its chip claim."""

    role: str
    emulated: bool
    torch_device: str  # "tpu" (TorchTPU) for a real trainer; "cpu" for emulated chips and real samplers' staging
    dist_backend: str  # torch.distributed backend of its process group: "tpu" or "gloo" (nccl on cuda)
    jax_platforms: str | None  # JAX_PLATFORMS: "tpu" on real chips, "cpu" on emulated ones (None: JAX decides)
    runtime: str  # who opens the chips: "torch_tpu", "jax", or "cpu" (emulated)


def _import_torch_tpu():
    """Import TorchTPU quietly (its tcmalloc advice is about performance, not correctness)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TcMalloc.*")
        import torch_tpu  # noqa: F401

    return torch_tpu


def load_torch_tpu() -> None:
    """Import TorchTPU and run its device-backend loader, as ``import torch`` would with autoload on.

    rltpu's processes start with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` so that ``import torch`` does not
    pull TorchTPU in before the launch env is set. TorchTPU 0.2.0 registers the ``tpu`` device and the
    ``"tpu"``/``"tpu_dist"`` process-group backends only in its ``load()`` (``torch_tpu/_loader.py``
    lines 379-403), which it calls at import only when that variable was ``"1"``: so it is called here,
    through the ``torch.backends`` entry point the package declares for torch's own autoload
    (``torch_tpu = torch_tpu._loader:load`` in its entry_points.txt). ``load()`` is idempotent.
    """
    from importlib.metadata import entry_points

    _import_torch_tpu()
    eps = [ep for ep in entry_points(group="torch.backends") if ep.name == "torch_tpu"]
    if not eps:
        raise ImportError("torch_tpu declares no torch.backends entry point (is torch-tpu 0.2.x installed?)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TcMalloc.*")
        eps[0].load()()


def probe_torch_tpu() -> str | None:
    """None when TorchTPU can open a device in this process, else what is missing (one phrase).

    Runs TorchTPU's loader (:func:`load_torch_tpu`), so the launch env must already be set: TorchTPU's
    C++ side reads it once and memoizes it (``torch_tpu/_internal/env_utils.py``)."""
    if importlib.util.find_spec("torch_tpu") is None:
        return "the torch_tpu package is not installed (pip install 'rltpu[tpu]')"
    try:
        load_torch_tpu()
    except Exception as e:  # noqa: BLE001 - a broken install is reported, never bypassed
        return f"loading torch_tpu failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    acc = torch.accelerator.current_accelerator()
    if acc is None or acc.type != "tpu":
        return ("torch_tpu found no TPU device (torch.accelerator.current_accelerator() is "
                f"{None if acc is None else acc.type!r}; is this a TPU VM, and is another process holding the chip?)")
    return None


def probe_jax_tpu() -> str | None:
    """None when JAX can load the TPU runtime (the libtpu package), else what is missing.

    Opening the chip itself is left to the engine: with JAX_PLATFORMS=tpu a failure there raises
    instead of falling back to CPU (jax-ml/jax#10192)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path:  # JAX only warns about a missing file and then loads the package's build instead
        return None if os.path.isfile(path) else f"TPU_LIBRARY_PATH={path} is not a file"
    if importlib.util.find_spec("libtpu") is None:
        return "the libtpu package is not installed, so JAX has no TPU runtime (pip install 'rltpu[tpu]')"
    return None


def decide(role: str, emulated: bool, cfg: BackendConfig, probe_torch=probe_torch_tpu,
           probe_jax=probe_jax_tpu) -> Decision:
    """The backend of one actor from its chip claim; raises ChipUnavailableError, never falls back.

    Emulated chip: torch and JAX on CPU (``backend.device=cuda`` is honoured for GPU boxes). Real chip:
    a trainer (or reward scorer) runs torch on ``tpu`` through TorchTPU with process-group backend
    ``"tpu"``; a sampler runs JAX on ``tpu`` and keeps torch on the host for weight staging. Both
    pin JAX_PLATFORMS=tpu. Colocated (both engines in one process) is refused on real chips.
    """
    if cfg.device not in _DEVICES:
        raise ValueError(f"backend.device must be one of {_DEVICES}, got {cfg.device!r}")
    if emulated:
        if cfg.device == "tpu":
            raise ChipUnavailableError(
                f"{role}: backend.device=tpu but its chips are emulated; use backend.device=auto, or run on a TPU VM "
                f"with cluster.emulated=false")
        if cfg.device == "cuda":
            if not torch.cuda.is_available():
                raise ChipUnavailableError("backend.device=cuda but torch.cuda.is_available() is False; use auto or cpu")
            return Decision(role, True, "cuda", "nccl", None, "cpu")
        return Decision(role, True, "cpu", "gloo", "cpu", "cpu")
    if role == "colocated":
        raise ChipUnavailableError(COLOCATED_ON_REAL_CHIPS)
    if cfg.device in ("cpu", "cuda"):
        raise ChipUnavailableError(
            f"{role}: backend.device={cfg.device} on real TPU chips would compute off the chips it claims; use "
            f"backend.device=auto (or cluster.emulated=true to run on CPU)")
    if role == "sampler":
        missing = probe_jax()
        if missing:
            raise ChipUnavailableError(f"sampler claimed real TPU chips but {missing}")
        return Decision(role, False, "cpu", "gloo", "tpu", "jax")
    missing = probe_torch()
    if missing:
        raise ChipUnavailableError(f"{role} claimed real TPU chips but {missing}")
    return Decision(role, False, "tpu", "tpu", "tpu", "torch_tpu")


def resolve_device(pref: str = "auto") -> str:
    """The torch device of a process on emulated chips (benchmarks and tools); see :func:`decide`."""
    return decide("tool", True, BackendConfig(device=pref)).torch_device


def dist_backend(device: str) -> str:
    """torch.distributed backend for a torch device type: cpu gloo, cuda nccl, tpu "tpu" (the name
    TorchTPU registers with ``Backend.register_backend(..., devices=["tpu"])``)."""
    table = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu"}
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
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_default_matmul_precision", JAX_PRECISION[level])
    else:  # JAX reads it at import: a process that never imports JAX (a trainer) does not pay that import
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = JAX_PRECISION[level]
    return {"matmul_precision": level, "jax_matmul_precision": JAX_PRECISION[level]}


def jax_platform_env(decision: Decision) -> dict[str, str]:
    """JAX_PLATFORMS for an actor: "tpu" on real chips (a process that cannot open them fails loudly
    instead of falling back to CPU, jax-ml/jax#10192), "cpu" on emulated ones, nothing for cuda."""
    return {"JAX_PLATFORMS": decision.jax_platforms} if decision.jax_platforms else {}


def configure_torch_tpu(decision: Decision, cfg: BackendConfig) -> dict[str, Any]:
    """On a TorchTPU process: the eager mode (process-wide) and the precision the train step runs under."""
    if decision.torch_device != "tpu":
        return {}
    _import_torch_tpu()
    torch.tpu.eager_mode = getattr(torch.tpu.EagerMode, EAGER_MODES[cfg.eager_mode])
    return {"torch_tpu_eager_mode": EAGER_MODES[cfg.eager_mode], "torch_tpu_precision": TPU_PRECISION[cfg.matmul_precision]}


def device_modes(decision: Decision | None, cfg: BackendConfig):
    """Context for device work: ``torch.tpu.precision`` on TorchTPU (it overrides the global float32
    matmul precision only inside a context), nothing elsewhere."""
    if decision is None or decision.torch_device != "tpu":
        return contextlib.nullcontext()
    return torch.tpu.precision(getattr(torch.tpu.Precision, TPU_PRECISION[cfg.matmul_precision]))


def spmd_region(fn, device: str):
    """Mark ``fn`` ``spmd_safe`` on TorchTPU (its collectives fuse with the code around them); only for
    code that issues the same operations, collectives and shapes in the same order on every rank.
    Elsewhere ``fn`` itself (every eager collective stays its own graph: safe, slower)."""
    if device != "tpu":
        return fn
    return torch.tpu.distributed.spmd_safe(fn)


def host_device_flags(jax_devices: int) -> dict[str, str]:
    """XLA flags that give a CPU-only JAX process ``jax_devices`` host devices: an emulated sampler
    with k chips gets k JAX devices, so its tensor-parallel mesh has the shape it has on k real chips."""
    return {"--xla_force_host_platform_device_count": str(jax_devices)} if jax_devices > 1 else {}


def apply(cfg: BackendConfig, role: str = "tool", emulated: bool = True,
          launch_env: dict[str, str] | None = None, decision: Decision | None = None,
          jax_devices: int = 1) -> dict[str, Any]:
    """Decide this process's backend from its claim, set env, threads and precision; return what was done.

    Runs before any engine exists. ``launch_env``: the TorchTPU launch variables the controller
    computed for this trainer rank (``rltpu.chips.launch.launch_env_for_group``); on real chips they
    must already be in the environment when TorchTPU loads (``ProcessRuntime.claim`` sets them before
    :func:`decide`), which is checked here. ``jax_devices``:
    the chips a JAX engine in this process spans (a sampler's ``placement.chips_per_sampler``); on
    real chips libtpu shows exactly the claimed ones (``TPU_VISIBLE_CHIPS``), emulated ones become
    that many host devices.
    """
    decision = decision or decide(role, emulated, cfg)
    emulated = decision.emulated
    env = jax_platform_env(decision)
    if not emulated:  # a real chip: never leave a stale JAX_PLATFORMS=cpu from anywhere
        os.environ.update(env)
        changed = sorted(k for k, v in (launch_env or {}).items() if os.environ.get(k) != v)
        if changed:  # TorchTPU memoizes what it read at import: a late value would be silently ignored
            raise ChipUnavailableError(f"{role}: launch env {changed} not set before torch_tpu was loaded; set it in "
                                       f"rltpu.chips.runtime.ProcessRuntime.claim before backend.decide")
    elif not _jax_backend_started():
        for k, v in env.items():
            os.environ.setdefault(k, v)  # an actor's runtime_env may already have set it
        os.environ["XLA_FLAGS"] = _merge_xla_flags(os.environ.get("XLA_FLAGS", ""), host_device_flags(jax_devices))
    elif jax_devices > 1:
        import jax

        if len(jax.devices()) != jax_devices:
            raise ChipUnavailableError(
                f"{role}: JAX started before the chip claim with {len(jax.devices())} host devices, but the engine "
                f"spans {jax_devices} chips; claim before any JAX computation in this process")
    threads = configure_threads(cfg.threads)
    precision = configure_precision(cfg.matmul_precision)
    tpu = configure_torch_tpu(decision, cfg)
    return {
        "device": decision.torch_device,
        "dist_backend": decision.dist_backend,
        "runtime": decision.runtime,
        "emulated": decision.emulated,
        "jax_platforms": os.environ.get("JAX_PLATFORMS"),
        "jax_devices": jax_devices,
        "launch_env": sorted(launch_env or {}),
        **threads,
        **precision,
        **tpu,
    }

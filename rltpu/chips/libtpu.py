"""Which libtpu build each runtime loads: JAX (samplers) and TorchTPU (trainers) may want different ones.

Both runtimes load the TPU runtime from ``TPU_LIBRARY_PATH`` when it names a file:
- JAX 0.10.2: ``jax/_src/cloud_tpu_init.py`` ``get_tpu_library_path()`` (lines 35-50) reads
  ``TPU_LIBRARY_PATH`` first and only then imports the ``libtpu`` package. A path that does not exist
  only warns and falls back to the package: rltpu checks the file exists itself, never falls back.
- TorchTPU 0.2.0: ``torch_tpu/__init__.py`` imports ``libtpu`` and calls ``libtpu.configure_library_path()``,
  which sets ``TPU_LIBRARY_PATH`` to the package's ``libtpu.so`` only when it is unset
  (``libtpu/__init__.py``), so a value set before the import wins.

What each runtime needs is read from its own package metadata, not written here: ``jax``'s ``tpu``
extra pins ``libtpu==0.0.42.*`` (jax 0.10.2), ``torch-tpu`` 0.2.0 requires ``libtpu>=0.0.50``. No
single build satisfies both, so ``make tpu-libtpu`` (and the Dockerfile) installs the JAX build beside
the project's own with ``pip install --target <venv>/libtpu-jax``, and every actor process gets the
``TPU_LIBRARY_PATH`` of its runtime before it imports either library (``rltpu.chips.runtime.claim``).
Whether jaxlib 0.10.2 also runs on libtpu 0.0.5x is not known here (no TPU): the pins are taken as
the packages state them.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from dataclasses import dataclass
from pathlib import Path

RUNTIME_PACKAGE = {"jax": "jax", "torch_tpu": "torch-tpu"}  # runtime -> the distribution whose metadata says
SIDE_DIR_ENV = "RLTPU_JAX_LIBTPU_DIR"  # where the JAX build lives, if not <prefix>/libtpu-jax
SIDE_DIR_NAME = "libtpu-jax"


class LibtpuError(RuntimeError):
    """No installed libtpu build satisfies a runtime that claimed a real chip (one line, with the fix)."""


@dataclass(frozen=True)
class Build:
    version: str
    path: str  # the libtpu.so file
    where: str  # "package" (site-packages) or "side" (the JAX build beside it)


def requirement(runtime: str, requires: list[str] | None = None) -> str | None:
    """The libtpu specifier a runtime's package declares (jax: its ``tpu`` extra), e.g. ``==0.0.42.*``."""
    from packaging.requirements import Requirement

    dist = RUNTIME_PACKAGE[runtime]
    if requires is None:
        try:
            requires = md.requires(dist) or []
        except md.PackageNotFoundError:
            return None
    for line in requires:
        req = Requirement(line)
        if req.name != "libtpu":
            continue
        if runtime == "jax" and (req.marker is None or not req.marker.evaluate({"extra": "tpu"})):
            continue
        return str(req.specifier)
    return None


def side_dir() -> Path:
    return Path(os.environ.get(SIDE_DIR_ENV) or Path(sys.prefix) / SIDE_DIR_NAME)


def installed_builds() -> list[Build]:
    """The libtpu builds this environment has: the ``libtpu`` package, and the JAX build in ``side_dir()``."""
    out = []
    try:
        dist = md.distribution("libtpu")
        so = Path(dist.locate_file("libtpu/libtpu.so"))
        if so.is_file():
            out.append(Build(dist.version, str(so), "package"))
    except md.PackageNotFoundError:
        pass
    side = side_dir()
    for info in sorted(side.glob("libtpu-*.dist-info")):
        so = side / "libtpu" / "libtpu.so"
        if so.is_file():
            out.append(Build(md.Distribution.at(info).version, str(so), "side"))
    return out


def select(runtime: str, builds: list[Build] | None = None, spec: str | None = None) -> Build:
    """The build ``runtime`` loads: the first installed one its package's pin admits; LibtpuError if none."""
    from packaging.specifiers import SpecifierSet

    builds = installed_builds() if builds is None else builds
    spec = requirement(runtime) if spec is None else spec
    ok = [b for b in builds if spec is None or SpecifierSet(spec).contains(b.version, prereleases=True)]
    if ok:
        return ok[0]
    have = ", ".join(f"{b.version} ({b.where})" for b in builds) or "none"
    fix = ("make tpu-libtpu" if runtime == "jax" else "pip install 'rltpu[tpu]'")
    raise LibtpuError(f"{RUNTIME_PACKAGE[runtime]} needs libtpu{spec} but the installed builds are {have}; "
                      f"run `{fix}` (docs/tpu.md, 'Two libtpu builds')")


def runtime_env(runtime: str, builds: list[Build] | None = None) -> dict[str, str]:
    """``TPU_LIBRARY_PATH`` for a process of ``runtime`` on real chips, set before it imports JAX or torch_tpu."""
    return {"TPU_LIBRARY_PATH": select(runtime, builds).path}

"""Per-chip hardware figures the planner needs, one entry per TPU generation plus ``cpu``.

Chip layout facts (TensorCores and JAX devices per chip, host blocks, type naming) are not
repeated here: they come from ``rltpu.chips.topology.GENERATION_FACTS``. Every TPU figure names its
source tag from ``docs/tpu-hardware.md`` (each tag a public page or source file); figures that could not be checked against a
second source are listed in ``unconfirmed`` and every report prints them.

The ``cpu`` entry describes *this* machine, one emulated chip = one pinned core, from
``rltpu.plan.microbench`` (GEMM FLOP/s per width, memory bandwidth, gloo on loopback). It exists
so a plan can be checked against a real run here (``rltpu plan --against RUN_DIR``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from rltpu.config import ConfigError
from rltpu.chips.topology import GENERATION_FACTS, GenerationFacts

GiB = 2**30
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str  # "v5e" ... or "cpu"
    hbm_bytes: float  # memory one chip's processes may use
    hbm_bw: float  # bytes/s
    peak_flops: float  # bf16 dense FLOP/s per chip (TPU); fp32 GEMM at the widest benchmarked width (cpu)
    ici_bw: float  # bytes/s per chip, bidirectional, all links (0: no ICI)
    dcn_bw: float  # bytes/s per chip (host NIC share)
    chips_per_host: int  # multi-host slices; single-host slices hold up to facts.single_host_max_chips
    max_slice_chips: int
    facts: GenerationFacts
    sources: dict[str, str]
    unconfirmed: tuple[str, ...] = ()
    emulated: bool = False
    pcie_bw: float = 16e9  # bytes/s per chip, each way, between its HBM and host memory
    # gloo over loopback between two processes of one TPU VM (one TCP stream): an assumption, listed
    # in ``unconfirmed`` on every TPU entry; the cpu entry measures its own loopback instead
    host_loop_bw: float = 4e9
    # Stated efficiencies (fractions of peak reached by real programs); assumptions, not measured here.
    train_mfu: float = 0.45  # an assumption between published trainer MFUs (docs/tpu-hardware.md, "Efficiencies")
    prefill_mfu: float = 0.5
    bw_eff: float = 0.7  # fraction of HBM bandwidth a decode step streams at
    link_eff: float = 0.7  # fraction of ICI/DCN bandwidth a collective reaches
    collective_latency_s: float = 20e-6  # per collective launch on ICI (assumption)
    dcn_latency_s: float = 100e-6
    runtime_reserve_bytes: float = 0.5 * GiB  # XLA program + scratch per chip (assumption)
    cpu: dict | None = None  # the raw micro-benchmark figures (cpu entry only)

    def gemm_flops(self, width: int, framework: str = "torch") -> float:
        """FLOP/s of a GEMM whose inner dims are ``width``: peak on TPU, measured curve on cpu."""
        if not self.cpu:
            return self.peak_flops
        table = {int(k): v for k, v in self.cpu[f"{framework}_gemm_flops"].items()}
        ws = sorted(table)
        if width <= ws[0]:
            return table[ws[0]]
        if width >= ws[-1]:
            return table[ws[-1]]
        for lo, hi in zip(ws, ws[1:]):  # log-linear interpolation between benchmarked widths
            if lo <= width <= hi:
                f = (math.log(width) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return table[lo] * (table[hi] / table[lo]) ** f
        return self.peak_flops


# -- TPU generations ------------------------------------------------------------------------------
# Figures: docs/tpu-hardware.md, tags [v4] [v5e] [v5p] [v6e] [7x] [TT] [SB] [XPK] [RAY] name its sources.
# ICI: bidirectional per chip (links x per-link). DCN: per chip (Gb/s / 8).
_TPU = {
    "v4": dict(hbm=32 * GiB, hbm_bw=1200 * GB, flops=275e12, ici=540 * GB, dcn=25e9 / 8 * 2, max_chips=4096, pcie=16e9,
               sources={"hbm": "[v4] 32 GiB HBM2", "hbm_bw": "[v4] 1200 GB/s", "flops": "[v4] 275 TFLOP/s bf16",
                        "ici": "derived from [SB]: 6 links x 9e10 B/s", "dcn": "none found; v5e-like 50 Gb/s assumed",
                        "pcie": "[SB] PCIe v4 16 GB/s each way",
                        "max_chips": "[v4] pod 4096 chips"},
               unconfirmed=("ici", "dcn", "host_loop")),
    "v5e": dict(hbm=16 * GB, hbm_bw=819 * GB, flops=197e12, ici=400 * GB, dcn=25e9 / 8, max_chips=256, pcie=16e9,
                sources={"hbm": "[v5e] 16 GB", "hbm_bw": "[v5e] 819 GB/s (newer table says 800 GiB/s: inconsistent)",
                         "flops": "[v5e] 197 TFLOP/s bf16", "ici": "[v5e] 400 GB/s, 4 ports",
                         "dcn": "[v5e] 2x100 Gb/s per 8-chip host = 25 Gb/s per chip [SB]", "max_chips": "[v5e] 256",
                         "pcie": "[SB] ~1.6e10 B/s per TPU"},
                unconfirmed=("hbm_bw", "host_loop")),
    "v5p": dict(hbm=95 * GiB, hbm_bw=2765 * GB, flops=459e12, ici=1200 * GB, dcn=50e9 / 8, max_chips=6144, pcie=16e9,
                sources={"hbm": "[v5p] 95 GiB usable (96 physical, 1 reserved by libtpu)", "hbm_bw": "[v5p] 2765 GB/s",
                         "flops": "[v5p] 459 TFLOP/s bf16", "ici": "[v5p] 1200 GB/s, 6 links",
                         "dcn": "[v5p] 50 Gb/s per chip", "max_chips": "[v5p] 16x16x24 = 6144 (xpk lists 16x20x28: conflict)",
                         "pcie": "[SB] ~1.6e10 B/s per TPU"},
                unconfirmed=("max_chips", "host_loop")),
    "v6e": dict(hbm=32 * GB, hbm_bw=1638 * GB, flops=918e12, ici=800 * GB, dcn=100e9 / 8, max_chips=256, pcie=32e9,
                sources={"hbm": "[v6e] 32 GB", "hbm_bw": "[v6e] 1638 GB/s", "flops": "[v6e] 918 TFLOP/s bf16",
                         "ici": "[v6e] 800 GB/s, 4 ports", "dcn": "[7x][SB] 100 Gb/s per chip", "max_chips": "[XPK][RAY] 256",
                         "pcie": "[SB] 3.2e10 B/s per TPU on v6e"},
                unconfirmed=("host_loop",)),
    "7x": dict(hbm=192 * GiB, hbm_bw=7380 * GB, flops=2307e12, ici=1200 * GB, dcn=100e9 / 8, max_chips=9216, pcie=32e9,
               sources={"hbm": "[7x] 192 GiB", "hbm_bw": "[7x] 7380 GB/s", "flops": "[7x] 2307 TFLOP/s bf16",
                        "ici": "[7x] 1200 GB/s", "dcn": "[7x] 100 Gb/s per chip",
                        "max_chips": "[7x] pod 9216; largest single slice not documented",
                        "pcie": "none found; v6e-like 32 GB/s assumed"},
               unconfirmed=("max_chips", "pcie", "host_loop")),
}
_HOST_LOOP_SOURCE = ("assumption: gloo over loopback TCP between two processes of one TPU VM, one stream; "
                     "not measured on a TPU VM")


def tpu(generation: str) -> Hardware:
    if generation not in _TPU:
        raise ConfigError(f"no hardware entry for {generation!r}; known: {', '.join([*_TPU, 'cpu'])}")
    d = _TPU[generation]
    facts = GENERATION_FACTS[generation]
    return Hardware(
        name=generation, hbm_bytes=d["hbm"], hbm_bw=d["hbm_bw"], peak_flops=d["flops"], ici_bw=d["ici"],
        dcn_bw=d["dcn"], pcie_bw=d["pcie"], chips_per_host=math.prod(facts.host_block), max_slice_chips=d["max_chips"],
        facts=facts, sources={**d["sources"], "host_loop": _HOST_LOOP_SOURCE}, unconfirmed=tuple(d["unconfirmed"]),
    )


def cpu(bench: dict, generation: str = "v5e") -> Hardware:
    """This machine as an emulated chip: one pinned core, single-threaded, figures from ``bench``.

    Memory per chip is the host's RAM (actors share it; the cost model divides by the processes on
    the host). There is no ICI or DCN: every collective is gloo on loopback, which the
    micro-benchmark measures. Efficiencies are 1.0 because the GEMM figure already is what a
    single-threaded GEMM of that width reaches here; non-GEMM work is costed explicitly.
    """
    facts = GENERATION_FACTS[generation]  # the emulated generation decides the chip layout only
    gloo = bench["gloo"]
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GiB
    return Hardware(
        name="cpu", hbm_bytes=float(ram), hbm_bw=bench["mem_bw"],
        peak_flops=max(bench["torch_gemm_flops"].values()), ici_bw=gloo["bcast_bw"], dcn_bw=gloo["bcast_bw"],
        chips_per_host=math.prod(facts.host_block), max_slice_chips=10**6, facts=facts,
        sources={"all": f"rltpu.plan.microbench on {bench['machine']} at {bench['measured_at']} "
                        f"(load {bench.get('load_avg_1m')})"},
        unconfirmed=("emulated: CPU figures say nothing about a TPU",), emulated=True,
        train_mfu=1.0, prefill_mfu=1.0, bw_eff=1.0, link_eff=1.0,
        collective_latency_s=gloo["allgather_latency_s"], dcn_latency_s=gloo["allgather_latency_s"],
        runtime_reserve_bytes=0.6 * GiB,  # python + torch or jax + a Ray worker, per process (assumption)
        cpu=bench,
    )


# -- slice shapes --------------------------------------------------------------------------------
# v5e/v6e [v5e][XPK]: the documented 2D shapes (Ray also accepts 2x8 [RAY]; unconfirmed elsewhere).
_SHAPES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# v4/v5p/7x small shapes [RAY][XPK]; larger ones: every dim a multiple of 4 [TT], up to max_chips.
_SMALL_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")


def check_topology(generation: str, topology: str, hw: Hardware | None = None) -> None:
    """Raise ConfigError (one line) unless ``topology`` is a slice shape ``generation`` offers."""
    dims = [int(d) for d in topology.split("x")]
    n = math.prod(dims)
    max_chips = (hw or tpu(generation)).max_slice_chips if generation in _TPU else 10**6
    if generation in ("v5e", "v6e"):
        if topology not in _SHAPES_2D:
            raise ConfigError(
                f"cluster.topology={topology!r} is not a {generation} slice shape; use one of {', '.join(_SHAPES_2D)}")
        return
    if topology in _SMALL_3D:
        return
    if sorted(dims) != dims or any(d % 4 for d in dims) or n > max_chips:
        raise ConfigError(
            f"cluster.topology={topology!r} is not a {generation} slice shape: use {', '.join(_SMALL_3D)} or AxBxC "
            f"with A<=B<=C, each a multiple of 4, at most {max_chips} chips (e.g. 4x4x4)")


def get(name: str, generation: str, bench: dict | None = None) -> Hardware:
    """``name`` is a generation or ``cpu`` (which needs the micro-benchmark figures)."""
    if name == "cpu":
        if bench is None:
            from rltpu.plan.microbench import load_or_run

            bench = load_or_run()
        return cpu(bench, generation)
    return tpu(name)

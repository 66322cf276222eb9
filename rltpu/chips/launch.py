"""TorchTPU launch variables for the trainer group, and the placements TorchTPU can run.

Pure Python (no torch, no Ray) so the controller, the planner and ``rltpu train`` share it.

TorchTPU (``torch-tpu`` 0.2.0) wants its launch variables decided once, in a parent, before the
one-process-per-chip workers start: ``torch.tpu.distributed.set_tpu_launch_env``. rltpu's workers are
Ray actors that the controller starts, so the controller computes the same values here (for the
trainer group's own chips, not the whole host) and hands each trainer actor its copy.
What ``set_tpu_launch_env`` does was read from ``torch_tpu/_internal/distributed/distributed.py``
and ``torch_tpu/_internal/utils/hardware.py`` (0.2.0); ``tests/test_launch.py`` runs it in a fresh
process and compares.
"""

from __future__ import annotations

import math
import os
import socket
from collections import Counter
import time
from collections.abc import Callable

from rltpu.chips.topology import GENERATION_FACTS, Chip
from rltpu.config import ConfigError

BASE_PORT = 8070  # TORCH_TPU_BASE_PORT default: multi-host slice-builder ports are BASE_PORT + local rank
MASTER_PORT = "29500"  # what set_tpu_launch_env puts in MASTER_PORT on multi-host
CHIPS_PER_HOST_BLOCK = (2, 2, 1)  # TorchTPU's per-host chip bounds for multi-host slices

# Chip count -> TORCH_TPU_TOPOLOGY of a single-host (sub-)slice TorchTPU accepts: the tables in
# torch_tpu 0.2.0 ``_internal/utils/hardware.py`` (keyed there by PCI device id). Any other count on
# one host is "No TPU topology found for count: N". 7x is absent on purpose: TorchTPU runs one
# process per *device* and a 7x chip is 2 devices, while an rltpu trainer actor is one process per chip.
HOST_SUBSLICE_TOPOLOGY: dict[str, dict[int, str]] = {
    "v4": {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"},
    "v5p": {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"},
    "v5e": {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"},
    "v6e": {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"},
}


def _hosts(group: list[list[Chip]]) -> list[tuple[int, int]]:
    return sorted({(c.slice, c.host) for chips in group for c in chips})


def torchtpu_group_problems(generation: str, group: list[list[Chip]], chips_per_host: int) -> list[str]:
    """Why TorchTPU cannot run this trainer group on real chips ([] when it can).

    ``group``: each trainer rank's chips. TorchTPU is one process per device, sub-slices only on one
    host and only in its table's sizes, and on several hosts every host runs the same number of
    ranks (slice-builder addresses are ``host:BASE_PORT+i`` for i < devices per host on every host).
    """
    multi = len(group[0]) if any(len(chips) != 1 for chips in group) else 0
    per_host = Counter((c.slice, c.host) for chips in group for c in chips)
    return torchtpu_host_problems(generation, per_host, chips_per_host, multi)


def torchtpu_host_problems(generation: str, per_host: dict[tuple[int, int], int], chips_per_host: int,
                           chips_per_rank: int = 0) -> list[str]:
    """``torchtpu_group_problems`` from the trainer chips per (slice, host) alone, so the planner can
    check placements of thousands of chips without chip lists; ``chips_per_rank``: 0 when every
    rank has one chip, else a rank's chips."""
    out = []
    if generation not in HOST_SUBSLICE_TOPOLOGY:
        return [f"TorchTPU 0.2.0 runs one process per device and a {generation} chip is "
                f"{GENERATION_FACTS[generation].jax_devices_per_chip} devices; rltpu trainer actors own whole "
                f"chips, so a real {generation} trainer group is not supported"]
    if chips_per_rank:
        out.append(f"placement.chips_per_trainer={chips_per_rank}: TorchTPU runs one process per chip; "
                   f"set placement.chips_per_trainer=1")
    if len({h[0] for h in per_host}) > 1:
        out.append("the trainer group spans slices; TorchTPU's multi-slice path (MegaScale) is not wired in "
                   "rltpu: keep trainer chips inside one slice")
    if len(per_host) == 1:
        n = next(iter(per_host.values()))
        table = HOST_SUBSLICE_TOPOLOGY[generation]
        if n not in table:
            out.append(f"{n} trainer chips on one {generation} host: TorchTPU runs a single-host sub-slice only "
                       f"of {sorted(table)} chips; set placement.trainer_chips to one of those")
    elif any(n != chips_per_host for n in per_host.values()):
        out.append(f"trainer chips per host {sorted(per_host.values())}: across hosts TorchTPU needs whole "
                   f"{chips_per_host}-chip hosts for the trainer group; give the trainers whole hosts")
    return out


def check_real_placement(generation: str, trainer_group: list[list[Chip]], chips_per_host: int, mode: str) -> None:
    """Raise one ConfigError line when real chips cannot run this placement (``rltpu train`` and the planner)."""
    if mode == "colocated":
        raise ConfigError(
            "placement.mode=colocated on real TPU chips: TorchTPU (trainer) and JAX (sampler) would each open "
            "the same chip from one process, which libtpu does not allow (see docs/tpu.md); use "
            "placement.mode=disaggregated, or cluster.emulated=true")
    problems = torchtpu_group_problems(generation, trainer_group, chips_per_host)
    if problems:
        raise ConfigError(f"real TPU trainer group: {problems[0]}")


def check_real_counts(generation: str, per_host: dict[tuple[int, int], int], chips_per_host: int, mode: str,
                      chips_per_rank: int = 0) -> None:
    """``check_real_placement`` from the trainer chips per (slice, host): the planner's count path."""
    if mode == "colocated":
        check_real_placement(generation, [], chips_per_host, mode)
    problems = torchtpu_host_problems(generation, per_host, chips_per_host, chips_per_rank)
    if problems:
        raise ConfigError(f"real TPU trainer group: {problems[0]}")


def group_topology(generation: str, group: list[list[Chip]]) -> str:
    """TORCH_TPU_TOPOLOGY of the group: the host table on one host, else the chips' bounding box (x,y,z)."""
    hosts = _hosts(group)
    chips = [c for g in group for c in g]
    if len(hosts) == 1:
        return HOST_SUBSLICE_TOPOLOGY[generation][len(chips)]
    dims = []
    for d in range(3):
        vals = [c.coords[d] if d < len(c.coords) else 0 for c in chips]
        dims.append(max(vals) - min(vals) + 1)
    return ",".join(map(str, dims))


def _host_block(chip: Chip, origin: tuple[int, ...]) -> tuple[int, int, int]:
    pos = [(chip.coords[d] if d < len(chip.coords) else 0) - origin[d] for d in range(3)]
    return tuple(p // b for p, b in zip(pos, CHIPS_PER_HOST_BLOCK))  # type: ignore[return-value]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on this host right now (all held open until all are picked).

    Run on the TPU host itself (a trainer actor's ``free_ports``), as TorchTPU's own launcher picks its
    single-host slice-builder ports there with portpicker (``set_tpu_launch_env``,
    ``torch_tpu/_internal/distributed/distributed.py`` ``pick_slicebuilder_addresses``), never on the
    driver (on KubeRay: the head pod) where a free port says nothing about the TPU host."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def base_port(env: dict[str, str] | None = None) -> int:
    """``TORCH_TPU_BASE_PORT`` (default 8070) as the driver's env gives it: the first multi-host
    slice-builder port, as ``set_tpu_launch_env`` reads it (``distributed.py`` lines 408-410)."""
    raw = (os.environ if env is None else env).get("TORCH_TPU_BASE_PORT", str(BASE_PORT))
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"TORCH_TPU_BASE_PORT={raw!r} is not a port number; unset it or set e.g. 8070") from None
    if not 1024 <= port <= 65000:
        raise ConfigError(f"TORCH_TPU_BASE_PORT={port} is outside 1024..65000; unset it or set e.g. 8070")
    return port


def launch_env_for_group(generation: str, group: list[list[Chip]], hostnames: dict[tuple[int, int], str] | None = None,
                         session_id: str | None = None, pick_ports: Callable[[int], list[int]] = free_ports,
                         first_port: int | None = None) -> list[dict[str, str]]:
    """The launch variables of each trainer rank (list index = trainer rank), as ``set_tpu_launch_env``
    would set them for this group, plus the per-rank ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``.

    Every rank gets the same ``TORCH_TPU_SLICEBUILDER_ADDRESSES``, ``TORCH_TPU_TOPOLOGY`` and
    ``TORCH_TPU_XPROF_SESSION_ID`` (and on several hosts ``TPU_WORKER_HOSTNAMES``, ``NNODES``,
    ``MASTER_ADDR``, ``MASTER_PORT``); ``NODE_RANK`` is its host's rank, hosts sorted by their block's
    coordinates Z-major, then Y, then X (as TorchTPU ranks hosts). ``hostnames`` maps (slice, host) to
    the address other hosts reach it at (a TPU VM's ``TPU_WORKER_HOSTNAMES`` entry); one host uses
    ``localhost`` and ports from ``pick_ports(n)``, which the controller runs on that host; several hosts
    use ``first_port`` + local rank (default :func:`base_port`). Raises ConfigError when TorchTPU cannot
    run the group.
    """
    if not group:
        raise ValueError("launch_env_for_group needs at least one trainer rank")
    hosts = _hosts(group)
    chips_per_host = math.prod(GENERATION_FACTS[generation].host_block)  # chips of one VM in a multi-host slice
    problems = torchtpu_group_problems(generation, group, chips_per_host)
    if problems:
        raise ConfigError(f"real TPU trainer group: {problems[0]}")
    session = session_id or str(time.time_ns())
    common = {"TORCH_TPU_XPROF_SESSION_ID": session, "TORCH_TPU_TOPOLOGY": group_topology(generation, group)}
    ranks = [chips[0] for chips in group]
    if len(hosts) == 1:
        ports = list(pick_ports(len(ranks)))
        if len(set(ports)) != len(ranks):
            raise ValueError(f"launch_env_for_group: {len(ranks)} distinct ports needed, got {ports}")
        addrs = [f"localhost:{p}" for p in ports]
        common["TORCH_TPU_SLICEBUILDER_ADDRESSES"] = ",".join(addrs)
        node_of = {hosts[0]: 0}
        order = sorted(range(len(ranks)), key=lambda r: ranks[r].index)
    else:
        if not hostnames or any(h not in hostnames for h in hosts):
            raise ValueError(f"launch_env_for_group: a multi-host group needs the address of each host {hosts}")
        origin = tuple(min((c.coords[d] if d < len(c.coords) else 0) for c in ranks) for d in range(3))
        block = {h: _host_block(next(c for c in ranks if (c.slice, c.host) == h), origin) for h in hosts}
        by_rank = sorted(hosts, key=lambda h: block[h][::-1])  # Z-major, Y, X-minor
        first = base_port() if first_port is None else first_port
        node_of = {h: i for i, h in enumerate(by_rank)}
        names = [hostnames[h] for h in by_rank]
        common |= {
            "TPU_WORKER_HOSTNAMES": ",".join(names),
            "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(
                f"{n}:{first + i}" for n in names for i in range(chips_per_host)),
            "NNODES": str(len(hosts)), "MASTER_ADDR": names[0], "MASTER_PORT": MASTER_PORT,
        }
        order = sorted(range(len(ranks)), key=lambda r: (node_of[(ranks[r].slice, ranks[r].host)], ranks[r].index))
    if order != list(range(len(ranks))):
        raise ConfigError(f"trainer ranks sit on chips {[c.global_id for c in ranks]}, not in TorchTPU's rank order "
                          f"(hosts by coordinates, then chip index); list placement.trainer_chip_ids in that order")
    per_host = len(ranks) // len(hosts)
    out = []
    for r, chip in enumerate(ranks):
        h = (chip.slice, chip.host)
        out.append(common | {
            "NODE_RANK": str(node_of[h]), "RANK": str(r), "LOCAL_RANK": str(r % per_host),
            "WORLD_SIZE": str(len(ranks)), "LOCAL_WORLD_SIZE": str(per_host),
            "TORCH_TPU_DEVICES_PER_HOST": str(per_host),  # TorchTPU's node-local store reads it with LOCAL_RANK
        })
    return out

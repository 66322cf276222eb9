"""TPU chips and their placement, as plain data.

Everything here is pure Python (no Ray, no JAX, no torch) so the planner, the CLI's dry run and
the tests can reason about chips without a cluster. Facts come from ``docs/tpu-hardware.md`` (Cloud
TPU docs per generation, Ray's ``python/ray/_private/accelerators/tpu.py``, xpk
``system_characteristics.py``, pytorch/xla PRs #4724 and #9586); each fact below names its source
tag there. On a joined cluster the hosts are read from Ray's labels (``ChipTable.from_ray_nodes``).

Layout conventions (ours, chosen to match Ray's host blocks; not checked on hardware):

* ``coords`` follow the order of the topology string (``"4x4"`` -> ``(d0, d1)``).
* A multi-host slice is cut into host blocks of 2x2 (2D) or 2x2x1 (3D) chips; hosts are numbered
  with dim 0 varying fastest, then dim 1, then dim 2.
* Inside a host, chip ``index`` (what ``TPU_VISIBLE_CHIPS`` names) also counts dim 0 fastest, so
  chips {0,1} and {2,3} are ICI neighbours and {0..3} is a 2x2 block.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass
from enum import Enum
from itertools import product
from typing import Any

from rltpu.config import ClusterConfig, ConfigError, PlacementConfig


class Role(str, Enum):
    SAMPLER = "sampler"
    TRAINER = "trainer"
    REWARD = "reward"  # an RLHF reward model's scoring group (optional)


class ChipConflictError(RuntimeError):
    """Two processes claim one chip (or share a process): libtpu allows one process per chip."""


@dataclass(frozen=True)
class GenerationFacts:
    tensorcores_per_chip: int
    jax_devices_per_chip: int  # megacore (v4/v5p) fuses 2 TCs into 1 device; 7x exposes 2 [PAL]
    type_prefix: str  # GCE accelerator-type prefix: <prefix>-<N>
    pod_counts: str  # what N in <prefix>-<N> counts: "chips" or "tensorcores"
    ray_accelerator_type: str  # Ray's "accelerator_type:<this>" node resource
    single_host_max_chips: int  # slices up to this many chips are one host holding all of them
    host_block: tuple[int, ...]  # chips per host in multi-host slices, as a block of the topology


# Sources: [v4] [v5e] [v5p] [v6e] [7x] [TT] [XPK] [RAY] [PAL] in docs/tpu-hardware.md.
# v5e/v6e: 1 TC/chip, type v5litepod-N / v6e-N with N = chips; 1x1, 2x2, 2x4 are single-host VMs
#   (up to 8 chips), multi-host slices use 4-chip VMs (2x2 blocks) [v5e][v6e][XPK][RAY].
# v4/v5p/7x: 2 TC/chip, type v4-N / v5p-N / tpu7x-N with N = TensorCores (2x2x1 = v4-8), 4 chips per
#   VM as a 2x2x1 block [TT][v5p][XPK][RAY][7x]. Ray names the accelerator TPU-<GEN upper>, with tpu7x
#   normalised to v7x [RAY].
GENERATION_FACTS: dict[str, GenerationFacts] = {
    "v4": GenerationFacts(2, 1, "v4", "tensorcores", "TPU-V4", 4, (2, 2, 1)),
    "v5e": GenerationFacts(1, 1, "v5litepod", "chips", "TPU-V5LITEPOD", 8, (2, 2)),
    "v5p": GenerationFacts(2, 1, "v5p", "tensorcores", "TPU-V5P", 4, (2, 2, 1)),
    "v6e": GenerationFacts(1, 1, "v6e", "chips", "TPU-V6E", 8, (2, 2)),
    "7x": GenerationFacts(2, 2, "tpu7x", "tensorcores", "TPU-V7X", 4, (2, 2, 1)),
}

# TPU_CHIPS_PER_PROCESS_BOUNDS for one process owning n chips of a host (Ray/skye gist: 1 -> 1,1,1,
# 2 -> 1,2,1; pytorch/xla: a full 4-chip host is 2,2,1; a full 8-chip v5e/v6e host is 2,4,1).
_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
DEFAULT_MESH_PORT = 8476  # libtpu's default mesh controller port (skye gist, pytorch/xla #4724)


@dataclass(frozen=True)
class Chip:
    global_id: int  # unique across all slices
    slice: int
    host: int  # worker id inside the slice (ray.io/tpu-worker-id)
    index: int  # chip index on its host, as TPU_VISIBLE_CHIPS names it
    coords: tuple[int, ...]  # position in the slice's topology


def local_tpu_present() -> bool:
    """True when this host exposes TPU chips (/dev/accel* or a Google vfio device), as Ray checks."""
    if glob.glob("/dev/accel[0-9]*"):
        return True
    for group in glob.glob("/dev/vfio/[0-9]*"):
        n = os.path.basename(group)
        for vendor in glob.glob(f"/sys/kernel/iommu_groups/{n}/devices/*/vendor"):
            try:
                if open(vendor).read().strip().lower() == "0x1ae0":  # Google's PCI vendor id [RAY]
                    return True
            except OSError:
                pass
    return False


def _lay_out(dims: tuple[int, ...], block: tuple[int, ...], slices: int) -> list[Chip]:
    """Chips of ``slices`` copies of a ``dims`` slice cut into hosts of ``block`` chips (dim 0 fastest)."""
    nblocks = [d // b for d, b in zip(dims, block)]

    def _linear(pos: tuple[int, ...], extent: list[int] | tuple[int, ...]) -> int:
        out, stride = 0, 1
        for p, e in zip(pos, extent):  # dim 0 varies fastest
            out += p * stride
            stride *= e
        return out

    chips: list[Chip] = []
    for s in range(slices):
        local = []
        # product() varies the last dim fastest; reverse so dim 0 is fastest, then sort anyway
        for rev in product(*(range(d) for d in reversed(dims))):
            coords = tuple(reversed(rev))
            host = _linear(tuple(c // b for c, b in zip(coords, block)), nblocks)
            index = _linear(tuple(c % b for c, b in zip(coords, block)), block)
            local.append((host, index, coords))
        for host, index, coords in sorted(local):
            chips.append(Chip(len(chips), s, host, index, coords))
    return chips


class ChipTable:
    """Every chip of the cluster, ordered by (slice, host, index); ``global_id`` is the position."""

    def __init__(self, cluster: ClusterConfig, chips: list[Chip], emulated: bool):
        self.cluster = cluster
        self.generation = cluster.generation
        self.topology = cluster.topology
        self.num_slices = cluster.slices
        self.facts = GENERATION_FACTS[cluster.generation]
        self.emulated = emulated
        self._chips = chips
        self._by_host: dict[tuple[int, int], list[Chip]] = {}
        for c in chips:
            self._by_host.setdefault((c.slice, c.host), []).append(c)
        self._chips_per_host = max((len(v) for v in self._by_host.values()), default=0)

    @classmethod
    def build(cls, cluster: ClusterConfig, emulated: bool | None = None) -> "ChipTable":
        """Lay out ``cluster.slices`` copies of ``cluster.topology`` as hosts and chips.

        ``emulated`` defaults to ``cluster.emulated``, and when that is None to "no TPU device on
        this machine". Raises ConfigError when a multi-host topology cannot be cut into host blocks.
        """
        if emulated is None:
            emulated = cluster.emulated if cluster.emulated is not None else not local_tpu_present()
        facts = GENERATION_FACTS[cluster.generation]
        dims = tuple(int(d) for d in cluster.topology.split("x"))
        per_slice = math.prod(dims)
        if per_slice <= facts.single_host_max_chips:
            block = dims  # one host holds the whole slice
        else:
            block = facts.host_block
            if any(d % b for d, b in zip(dims, block)):
                raise ConfigError(
                    f"cluster.topology={cluster.topology!r} has {per_slice} chips, so it spans several "
                    f"{cluster.generation} hosts of {'x'.join(map(str, block))} chips, but its dims are not "
                    f"multiples of that block; use e.g. {'4x4' if len(dims) == 2 else '2x2x2'}"
                )
        return cls(cluster, _lay_out(dims, block, cluster.slices), bool(emulated))

    @classmethod
    def from_ray_nodes(cls, cluster: ClusterConfig, nodes: list[dict]) -> "ChipTable":
        """The chip table of a running Ray cluster, read from what Ray says of each TPU node, not inferred.

        Ray's ``TPUAcceleratorManager`` (``ray/_private/accelerators/tpu.py``) gives every TPU VM the
        ``TPU`` resource (chips on that host), the labels ``ray.io/tpu-slice-name``, ``ray.io/tpu-worker-id``,
        ``ray.io/tpu-topology`` and ``ray.io/tpu-pod-type``, ``accelerator_type:TPU-<GEN>`` and, on worker 0,
        ``TPU-<pod type>-head``. Hosts, chips per host and the slice shape come from those; the config's
        ``cluster`` must agree with them (ConfigError naming the first disagreement). The first
        ``cluster.slices`` slices in name order are used, as ``Placement`` does.
        """
        facts = GENERATION_FACTS[cluster.generation]
        tpu = [n for n in nodes if n.get("Alive", True) and float(n.get("Resources", {}).get("TPU", 0)) > 0]
        if not tpu:
            raise ConfigError("the Ray cluster has no node with a TPU resource; is this a TPU VM / TPU node pool?")
        by_slice: dict[str, dict[int, dict]] = {}
        for n in tpu:
            lb, res = n.get("Labels", {}) or {}, n.get("Resources", {})
            where = f"Ray node {str(n.get('NodeID', '?'))[:12]} ({n.get('NodeManagerAddress', '?')})"
            missing = [k for k in ("ray.io/tpu-slice-name", "ray.io/tpu-worker-id", "ray.io/tpu-topology",
                                   "ray.io/tpu-pod-type") if k not in lb]
            if missing:
                raise ConfigError(f"{where} has {int(float(res['TPU']))} TPU chips but no {missing[0]} label; Ray sets "
                                  f"it from TPU_NAME / TPU_WORKER_ID / TPU_TOPOLOGY / TPU_ACCELERATOR_TYPE (GKE) or the "
                                  f"GCE metadata server: start Ray on the TPU VM itself, or set those variables")
            if lb["ray.io/tpu-topology"] != cluster.topology:
                raise ConfigError(f"{where} is in a {lb['ray.io/tpu-topology']} slice but cluster.topology="
                                  f"{cluster.topology!r}; set cluster.topology={lb['ray.io/tpu-topology']}")
            pod = lb["ray.io/tpu-pod-type"]
            if not pod.split("-")[0] in (facts.type_prefix, "v" + facts.type_prefix[len("tpu"):]):
                raise ConfigError(f"{where} is a {pod} but cluster.generation={cluster.generation!r}; set the "
                                  f"generation of its pod type")
            accel = f"accelerator_type:{facts.ray_accelerator_type}"
            if accel not in res:
                raise ConfigError(f"{where} lacks the {accel} resource Ray gives {cluster.generation} hosts")
            wid = int(lb["ray.io/tpu-worker-id"])
            hosts = by_slice.setdefault(lb["ray.io/tpu-slice-name"], {})
            if wid in hosts:
                raise ConfigError(f"two Ray nodes say they are worker {wid} of TPU slice {lb['ray.io/tpu-slice-name']}")
            hosts[wid] = {"chips": int(float(res["TPU"])), "head": any(k.endswith("-head") and k.startswith("TPU-")
                                                                        for k in res), "where": where}
        if len(by_slice) < cluster.slices:
            raise ConfigError(f"cluster.slices={cluster.slices} but the Ray cluster has {len(by_slice)} TPU slice(s) "
                              f"({', '.join(sorted(by_slice))}); lower cluster.slices")
        dims = tuple(int(d) for d in cluster.topology.split("x"))
        total = math.prod(dims)
        per_host = None
        for name in sorted(by_slice)[: cluster.slices]:
            hosts = by_slice[name]
            counts = sorted({h["chips"] for h in hosts.values()})
            if len(counts) != 1:
                raise ConfigError(f"TPU slice {name}: hosts hold {counts} chips; every host of a slice holds the same")
            if per_host is not None and counts[0] != per_host:
                raise ConfigError(f"TPU slices hold {per_host} and {counts[0]} chips per host; use equal slices")
            per_host = counts[0]
            if sorted(hosts) != list(range(total // per_host)) or total % per_host:
                raise ConfigError(f"TPU slice {name} ({cluster.topology}, {per_host} chips per host) should have "
                                  f"workers 0..{total // per_host - 1}, Ray has workers {sorted(hosts)}")
            if not hosts[0]["head"]:
                raise ConfigError(f"TPU slice {name}: worker 0 lacks Ray's TPU-<pod type>-head resource")
        if per_host == total:
            block = dims
        elif per_host == math.prod(facts.host_block) and all(d % b == 0 for d, b in zip(dims, facts.host_block)):
            block = facts.host_block
        else:
            raise ConfigError(f"{cluster.generation} {cluster.topology} with {per_host} chips per host: rltpu lays out "
                              f"hosts of {total} chips (one host) or {'x'.join(map(str, facts.host_block))} blocks only")
        return cls(cluster, _lay_out(dims, block, cluster.slices), False)

    # -- queries ---------------------------------------------------------------------------------

    def same_layout(self, other: "ChipTable") -> str:
        """"" when both tables have the same hosts, chips and coordinates, else the first difference."""
        if self.hosts() != other.hosts():
            return f"hosts {self.hosts()} vs {other.hosts()}"
        for h in self.hosts():
            a = [(c.index, c.coords) for c in self.chips_on(*h)]
            b = [(c.index, c.coords) for c in other.chips_on(*h)]
            if a != b:
                return f"host {h}: chips {a} vs {b}"
        return ""



    @property
    def chips(self) -> list[Chip]:
        return list(self._chips)

    @property
    def num_chips(self) -> int:
        return len(self._chips)

    @property
    def chips_per_slice(self) -> int:
        return self.num_chips // self.num_slices

    @property
    def chips_per_host(self) -> int:
        return self._chips_per_host

    def hosts(self) -> list[tuple[int, int]]:
        """All (slice, host) pairs in order."""
        return list(self._by_host)

    def chips_on(self, slice: int, host: int) -> list[Chip]:
        try:
            return list(self._by_host[(slice, host)])
        except KeyError:
            raise KeyError(f"no host {host} in slice {slice} (have {self.hosts()})") from None

    @property
    def pod_type(self) -> str:
        """GCE accelerator type of one slice: v5litepod-4, v4-8 (2x2x1: N counts TensorCores), tpu7x-8."""
        n = self.chips_per_slice
        if self.facts.pod_counts == "tensorcores":
            n *= self.facts.tensorcores_per_chip
        return f"{self.facts.type_prefix}-{n}"

    @property
    def ray_pod_type(self) -> str:
        """The pod type as Ray reports it: Ray rewrites a leading ``tpu`` to ``v`` (tpu7x-8 -> v7x-8)."""
        pt = self.pod_type
        return "v" + pt[len("tpu"):] if pt.startswith("tpu") else pt

    def slice_name(self, slice: int) -> str:
        """Name of a slice (Ray's TPU_NAME / ray.io/tpu-slice-name). Real clusters read it from Ray."""
        if not 0 <= slice < self.num_slices:
            raise IndexError(f"slice {slice} out of range (cluster has {self.num_slices})")
        return f"rltpu-{'emu-' if self.emulated else ''}slice-{slice}"

    def describe(self) -> str:
        s = self.num_slices
        return f"{self.generation} {self.topology} x {s} slice{'s' if s != 1 else ''}"

    def to_rows(self) -> list[dict[str, Any]]:
        """One flat dict per chip, for reports and logs."""
        return [
            {
                "global_id": c.global_id,
                "slice": c.slice,
                "slice_name": self.slice_name(c.slice),
                "host": c.host,
                "index": c.index,
                "coords": ",".join(map(str, c.coords)),
                "pod_type": self.pod_type,
                "emulated": self.emulated,
            }
            for c in self._chips
        ]

    def __repr__(self) -> str:
        return (
            f"ChipTable({self.describe()}, {self.num_chips} chips on {len(self._by_host)} hosts, "
            f"pod_type={self.pod_type}, emulated={self.emulated})"
        )


# ---------------------------------------------------------------------------------------------
# Placement


def unimplemented_parallelism(chips_per_sampler: int, chips_per_trainer: int, full: bool = True,
                              mode: str = "disaggregated") -> str:
    """Why ``rltpu train`` cannot run processes of these sizes ("" when it can): the one-line error
    (``full``) or the short reason the planner's report shows.

    A sampler with k chips builds a k-device JAX mesh (``rltpu.sampling.tp``). A trainer block of k
    chips runs as k one-chip processes forming one tensor-parallel group (``trainer_processes``,
    ``learner/tp.py``). A colocated process holds a trainer rank (one torch device) and a sampler
    engine on the same chips: k > 1 there would leave the trainer's other chips idle, so colocated
    runs one chip per process.
    """
    if mode == "colocated" and max(chips_per_sampler, chips_per_trainer) > 1:
        short = "tensor parallelism inside colocated processes is not implemented"
        if not full:
            return f"colocated chips_per_process={max(chips_per_sampler, chips_per_trainer)}: {short}"
        return (f"placement.mode=colocated with chips_per_sampler={chips_per_sampler}: {short}; set "
                f"placement.chips_per_sampler=chips_per_trainer=1, or use placement.mode=disaggregated")
    return ""


def trainer_processes(blocks: list[list[Chip]]) -> list[list[Chip]]:
    """The trainer processes of ``assign_roles``' trainer blocks: one per chip (TorchTPU runs one process
    per chip), so a block of k chips becomes k consecutive trainer ranks, one tensor-parallel group."""
    return [[c] for block in blocks for c in block]


def assign_roles(table: ChipTable, placement: PlacementConfig) -> dict[Role, list[list[Chip]]]:
    """Give each actor (one process) its chips: samplers first, then trainers, in host order.

    An actor's chips sit on one host (a process cannot open chips of another VM) and form an
    aligned block (start index a multiple of its size), so pairs and quads are ICI neighbours.
    With power-of-two actor sizes this never fails when the total fits. Raises ConfigError.
    """
    plan = _role_plan(table, placement)
    free = {h: [True] * len(table.chips_on(*h)) for h in table.hosts()}
    out: dict[Role, list[list[Chip]]] = {Role.SAMPLER: [], Role.TRAINER: [], Role.REWARD: []}
    pinned = {Role.SAMPLER: placement.sampler_chip_ids, Role.TRAINER: placement.trainer_chip_ids,
              Role.REWARD: placement.reward_chip_ids}
    for role, total, per in plan:  # pinned chips first, so automatic placement avoids them
        ids = pinned[role]
        if ids is None:
            continue
        bad = [i for i in ids if not 0 <= i < table.num_chips]
        if bad:
            raise ConfigError(
                f"placement.{role.value}_chip_ids has chip {bad[0]} but cluster {table.describe()} has chips "
                f"0..{table.num_chips - 1}"
            )
        for rank in range(total // per):
            group = [table._chips[i] for i in ids[rank * per:(rank + 1) * per]]
            if len({(c.slice, c.host) for c in group}) > 1:
                raise ConfigError(
                    f"placement.{role.value}_chip_ids puts {role.value} actor {rank} on chips "
                    f"{[c.global_id for c in group]} of different hosts; one process owns chips of one host"
                )
            for c in group:
                free[(c.slice, c.host)][c.index] = False
            out[role].append(sorted(group, key=lambda c: c.index))
    hosts = table.hosts()
    for role, total, per in plan:
        if pinned[role] is not None:
            continue
        first = 0  # hosts before it hold no free aligned block of `per` (chips are only ever taken)
        for rank in range(total // per):
            got = None
            for hi in range(first, len(hosts)):
                slots = free[hosts[hi]]
                for start in range(0, len(slots) - per + 1, per):
                    if all(slots[start : start + per]):
                        got = (hosts[hi], start)
                        break
                if got:
                    first = hi
                    break
            if got is None:
                raise _unplaceable(table, role, rank, per)
            h, start = got
            for i in range(start, start + per):
                free[h][i] = False
            out[role].append(table._by_host[h][start : start + per])
    return out


def _role_plan(table: ChipTable, placement: PlacementConfig) -> list[tuple[Role, int, int]]:
    """(role, chips, chips per actor) in placement order, after the checks every placement passes."""
    reward = placement.reward_chips
    # colocated: the samplers run inside the trainer processes, on the trainers' chips
    samplers = 0 if getattr(placement, "mode", "disaggregated") == "colocated" else placement.sampler_chips
    want = samplers + placement.trainer_chips + reward
    if want > table.num_chips:
        raise ConfigError(
            f"placement asks for {want} chips (sampler_chips={samplers} + "
            f"trainer_chips={placement.trainer_chips}{f' + reward_chips={reward}' if reward else ''}) but cluster "
            f"{table.describe()} has {table.num_chips} chips; lower placement.* or enlarge cluster.topology/slices"
        )
    plan = [
        (Role.SAMPLER, samplers, placement.chips_per_sampler),
        (Role.TRAINER, placement.trainer_chips, placement.chips_per_trainer),
    ]
    if reward:
        plan.append((Role.REWARD, reward, placement.chips_per_reward))
    for role, _, per in plan:
        if per > table.chips_per_host:
            raise ConfigError(
                f"placement.chips_per_{role.value}={per} but each host of cluster {table.describe()} has "
                f"{table.chips_per_host} chips and one process cannot span hosts; lower "
                f"placement.chips_per_{role.value} to <= {table.chips_per_host}"
            )
    return plan


def _unplaceable(table: ChipTable, role: Role, rank: int, per: int) -> ConfigError:
    return ConfigError(
        f"cannot place {role.value} actor {rank} ({per} chips on one host) on cluster "
        f"{table.describe()} ({table.chips_per_host} chips per host) after earlier actors; "
        f"lower placement.chips_per_{role.value} or placement.{role.value}_chips"
    )


# A run of actors: (first host, hosts, actors on each), hosts as indices into ``ChipTable.hosts()``.
HostRun = tuple[int, int, int]


def _fill(segs: list[list], need: int, per: int) -> tuple[list[HostRun], int]:
    """Place ``need`` actors of ``per`` chips first-fit, as ``assign_roles`` does, over ``segs``:
    runs of consecutive hosts in one state, ``[hosts, free-slot tuple]``, updated in place. A run
    is handled at once (every host of it takes the same aligned blocks), so the cost is the number
    of runs, not of chips. Returns the actor runs and how many actors found room."""
    runs: list[HostRun] = []
    placed = pos = i = 0
    while placed < need and i < len(segs):
        cnt, bm = segs[i]
        starts = [s for s in range(0, len(bm) - per + 1, per) if all(bm[s:s + per])]
        if not starts:
            pos, i = pos + cnt, i + 1
            continue

        def take(k: int) -> tuple:
            out = list(bm)
            for s in starts[:k]:
                out[s:s + per] = [False] * per
            return tuple(out)

        b, new = len(starts), []
        full = min(cnt, (need - placed) // b)
        if full:  # whole hosts: every aligned block of each
            new.append([full, take(b)])
            runs.append((pos, full, b))
            placed += full * b
        rest = cnt - full
        if rest and placed < need:  # one host takes the last few
            r = need - placed
            new.append([1, take(r)])
            runs.append((pos + full, 1, r))
            placed, rest = need, rest - 1
        if rest:
            new.append([rest, bm])
        segs[i:i + 1] = new
        pos, i = pos + cnt, i + len(new)
    return runs, placed


def _free_segments(table: ChipTable) -> list[list]:
    segs: list[list] = []
    for h in table.hosts():
        n = len(table._by_host[h])
        if segs and len(segs[-1][1]) == n:
            segs[-1][0] += 1
        else:
            segs.append([1, (True,) * n])
    return segs


def place_counts(table: ChipTable, placement: PlacementConfig) -> dict[Role, list[HostRun]]:
    """What ``assign_roles`` would place, as runs of hosts instead of one chip list per actor.

    The planner costs thousands of candidates on slices of thousands of chips: it needs only how
    many actors of each role sit on which host. Same order, same ConfigErrors as ``assign_roles``
    (``tests/test_plan_scale.py`` compares them); pinned chip ids are ``assign_roles``' job.
    """
    if any(getattr(placement, f"{r.value}_chip_ids") is not None for r in Role):
        raise ValueError("place_counts takes unpinned placements; use assign_roles for *_chip_ids")
    segs = _free_segments(table)
    out: dict[Role, list[HostRun]] = {Role.SAMPLER: [], Role.TRAINER: [], Role.REWARD: []}
    for role, total, per in _role_plan(table, placement):
        out[role], placed = _fill(segs, total // per, per)
        if placed < total // per:
            raise _unplaceable(table, role, placed, per)
    return out


def aligned_blocks(table: ChipTable, per: int, limit: int) -> list[HostRun]:
    """The first ``limit`` aligned blocks of ``per`` chips in host order (colocated processes)."""
    return _fill(_free_segments(table), limit, per)[0]


# ---------------------------------------------------------------------------------------------
# Per-process libtpu environment


def mesh_port(chips: list[Chip], base: int = DEFAULT_MESH_PORT) -> int:
    """A mesh-controller port unique among the processes of one host: base + lowest chip index."""
    return base + min(c.index for c in chips)


def libtpu_env(chips: list[Chip], generation: str, port: int) -> dict[str, str]:
    """Env vars for one process that owns exactly ``chips`` (all on one host) and no others.

    Only one process may open a chip, and libtpu by default opens every chip of the host, so each
    process is told its chips and bounds, and gets its own mesh controller port (``port`` must
    differ between processes on a host; see :func:`mesh_port`).

    Verified on paper only (no TPU here): the values follow the skye gist / pytorch/xla #4724 /
    #9586 and Ray's ``set_current_process_visible_accelerator_ids`` as quoted in
    tpu-hardware.md. Unverified: the 4- and 8-chip bounds (2,2,1 / 2,4,1) for a process that owns
    only part of an 8-chip host, the ``,2`` suffix on 7x, and whether newer libtpu still reads
    the legacy TPU_CHIPS_PER_HOST_BOUNDS / TPU_HOST_BOUNDS (Ray still sets them for 1 or 2 chips;
    we set them to the same values for every size so that a stale pair never contradicts).
    """
    if not chips:
        raise ValueError("libtpu_env needs at least one chip")
    hosts = {(c.slice, c.host) for c in chips}
    if len(hosts) != 1:
        raise ValueError(f"one process cannot own chips on several hosts: {sorted(hosts)}")
    if generation not in GENERATION_FACTS:
        raise ValueError(f"unknown TPU generation {generation!r} (known: {sorted(GENERATION_FACTS)})")
    idx = sorted(c.index for c in chips)
    if len(set(idx)) != len(idx):
        raise ValueError(f"duplicate chip indices {idx}")
    if len(idx) not in _CHIP_BOUNDS:
        raise ValueError(f"a process must own 1, 2, 4 or 8 chips (Ray and libtpu bounds), got {len(idx)}")
    bounds = _CHIP_BOUNDS[len(idx)]
    process_bounds = "1,1,1" + (",2" if generation == "7x" else "")  # pytorch/xla #9586
    return {
        "TPU_VISIBLE_CHIPS": ",".join(map(str, idx)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
        "TPU_PROCESS_BOUNDS": process_bounds,
        "TPU_CHIPS_PER_HOST_BOUNDS": bounds,  # legacy names, as Ray sets them
        "TPU_HOST_BOUNDS": "1,1,1",
        "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}",
        "TPU_MESH_CONTROLLER_PORT": str(port),
    }


# ---------------------------------------------------------------------------------------------
# Emulated Ray nodes


def emulated_node_spec(table: ChipTable, slice: int, host: int) -> tuple[dict[str, float], dict[str, str]]:
    """Ray resources and labels that a real TPU VM of this (slice, host) would advertise.

    Mirrors Ray's TPUAcceleratorManager: ``TPU`` = chips on the host, ``{tpu_name: 1}`` on every
    host, ``TPU-{pod_type}-head`` on worker 0 only, ``accelerator_type:TPU-V5LITEPOD`` style, and
    the ray.io/tpu-* labels. Ray normalises the pod type (tpu7x-8 -> v7x-8), so we do too.
    ``rltpu.io/emulated`` marks the node as fake so nothing mistakes it for hardware.
    """
    chips = table.chips_on(slice, host)
    name = table.slice_name(slice)
    pod = table.ray_pod_type
    resources: dict[str, float] = {
        "TPU": float(len(chips)),
        name: 1.0,
        f"accelerator_type:{table.facts.ray_accelerator_type}": 1.0,
    }
    if host == 0:
        resources[f"TPU-{pod}-head"] = 1.0
    labels = {
        "ray.io/tpu-slice-name": name,
        "ray.io/tpu-worker-id": str(host),
        "ray.io/tpu-topology": table.topology,
        "ray.io/tpu-pod-type": pod,
        "rltpu.io/emulated": "true",
    }
    return resources, labels


# ---------------------------------------------------------------------------------------------
# Runtime check


def check_disjoint(reports: list[dict[str, Any]]) -> None:
    """Fail if two actor reports claim one (node_id, chip) or share a pid.

    Each report has ``group``, ``rank``, ``pid``, ``node_id`` and ``chips`` (chip indices on that
    node, e.g. from ``get_accelerator_ids()["TPU"]``). Run after actors start: a double claim on
    real hardware is "TPU already in use" or a silent CPU fallback (jax-ml/jax#10192, #13260).
    """

    def who(r: dict[str, Any]) -> str:
        return f"{r['group']} rank {r['rank']} (pid {r['pid']})"

    by_chip: dict[tuple[str, int], dict[str, Any]] = {}
    by_pid: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in reports:
        pid_key = (str(r["node_id"]), r["pid"])
        if pid_key in by_pid:
            raise ChipConflictError(
                f"{who(by_pid[pid_key])} and {who(r)} run in the same process on node "
                f"{str(r['node_id'])[:12]}; each actor must be its own process"
            )
        by_pid[pid_key] = r
        for chip in r["chips"]:
            key = (str(r["node_id"]), int(chip))
            if key in by_chip and by_chip[key] is not r:
                raise ChipConflictError(
                    f"chip {int(chip)} on node {str(r['node_id'])[:12]} is claimed by both "
                    f"{who(by_chip[key])} and {who(r)}"
                )
            by_chip[key] = r

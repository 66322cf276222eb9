"""The trainer group's TorchTPU launch variables (rltpu.chips.launch) against torch_tpu's own
``torch.tpu.distributed.set_tpu_launch_env``, run in a fresh process per case (its env reads are
memoized per process) with the inputs a TPU VM would give it.

Where the real function needs a device this CPU machine lacks, the child replaces exactly one
function and the test says which:
- single host: ``TORCH_TPU_TOPOLOGY`` comes from the PCI scan (``hardware._scan_pci_tpus``); the child
  returns what a v5e VM's bus shows (chip count, and torch_tpu's own v5e table ``_V5E_TOPOLOGY``).
- multi-host: ``NODE_RANK`` comes from the chips' coordinates (a PJRT query in a child) or else from
  ``JOB_COMPLETION_INDEX``; the test sets ``JOB_COMPLETION_INDEX`` as a GKE indexed job does, and checks
  the coordinate path by calling torch_tpu's pure ``_calculate_topological_node_rank`` on our chips'
  coordinates. ``TORCH_TPU_TOPOLOGY`` on multi-host is only ever supplied from outside (the function
  never overwrites it; without a device it sets none), so for it the test checks our value by hand:
  a 2-host v5e 2x4 slice is "2,4,1" (``_parse_topology`` pads to 3 dims).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rltpu.chips.launch import HOST_SUBSLICE_TOPOLOGY, launch_env_for_group, torchtpu_group_problems
from rltpu.chips.topology import Chip, ChipTable, assign_roles, Role
from rltpu.config import ClusterConfig, ConfigError, PlacementConfig

pytest.importorskip("torch_tpu", reason="the tpu extra (make setup installs it)")

CHILD = r"""
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch_tpu  # registers torch.tpu
from torch_tpu._internal.utils import hardware
from torch_tpu._internal.distributed import distributed as d
args = json.loads(sys.argv[1])
if args.get("pci"):  # what a v5e VM's PCI bus reports: the one thing this machine cannot show
    n = args["pci"]
    hardware._scan_pci_tpus = lambda: (n, hardware._V5E_TOPOLOGY)
out = {}
try:
    torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=args["nproc"])
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
for k in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID", "NNODES",
          "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
    if k in os.environ:
        out[k] = os.environ[k]
out["node_rank_from_coords"] = [d._calculate_topological_node_rank(c, args["topo"]) for c in args.get("coords", [])]
print("RESULT=" + json.dumps(out))
"""

_CLEAN = ("TORCH_TPU_", "TPU_", "NNODES", "NODE_RANK", "MASTER_", "JOB_COMPLETION_INDEX", "WORLD_SIZE", "RANK",
          "LOCAL_RANK")


def run_real(args: dict, env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEAN)}
    env |= {"PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/", "JAX_PLATFORMS": "cpu"} | env_extra
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env, capture_output=True, text=True,
                         timeout=300)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert line, res.stderr[-2000:]
    return json.loads(line[-1][len("RESULT="):])


def _ports(addrs: str) -> list[tuple[str, int]]:
    return [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addrs.split(",")]


def test_single_host_v5e_2x2_trainer_group_matches_set_tpu_launch_env():
    table = ChipTable.build(ClusterConfig(generation="v5e", topology="2x2"), emulated=False)
    group = [[c] for c in table.chips]  # 4 trainer ranks, one per chip
    ours = launch_env_for_group("v5e", group, session_id="123")
    real = run_real({"nproc": 4, "pci": 4}, {})
    assert "error" not in real, real
    assert len({json.dumps({k: v for k, v in e.items() if k.startswith("TORCH_TPU_")}) for e in ours}) == 1
    assert ours[0]["TORCH_TPU_TOPOLOGY"] == real["TORCH_TPU_TOPOLOGY"] == "2,2,1"
    mine, theirs = _ports(ours[0]["TORCH_TPU_SLICEBUILDER_ADDRESSES"]), _ports(real["TORCH_TPU_SLICEBUILDER_ADDRESSES"])
    # free ports are picked at call time: same shape (one localhost:port per rank, all distinct)
    assert [h for h, _ in mine] == [h for h, _ in theirs] == ["localhost"] * 4
    assert len({p for _, p in mine}) == len({p for _, p in theirs}) == 4
    assert real["TORCH_TPU_XPROF_SESSION_ID"].isdigit()
    assert "NODE_RANK" not in real and "NNODES" not in real  # single host: no rendezvous variables
    assert [e["RANK"] for e in ours] == ["0", "1", "2", "3"] and {e["WORLD_SIZE"] for e in ours} == {"4"}


def test_sub_slice_of_an_8_chip_v5e_host_beside_samplers():
    """4 samplers then 4 trainers on one v5e 2x4 host: the trainers' sub-slice is TorchTPU's 4-chip
    topology; a 2-chip trainer group is refused by both (v5e has no 2-chip single-host topology)."""
    cluster = ClusterConfig(generation="v5e", topology="2x4")
    table = ChipTable.build(cluster, emulated=False)
    roles = assign_roles(table, PlacementConfig(sampler_chips=4, trainer_chips=4))
    trainers = roles[Role.TRAINER]
    assert [c.index for g in trainers for c in g] == [4, 5, 6, 7]
    ours = launch_env_for_group("v5e", trainers)
    real = run_real({"nproc": 4, "pci": 8}, {})
    assert ours[0]["TORCH_TPU_TOPOLOGY"] == real["TORCH_TPU_TOPOLOGY"] == HOST_SUBSLICE_TOPOLOGY["v5e"][4]
    two = assign_roles(table, PlacementConfig(sampler_chips=6, trainer_chips=2))[Role.TRAINER]
    assert torchtpu_group_problems("v5e", two, 8)
    with pytest.raises(ConfigError, match="sub-slice only of \\[1, 4, 8\\]"):
        launch_env_for_group("v5e", two)
    refused = run_real({"nproc": 2, "pci": 8}, {})
    assert refused["error"] == "RuntimeError: No TPU topology found for count: 2"


def two_host_v5e_2x4() -> list[Chip]:
    """A v5e 2x4 slice on two 4-chip VMs (GKE ct5lp-hightpu-4t): host h holds y in {2h, 2h+1};
    chip index counts x fastest (rltpu's convention in rltpu/chips/topology.py)."""
    chips = []
    for y in range(4):
        for x in range(2):
            h = y // 2
            chips.append(Chip(len(chips), 0, h, x + 2 * (y % 2), (x, y)))
    return sorted(chips, key=lambda c: (c.host, c.index))


def test_two_host_v5e_2x4_slice_matches_set_tpu_launch_env():
    chips = two_host_v5e_2x4()
    group = [[c] for c in chips]
    names = {(0, 0): "10.130.0.2", (0, 1): "10.130.0.3"}  # TPU_WORKER_HOSTNAMES on a TPU VM: worker IPs
    ours = launch_env_for_group("v5e", group, names, session_id="77")
    assert ours[0]["TORCH_TPU_TOPOLOGY"] == "2,4,1"  # by hand: 2 x 4 chips, z = 1
    for host in (0, 1):
        mine = next(e for e, g in zip(ours, group) if g[0].host == host)
        coords = [list(c.coords) + [0] for c in chips if c.host == host]
        real = run_real({"nproc": 4, "topo": mine["TORCH_TPU_TOPOLOGY"], "coords": coords},
                        {"TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3", "JOB_COMPLETION_INDEX": str(host),
                         "TORCH_TPU_TOPOLOGY": mine["TORCH_TPU_TOPOLOGY"]})
        assert "error" not in real, real
        for k in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCH_TPU_TOPOLOGY"):
            assert mine[k] == real[k], (k, mine[k], real[k])
        # the coordinate path (what a real VM uses): every chip of this host ranks the host the same
        assert real["node_rank_from_coords"] == [host] * 4
    assert ours[0]["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == ",".join(
        [f"10.130.0.2:{8070 + i}" for i in range(4)] + [f"10.130.0.3:{8070 + i}" for i in range(4)])
    # same values on every rank except the host's own rank
    shared = {k for k in ours[0] if k not in ("NODE_RANK", "RANK", "LOCAL_RANK")}
    assert all(e[k] == ours[0][k] for e in ours for k in shared)
    assert [e["RANK"] for e in ours] == [str(i) for i in range(8)]
    assert [e["LOCAL_RANK"] for e in ours] == ["0", "1", "2", "3"] * 2


def test_two_hosts_need_whole_hosts_and_one_chip_per_rank():
    chips = two_host_v5e_2x4()
    part = [[c] for c in chips[2:]]  # 2 chips of host 0 + 4 of host 1
    assert "whole 4-chip hosts" in torchtpu_group_problems("v5e", part, 4)[0]
    pairs = [chips[i:i + 2] for i in range(0, 8, 2)]
    assert "chips_per_trainer=2" in torchtpu_group_problems("v5e", pairs, 4)[0]
    assert "devices" in torchtpu_group_problems("7x", [[chips[0]]], 4)[0]


def test_torch_tpu_base_port_is_honoured_as_set_tpu_launch_env_honours_it(monkeypatch):
    """``TORCH_TPU_BASE_PORT`` in the driver's env moves the multi-host slice-builder ports, as it moves
    ``set_tpu_launch_env``'s (which read it; rltpu used to ignore it and always use 8070)."""
    chips = two_host_v5e_2x4()
    group = [[c] for c in chips]
    names = {(0, 0): "10.130.0.2", (0, 1): "10.130.0.3"}
    monkeypatch.setenv("TORCH_TPU_BASE_PORT", "9300")
    ours = launch_env_for_group("v5e", group, names, session_id="78")
    real = run_real({"nproc": 4, "topo": "2,4,1"}, {"TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3",
                                                   "JOB_COMPLETION_INDEX": "0", "TORCH_TPU_TOPOLOGY": "2,4,1",
                                                   "TORCH_TPU_BASE_PORT": "9300"})
    assert "error" not in real, real
    assert ours[0]["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == real["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
    assert real["TORCH_TPU_SLICEBUILDER_ADDRESSES"].startswith("10.130.0.2:9300,10.130.0.2:9301")
    monkeypatch.setenv("TORCH_TPU_BASE_PORT", "http")
    with pytest.raises(ConfigError, match="TORCH_TPU_BASE_PORT='http' is not a port number"):
        launch_env_for_group("v5e", group, names)


def test_single_host_ports_come_from_the_tpu_host():
    """One host: the slice-builder ports are whatever the picker run on the TPU host returns (the controller
    asks trainer 0's actor, ``TrainerActor.free_ports``), not ports found free on the driver."""
    from rltpu.chips.launch import free_ports

    table = ChipTable.build(ClusterConfig(generation="v6e", topology="2x4"), emulated=False)
    asked = []

    def on_host(n):
        asked.append(n)
        return [40001, 40002, 40003, 40004]

    envs = launch_env_for_group("v6e", [[c] for c in table.chips[4:]], pick_ports=on_host)
    assert asked == [4]
    assert envs[0]["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "localhost:40001,localhost:40002,localhost:40003,localhost:40004"
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    with pytest.raises(ValueError, match="distinct ports"):
        launch_env_for_group("v6e", [[c] for c in table.chips[4:]], pick_ports=lambda n: [5] * n)

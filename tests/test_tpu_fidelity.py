"""The real-chip path checked against the real packages' own code, run on this CPU machine (issue 29).

No TPU here, so each check runs the function of torch_tpu / libtpu / Ray that decides the thing on a
TPU VM, with the inputs such a VM gives it, and compares rltpu's decision with it:

- (a) + (c): a trainer process started with exactly the env ``Placement`` gives its actors imports
  torch_tpu only after its chip claim set the launch env, and reaches torch_tpu's own ``load()``
  (which on this machine then finds no device: the claim fails in one line, never falls back);
- (b): the rank layout torch_tpu's own mesh builder (``device_utils.create_device_mesh``, what
  ``topology_aware_mesh`` calls) gives for v5e/v6e chips drives weight sync, which places each
  trainer's stream by the shard it holds (its position), whatever order the mesh lists ranks in; a
  sync through the permuted mesh gives the FSDP trainer's logits;
- (d): Ray's TPU labels of real hosts (what Ray's ``TPUAcceleratorManager`` sets, from its source)
  lead to the same chip table as the config's topology.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import spawn_ranks

from rltpu.chips.topology import ChipTable
from rltpu.config import ClusterConfig, ModelConfig
from rltpu.sync.collective import param_spec, plan_stream, shard_rows, staging_layout, trainer_rows

pytest.importorskip("torch_tpu", reason="the tpu extra (make setup installs it)")

ROOT = Path(__file__).resolve().parents[1]
KIND = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}  # PJRT device_kind, as torch_tpu's device_utils names them


def torch_tpu_positions(generation: str, topology: str, ranks_of_chips: list[int] | None = None) -> list[int]:
    """Each trainer rank's position in the 1-D FSDP mesh that torch_tpu's ``topology_aware_mesh`` builds for
    one rank per chip of a ``topology`` slice: its own mesh builder on stub devices (``_DeviceStub``, the
    duck-typed device it feeds that builder from the all-gathered PJRT attributes). ``ranks_of_chips``:
    the torch rank on each chip of the table (default: chip order)."""
    saved = dict(os.environ)  # importing torch_tpu imports libtpu, which sets TPU_LIBRARY_PATH here
    from torch_tpu._internal.distributed import device_utils
    from torch_tpu._internal.distributed.device_mesh import _DeviceStub

    os.environ.clear()
    os.environ.update(saved)

    table = ChipTable.build(ClusterConfig(generation=generation, topology=topology), emulated=False)
    ranks = ranks_of_chips or list(range(table.num_chips))
    stubs = [_DeviceStub(id=c.global_id, coords=(c.coords[0], c.coords[1] if len(c.coords) > 1 else 0, 0),
                         core_on_chip=0, device_kind=KIND[generation], platform="tpu", process_index=c.host,
                         slice_index=0) for c in table.chips]
    layout = device_utils.create_device_mesh((len(stubs),), devices=sorted(stubs, key=lambda d: d.id))
    by_pos = [ranks[d.id] for d in layout.reshape(-1)]
    return [by_pos.index(r) for r in range(len(by_pos))]


def test_torch_tpu_orders_v5e_and_v6e_hosts_as_a_ring():
    """The finding as torch_tpu states it: mesh position is not rank on 4- and 8-chip hosts."""
    for gen in ("v5e", "v6e"):
        assert torch_tpu_positions(gen, "2x2") == [0, 1, 3, 2]
        assert torch_tpu_positions(gen, "2x4") == [0, 1, 2, 3, 7, 6, 5, 4]


V = 17
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("generation,topology", [("v5e", "2x2"), ("v6e", "2x4"), ("v5e", "4x4")])
def test_streams_by_mesh_position_reassemble_every_tensor(generation, topology):
    """Each trainer holds the FSDP rows of its mesh position (``Shard(0)`` over the mesh); stream r carries
    them under ``positions[r]`` and the receiver's staging arena gets every element exactly once, from
    the right rank. A 4-host v5e 4x4 slice (16 trainer ranks) uses the launch env's rank order."""
    from rltpu.chips.launch import launch_env_for_group

    table = ChipTable.build(ClusterConfig(generation=generation, topology=topology), emulated=False)
    group = [[c] for c in table.chips]
    hosts = {(c.slice, c.host): f"10.0.0.{c.host + 1}" for c in table.chips}
    envs = launch_env_for_group(generation, group, hosts, session_id="1", pick_ports=lambda n: list(range(9000, 9000 + n)))
    ranks_of_chips = [int(e["RANK"]) for e in envs]  # group is in chip order: rank of chip i
    positions = torch_tpu_positions(generation, topology, ranks_of_chips)
    n = len(positions)
    assert sorted(positions) == list(range(n)) and positions != list(range(n))
    spec = param_spec(MCFG, V)
    full = {name: torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) + 0.5 * i
            for i, (name, shape, _) in enumerate(spec)}
    # what FSDP2 holds on each rank of a mesh in this order: the chunk of its mesh coordinate
    held = {r: {name: t.chunk(n, 0)[positions[r]] if positions[r] < len(t.chunk(n, 0)) else t[:0]
                for name, t in full.items()} for r in range(n)}
    offs, total = staging_layout(spec)
    arena = torch.full((total // 4,), float("nan"))
    seen = torch.zeros(total // 4, dtype=torch.int64)
    for r in range(n):
        for m in plan_stream(spec, n, positions[r], 600, "auto"):
            for pc in m.pieces:
                shape = next(s for nm, s, _ in spec if nm == pc.name)
                row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                r0, _ = trainer_rows(pc.name, shape[0], n, positions[r], 1)
                src = held[r][pc.name].reshape(-1)[pc.start - r0 * row: pc.start - r0 * row + pc.numel]
                lo = offs[pc.name] // 4 + pc.start
                arena[lo: lo + pc.numel] = src
                seen[lo: lo + pc.numel] += 1
    for name, shape, _ in spec:
        lo = offs[name] // 4
        k = int(np.prod(shape))
        assert seen[lo: lo + k].eq(1).all(), name
        torch.testing.assert_close(arena[lo: lo + k].reshape(shape), full[name], rtol=0, atol=0)
    # and by rank order, as the sync was before: rank r's rows land where position r's belong
    wrong = [r for r in range(n) if shard_rows(V, n, r) != shard_rows(V, n, positions[r])]
    assert wrong, "the permutation must move some embedding rows, or this test proves nothing"


PROBE_TOKENS = np.array([[3, 5, 7, 2, 9, 4], [6, 6, 1, 8, 0, 0]], np.int64)
PROBE_MASK = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], np.int64)


def _permuted_sync_worker(rank: int, world: int, port: int, layout: list[int], store_port: int, q) -> None:
    """Trainers: a gloo world of their own (as on real chips, where the "tpu" world holds the trainers only)
    and FSDP2 over a ``DeviceMesh`` whose rank layout is torch_tpu's; the sampler joins only the fabric."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["JAX_PLATFORMS"] = "cpu"
    torch.set_num_threads(1)
    os.environ.pop("TPU_LIBRARY_PATH", None)  # set by `import libtpu` in the test process: not a TPU here
    import jax

    jax.config.update("jax_platforms", "cpu")  # the forkserver imported JAX before this env was set
    from rltpu.config import SamplerConfig, TrainerConfig
    from rltpu.sync.collective import (SyncFabric, device_put_params, host_store, local_shards, plan_route,
                                       receive_staged, send_shards)

    m = len(layout)
    spec = param_spec(MCFG, V)
    pos_ids = np.maximum(np.cumsum(PROBE_MASK, 1) - 1, 0)
    if rank == 0:
        host_store("127.0.0.1", store_port, 60)
    fab = SyncFabric("127.0.0.1", store_port, 1, rank, plan_route([0] * m, [0] * (world - m)), 60, bind="127.0.0.1")
    if rank < m:
        from torch.distributed.device_mesh import DeviceMesh

        from learner.tp import mesh_position
        from learner.trainer import TrainerEngine

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=m,
                                timeout=timedelta(seconds=60))
        mesh = DeviceMesh("cpu", torch.tensor(layout))
        eng = TrainerEngine(MCFG, TrainerConfig(), V, 0, mesh=mesh, device="cpu")
        me = mesh_position(mesh)[0]
        coord = mesh.get_coordinate()[0]
        emb = eng.model.state_dict()["model.embed_tokens.weight"]
        holds_me = torch.equal(emb.to_local(), emb.full_tensor().chunk(m, 0)[me])  # the rows FSDP2 really gave it
        got = [None] * m
        dist.all_gather_object(got, me)  # what the controller gathers with TrainerActor.mesh_position
        shards = local_shards(eng.model, [n for n, _, _ in spec])
        st = send_shards(fab, shards, spec, 1, 6000, "auto", 1, got)
        q.put((rank, ((coord, me, holds_me), got, st["bytes"],
                      np.asarray(eng.probe_logits(PROBE_TOKENS, pos_ids, PROBE_MASK), np.float32))))
        dist.destroy_process_group()
    else:
        from rltpu.sampling.engine import SamplerEngine

        positions = None  # the controller's map arrives from the trainers (below: checked equal to theirs)
        shapes = {n: (s, d) for n, s, d in spec}
        eng = SamplerEngine(MCFG, SamplerConfig(max_new_tokens=4, prompt_buckets=[8]), V, 0, 1, shapes)
        positions = json.loads(os.environ["RLTPU_TEST_POSITIONS"])
        tensors, st = receive_staged(fab, spec, 1, 6000, "auto", positions=positions)
        eng.set_params(device_put_params(tensors)[0], 1)
        q.put((rank, (None, positions, st["bytes"], np.asarray(eng.probe_logits(PROBE_TOKENS, pos_ids, PROBE_MASK),
                                                                np.float32))))
    fab.close()


def test_sync_through_torch_tpus_mesh_order_gives_the_trainers_logits(monkeypatch):
    """4 FSDP2 trainers on a ``DeviceMesh`` with torch_tpu's v5e 2x2 ring layout [0, 1, 3, 2] and one JAX
    sampler. The mesh coordinate of ranks 2 and 3 is swapped (what the old check compared and refused),
    but FSDP2 gives each rank the chunk of its shard group's rank; ``mesh_position`` reports the rows a
    rank really holds, the sync places them by it, and the sampler's logits equal the trainer's."""
    from rltpu.sync.stores import free_port

    positions = torch_tpu_positions("v5e", "2x2")
    layout = [positions.index(p) for p in range(4)]  # rank at each mesh position
    assert layout == [0, 1, 3, 2]
    held = list(range(4))  # FSDP2: shard_mesh_rank = shard_process_group.rank(); new_group sorts its ranks
    monkeypatch.setenv("RLTPU_TEST_POSITIONS", json.dumps(held))
    res = spawn_ranks(_permuted_sync_worker, 5, (layout, free_port()), 240, "permuted-mesh sync")
    coords = [res[r][0][0] for r in range(4)]
    assert coords == positions  # the mesh really is permuted: the old rank-vs-coordinate check raised here
    assert [res[r][0][1] for r in range(4)] == held and all(res[r][0][2] for r in range(4))
    assert all(res[r][1] == held for r in range(4))
    t_logits, s_logits = res[0][3], res[4][3]
    mask = PROBE_MASK.astype(bool)
    assert np.abs(t_logits[mask] - s_logits[mask]).max() <= 1e-4
    assert res[4][2] == sum(res[r][2] for r in range(4))


# ---------------------------------------------------------------------------------------------
# (d) Ray's labels of real hosts -> the same chip table


def ray_nodes_of(generation: str, topology: str, chips_per_host: int, monkeypatch, slice_name="my-slice") -> list[dict]:
    """What ``ray.nodes()`` reports for each host of a GKE TPU slice: Ray's own ``TPUAcceleratorManager`` run
    with the env GKE gives each TPU pod (TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_WORKER_ID, TPU_NAME). The one
    thing replaced is the device scan (``/dev/accel*`` / vfio), which this machine cannot show."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager as M

    prefix = {"v5e": "v5litepod", "v6e": "v6e"}[generation]
    total = int(np.prod([int(d) for d in topology.split("x")]))
    monkeypatch.setattr(M, "get_current_node_num_accelerators", staticmethod(lambda: chips_per_host))
    nodes = []
    for w in range(total // chips_per_host):
        for k, v in {"TPU_ACCELERATOR_TYPE": f"{prefix}-{total}", "TPU_TOPOLOGY": topology,
                     "TPU_WORKER_ID": str(w), "TPU_NAME": slice_name}.items():
            monkeypatch.setenv(k, v)
        res = {"TPU": float(M.get_current_node_num_accelerators()), "CPU": 8.0,
               f"accelerator_type:{M.get_current_node_accelerator_type()}": 1.0}
        res |= M.get_current_node_additional_resources() or {}
        nodes.append({"NodeID": f"{w:056x}", "Alive": True, "NodeManagerAddress": f"10.0.0.{w + 1}",
                      "Labels": M.get_current_node_accelerator_labels(), "Resources": res})
    return nodes


@pytest.mark.parametrize("generation,topology,per_host", [("v5e", "2x4", 8), ("v6e", "2x4", 8), ("v5e", "4x4", 4),
                                                          ("v6e", "4x4", 4), ("v5e", "2x2", 4)])
def test_ray_labels_of_real_hosts_give_the_same_chip_table(generation, topology, per_host, monkeypatch):
    from rltpu.chips.topology import emulated_node_spec

    cluster = ClusterConfig(generation=generation, topology=topology)
    nodes = ray_nodes_of(generation, topology, per_host, monkeypatch)
    assert nodes[0]["Labels"]["ray.io/tpu-topology"] == topology  # Ray's own labels, not ours
    real = ChipTable.from_ray_nodes(cluster, nodes)
    assumed = ChipTable.build(cluster, emulated=False)
    assert real.same_layout(assumed) == ""
    assert real.chips_per_host == per_host and len(real.hosts()) == len(nodes)
    # the emulated nodes rltpu starts carry the labels and resources Ray gives real ones
    res, labels = emulated_node_spec(assumed, 0, 0)
    for k in ("ray.io/tpu-worker-id", "ray.io/tpu-topology", "ray.io/tpu-pod-type"):
        assert labels[k] == nodes[0]["Labels"][k], k
    assert set(res) - {assumed.slice_name(0)} == set(nodes[0]["Resources"]) - {"CPU", "my-slice"}


def test_ray_labels_that_disagree_with_the_config_are_one_line(monkeypatch):
    from rltpu.config import ConfigError

    nodes = ray_nodes_of("v6e", "4x4", 4, monkeypatch)
    with pytest.raises(ConfigError, match="cluster.topology=4x4"):  # the config says one 8-chip host
        ChipTable.from_ray_nodes(ClusterConfig(generation="v6e", topology="2x4"), nodes)
    with pytest.raises(ConfigError, match="v6e-16 but cluster.generation='v5e'"):
        ChipTable.from_ray_nodes(ClusterConfig(generation="v5e", topology="4x4"), nodes)
    del nodes[2]  # a host missing from the slice
    with pytest.raises(ConfigError, match=r"workers 0..3, Ray has workers \[0, 1, 3\]"):
        ChipTable.from_ray_nodes(ClusterConfig(generation="v6e", topology="4x4"), nodes)


# ---------------------------------------------------------------------------------------------
# (a) + (c): a trainer process with the env Placement gives it reaches torch_tpu's load(), after its launch env

_TRAINER_CHILD = r"""
import importlib.abc, json, os, sys
seen = {}

class Watch(importlib.abc.MetaPathFinder):  # the env at the moment torch_tpu is first imported
    def find_spec(self, name, path=None, target=None):
        if name == "torch_tpu" and "env" not in seen:
            seen["env"] = dict(os.environ)
        return None

sys.meta_path.insert(0, Watch())
called = []
def prof(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "load" and frame.f_code.co_filename.endswith("torch_tpu/_loader.py"):
        called.append(dict(os.environ))
sys.setprofile(prof)
from actors.trainer_actor import TrainerActor
from rltpu.chips.topology import Chip
args = json.loads(sys.argv[1])
actor = TrainerActor(args["rank"], args["cfg"])
imported_early = "torch_tpu" in sys.modules
chip = Chip(*args["chip"][:4], tuple(args["chip"][4]))
try:
    actor.claim([chip], {"ray_tpu_ids": [chip.index]}, False, args["launch_env"])
    err = None
except Exception as e:
    err = f"{type(e).__name__}: {e}"
sys.setprofile(None)
keys = [k for k in seen.get("env", {}) if k.startswith(("TPU_", "TORCH_TPU_", "RANK", "LOCAL_", "WORLD_", "NODE_RANK"))]
print("RESULT=" + json.dumps({"err": err, "imported_early": imported_early, "load_called": len(called),
                              "env_at_import": {k: seen["env"][k] for k in keys} if "env" in seen else None,
                              "autoload_at_import": seen.get("env", {}).get("TORCH_DEVICE_BACKEND_AUTOLOAD")}))
"""


def test_trainer_with_placements_env_loads_torch_tpu_after_its_launch_env():
    """A trainer actor's process, started with ``actor_env`` (what ``Placement`` passes Ray's runtime_env),
    claims chip 5 of a v6e-8 host as rank 1 of a 4-chip sub-slice on chips 4-7. torch_tpu is first
    imported inside the claim, with the launch env ``launch_env_for_group`` computed (the one
    ``tests/test_launch.py`` compares with ``set_tpu_launch_env``) already set, the chip named in both
    TPU_VISIBLE_CHIPS and TPU_VISIBLE_DEVICES (TorchTPU's source of truth: LOCAL_RANK=1 would otherwise
    open chip 1) and TorchTPU's libtpu build; its ``load()`` runs, finds no device here, and the claim
    fails in one line instead of falling back to CPU."""
    from actors.trainer_actor import TrainerActor
    from rltpu.chips import libtpu
    from rltpu.chips.launch import launch_env_for_group
    from rltpu.config import RunConfig, sections_of
    from rltpu.control.placement import actor_env

    cfg = RunConfig.model_validate({"cluster": {"generation": "v6e", "topology": "2x4", "emulated": False},
                                    "placement": {"sampler_chips": 4, "trainer_chips": 4}})
    table = ChipTable.build(cfg.cluster, emulated=False)
    group = [[c] for c in table.chips[4:]]
    envs = launch_env_for_group("v6e", group, session_id="5", pick_ports=lambda n: list(range(9100, 9100 + n)))
    chip = group[1][0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "TORCH_TPU_", "JAX_PLATFORMS"))}
    env |= actor_env(cfg) | {"PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/", "PYTHONPATH": str(ROOT)}
    arg = {"rank": 1, "cfg": sections_of(cfg, TrainerActor.SECTIONS), "launch_env": envs[1],
           "chip": [chip.global_id, chip.slice, chip.host, chip.index, list(chip.coords)]}
    res = subprocess.run([sys.executable, "-c", _TRAINER_CHILD, json.dumps(arg)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert line, res.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT="):])
    assert out["imported_early"] is False and out["autoload_at_import"] == "0"
    assert out["load_called"] >= 1, "torch_tpu's load() never ran: the tpu device would never be registered"
    at_import = out["env_at_import"]
    assert {k: at_import.get(k) for k in envs[1]} == envs[1]  # the whole launch env, before the first import
    assert envs[1]["LOCAL_RANK"] == "1" and at_import["TPU_VISIBLE_CHIPS"] == at_import["TPU_VISIBLE_DEVICES"] == "5"
    assert at_import["TPU_LIBRARY_PATH"] == libtpu.select("torch_tpu").path
    assert not any(k in at_import for k in ("TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS")), at_import
    assert out["err"] and "ChipUnavailableError" in out["err"] and "torch_tpu found no TPU device" in out["err"]

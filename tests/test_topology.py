"""Chip table, role assignment, libtpu env and Ray node specs: pure data, no Ray."""

import pytest

from rltpu.config import ClusterConfig, ConfigError, PlacementConfig
from rltpu.chips.topology import (
    GENERATION_FACTS,
    ChipConflictError,
    ChipTable,
    Role,
    assign_roles,
    check_disjoint,
    emulated_node_spec,
    libtpu_env,
    local_tpu_present,
    mesh_port,
)


def table(gen="v5e", topo="2x2", slices=1, emulated=True):
    return ChipTable.build(ClusterConfig(generation=gen, topology=topo, slices=slices), emulated=emulated)


def test_generation_facts_cover_config():
    assert set(GENERATION_FACTS) == {"v4", "v5e", "v5p", "v6e", "7x"}
    assert GENERATION_FACTS["7x"].tensorcores_per_chip == 2
    assert GENERATION_FACTS["v5e"].ray_accelerator_type == "TPU-V5LITEPOD"


def test_v5e_2x4_is_one_host_of_8():
    t = table("v5e", "2x4")
    assert t.num_chips == 8 and t.hosts() == [(0, 0)]
    assert [c.index for c in t.chips_on(0, 0)] == list(range(8))
    assert t.chips[0].coords == (0, 0) and t.chips[1].coords == (1, 0) and t.chips[2].coords == (0, 1)
    assert len({c.coords for c in t.chips}) == 8
    assert t.pod_type == "v5litepod-8"


def test_v5e_4x4_is_four_hosts_of_4():
    t = table("v5e", "4x4")
    assert t.num_chips == 16 and t.hosts() == [(0, h) for h in range(4)]
    assert t.chips_per_host == 4
    for s, h in t.hosts():
        chips = t.chips_on(s, h)
        assert [c.index for c in chips] == [0, 1, 2, 3]
        xs = {c.coords[0] // 2 for c in chips}
        ys = {c.coords[1] // 2 for c in chips}
        assert len(xs) == 1 and len(ys) == 1  # each host is one 2x2 block
    assert {c.coords for c in t.chips_on(0, 1)} == {(2, 0), (3, 0), (2, 1), (3, 1)}
    assert t.pod_type == "v5litepod-16"


def test_v4_2x2x2_is_two_hosts():
    t = table("v4", "2x2x2")
    assert t.num_chips == 8 and t.hosts() == [(0, 0), (0, 1)]
    assert {c.coords[2] for c in t.chips_on(0, 0)} == {0}
    assert {c.coords[2] for c in t.chips_on(0, 1)} == {1}
    assert t.pod_type == "v4-16"


def test_multislice_global_ids():
    t = table("v5e", "2x2", slices=3)
    assert t.num_chips == 12
    assert [c.global_id for c in t.chips] == list(range(12))
    assert [c.slice for c in t.chips] == [0] * 4 + [1] * 4 + [2] * 4
    assert t.hosts() == [(0, 0), (1, 0), (2, 0)]
    assert t.slice_name(2) == "rltpu-emu-slice-2"
    assert len(t.to_rows()) == 12 and t.to_rows()[5]["slice_name"] == "rltpu-emu-slice-1"


@pytest.mark.parametrize(
    "gen,topo,pod",
    [("v5e", "2x2", "v5litepod-4"), ("v4", "2x2x1", "v4-8"), ("7x", "2x2x1", "tpu7x-8"),
     ("v5p", "2x2x1", "v5p-8"), ("v6e", "4x4", "v6e-16")],
)
def test_pod_type(gen, topo, pod):
    assert table(gen, topo).pod_type == pod


def test_ray_pod_type_normalises_tpu7x():
    assert table("7x", "2x2x1").ray_pod_type == "v7x-8"


def test_emulated_flag():
    assert ChipTable.build(ClusterConfig()).emulated is (not local_tpu_present())
    real = ChipTable.build(ClusterConfig(emulated=False))
    assert real.emulated is False and real.slice_name(0) == "rltpu-slice-0"


def test_single_chip_7x_and_v5e_hosts():
    assert table("7x", "1x1x1").hosts() == [(0, 0)]
    assert table("v6e", "1x1").chips[0].coords == (0, 0)
    assert table("v5e", "8x8").chips_per_host == 4 and len(table("v5e", "8x8").hosts()) == 16


def test_bad_multihost_topology():
    with pytest.raises(ConfigError, match="multiples"):
        table("v5e", "1x16")


def test_assign_roles_disjoint_and_ordered():
    t = table("v5e", "4x4")
    p = PlacementConfig(sampler_chips=6, trainer_chips=8, chips_per_sampler=2, chips_per_trainer=4)
    roles = assign_roles(t, p)
    assert len(roles[Role.SAMPLER]) == 3 and len(roles[Role.TRAINER]) == 2
    ids = [c.global_id for group in roles.values() for actor in group for c in actor]
    assert len(ids) == len(set(ids)) == 14
    for group in roles.values():
        for actor in group:
            assert len({(c.slice, c.host) for c in actor}) == 1
    assert [c.global_id for c in roles[Role.SAMPLER][0]] == [0, 1]  # samplers first
    assert all(c.host >= 2 for actor in roles[Role.TRAINER] for c in actor)


def test_assign_roles_aligned_blocks():
    t = table("v5e", "2x2")
    roles = assign_roles(t, PlacementConfig(sampler_chips=1, trainer_chips=2, chips_per_trainer=2))
    assert [c.index for c in roles[Role.SAMPLER][0]] == [0]
    assert [c.index for c in roles[Role.TRAINER][0]] == [2, 3]


def test_assign_roles_too_many_chips():
    t = table("v5e", "2x2")
    with pytest.raises(ConfigError) as e:
        assign_roles(t, PlacementConfig(sampler_chips=4, trainer_chips=2))
    msg = str(e.value)
    assert "6 chips" in msg and "sampler_chips=4" in msg and "trainer_chips=2" in msg
    assert "has 4 chips" in msg and "v5e 2x2 x 1 slice" in msg and "\n" not in msg


def test_assign_roles_actor_larger_than_host():
    t = table("v5e", "4x4")
    with pytest.raises(ConfigError, match="chips_per_trainer=8.*4 chips"):
        assign_roles(t, PlacementConfig(sampler_chips=4, trainer_chips=8, chips_per_trainer=8))


@pytest.mark.parametrize("n,bounds", [(1, "1,1,1"), (2, "1,2,1"), (4, "2,2,1")])
def test_libtpu_env(n, bounds):
    chips = table("v5e", "2x4").chips_on(0, 0)[4 : 4 + n]
    env = libtpu_env(chips, "v5e", 8480)
    assert env["TPU_VISIBLE_CHIPS"] == ",".join(str(4 + i) for i in range(n))
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == bounds == env["TPU_CHIPS_PER_HOST_BOUNDS"]
    assert env["TPU_PROCESS_BOUNDS"] == "1,1,1" and env["TPU_HOST_BOUNDS"] == "1,1,1"
    assert env["TPU_MESH_CONTROLLER_ADDRESS"] == "localhost:8480"
    assert env["TPU_MESH_CONTROLLER_PORT"] == "8480"


def test_libtpu_env_7x_and_errors():
    t = table("7x", "2x2x2")
    assert libtpu_env(t.chips_on(0, 0)[:1], "7x", 8476)["TPU_PROCESS_BOUNDS"] == "1,1,1,2"
    with pytest.raises(ValueError, match="several hosts"):
        libtpu_env([t.chips_on(0, 0)[0], t.chips_on(0, 1)[0]], "7x", 8476)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        libtpu_env(t.chips_on(0, 0)[:3], "7x", 8476)


def test_distinct_ports_per_process_on_a_host():
    t = table("v5e", "2x4")
    roles = assign_roles(t, PlacementConfig(sampler_chips=4, trainer_chips=4, chips_per_trainer=2))
    actors = roles[Role.SAMPLER] + roles[Role.TRAINER]
    envs = [libtpu_env(a, "v5e", mesh_port(a)) for a in actors]
    ports = [e["TPU_MESH_CONTROLLER_PORT"] for e in envs]
    assert len(set(ports)) == len(ports) == 6
    visible = [i for e in envs for i in e["TPU_VISIBLE_CHIPS"].split(",")]
    assert sorted(visible, key=int) == [str(i) for i in range(8)]


def test_emulated_node_spec_head_only_on_host_0():
    t = table("v4", "2x2x2")
    r0, l0 = emulated_node_spec(t, 0, 0)
    r1, l1 = emulated_node_spec(t, 0, 1)
    assert r0["TPU"] == 4 and r0["rltpu-emu-slice-0"] == 1 and r0["TPU-v4-16-head"] == 1
    assert r0["accelerator_type:TPU-V4"] == 1
    assert not any(k.endswith("-head") for k in r1)
    assert l1 == {
        "ray.io/tpu-slice-name": "rltpu-emu-slice-0",
        "ray.io/tpu-worker-id": "1",
        "ray.io/tpu-topology": "2x2x2",
        "ray.io/tpu-pod-type": "v4-16",
        "rltpu.io/emulated": "true",
    }
    r7, l7 = emulated_node_spec(table("7x", "2x2x1"), 0, 0)
    assert "TPU-v7x-8-head" in r7 and l7["ray.io/tpu-pod-type"] == "v7x-8"


def _rep(group, rank, pid, node, chips):
    return {"group": group, "rank": rank, "pid": pid, "node_id": node, "chips": chips}


def test_check_disjoint_passes():
    check_disjoint([
        _rep("sampler", 0, 100, "n1", [0, 1]),
        _rep("trainer", 0, 101, "n1", [2, 3]),
        _rep("trainer", 1, 102, "n2", [0, 1]),  # same chip ids on another node are fine
    ])


def test_check_disjoint_chip_overlap():
    with pytest.raises(ChipConflictError) as e:
        check_disjoint([_rep("sampler", 0, 100, "n1", [0, 1]), _rep("trainer", 1, 101, "n1", ["1"])])
    msg = str(e.value)
    assert "chip 1" in msg and "sampler rank 0" in msg and "trainer rank 1" in msg and "\n" not in msg
    assert isinstance(e.value, RuntimeError)


def test_check_disjoint_shared_pid():
    with pytest.raises(ChipConflictError, match="same process"):
        check_disjoint([_rep("sampler", 0, 100, "n1", [0]), _rep("trainer", 0, 100, "n1", [1])])

"""Trainer -> sampler weight sync: the plan and the route by hand, then real gloo processes (no
Ray): sharded round trips over an emulated 2-slice route, handshake refusals, the trainer's peak
memory, a sampler killed mid-sync with a replacement joining the next generation, and logits of a
real FSDP2 trainer against the JAX sampler after sync.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest
import torch
from procs import spawn_ranks

from rltpu.config import ModelConfig
from rltpu.sync.collective import (
    ALIGN_BYTES,
    direct_min_bytes,
    param_spec,
    plan_route,
    plan_stream,
    route_link_bytes,
    shard_rows,
    spec_digest,
)

V = 17  # odd: uneven FSDP shards of the embedding and head (9 + 8 rows)
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
BUCKET_BYTES = 6000  # several messages per stream for the tiny model; direct pieces >= 1500 bytes
PG_TIMEOUT_S = 20.0
JOIN_TIMEOUT_S = 240.0
M = 2  # trainer ranks
SLICES = [0, 0, 0, 1, 1]  # trainers on slice 0; samplers 0 (slice 0), 1 (relay of slice 1), 2 (slice 1)
SLICE_ADDR = ["127.0.0.2", "127.0.0.3"]  # one emulated host per slice, each on its own loopback address


# ---------------------------------------------------------------------------------------------
# the plan and the route


def _covered(spec, n_trainers, bucket, wire="auto"):
    """Per tensor, the element ranges all streams carry, and every message of every stream."""
    got, msgs = {n: [] for n, _, _ in spec}, []
    for r in range(n_trainers):
        for m in plan_stream(spec, n_trainers, r, bucket, wire):
            msgs.append((r, m))
            for pc in m.pieces:
                got[pc.name].append((pc.start, pc.start + pc.numel, r))
    return got, msgs


@pytest.mark.parametrize("wire", ["auto", "bfloat16"])
def test_plan_covers_every_element_once_and_respects_the_bucket(wire):
    spec = param_spec(MCFG, V) + [("extra.big", (40, 64), "bfloat16")]
    got, msgs = _covered(spec, M, BUCKET_BYTES, wire)
    for name, shape, dtype in spec:
        ranges = sorted(got[name])
        assert ranges[0][0] == 0 and ranges[-1][1] == int(np.prod(shape))
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), name  # no gap, no overlap
        row = int(np.prod(shape[1:]))
        for lo, hi, r in ranges:  # a piece never leaves its rank's rows
            r0, r1 = shard_rows(shape[0], M, r)
            assert r0 * row <= lo < hi <= r1 * row
    assert all(m.nbytes <= BUCKET_BYTES for _, m in msgs)
    direct = [m for _, m in msgs if m.direct]
    packed = [m for _, m in msgs if not m.direct]
    assert packed and all(pc.offset % ALIGN_BYTES == 0 for m in packed for pc in m.pieces)
    if wire == "auto":  # big same-dtype pieces skip packing; converted ones never do
        assert direct and all(len(m.pieces) == 1 and m.nbytes >= 1 for m in direct)
    else:
        assert {pc.name for m in direct for pc in m.pieces} == {"extra.big"}
    dtype = {n: d for n, _, d in spec}
    for m in packed:  # the rule: a packed piece of the sampler's dtype is a small shard (or its tail)
        for pc in m.pieces:
            if pc.wire == dtype[pc.name]:
                assert pc.numel * torch.finfo(getattr(torch, pc.wire)).bits // 8 < direct_min_bytes(BUCKET_BYTES)


def test_plan_by_hand():
    spec = [("a", (4, 3), "float32"), ("b", (5,), "float32"), ("c", (16, 8), "float32")]
    bucket = 256  # direct_min = 64 bytes
    assert direct_min_bytes(bucket) == 64
    # rank 0 of 2: a rows [0,2) = 6 elts (24 B < 64: packed at 0), b rows [0,3) = 3 elts packed at 64,
    # c rows [0,8) = 64 elts = 256 B direct, one chunk
    p0 = plan_stream(spec, 2, 0, bucket)
    assert [(m.direct, m.nbytes, [(pc.name, pc.offset, pc.start, pc.numel) for pc in m.pieces]) for m in p0] == [
        (True, 256, [("c", 0, 0, 64)]),
        (False, 128, [("a", 0, 0, 6), ("b", 64, 0, 3)]),
    ]
    # rank 1: b rows [3,5); c rows [8,16) starts at element 64
    p1 = plan_stream(spec, 2, 1, bucket)
    assert [(pc.name, pc.start, pc.numel) for m in p1 for pc in m.pieces] == [
        ("c", 64, 64), ("a", 6, 6), ("b", 3, 2)]
    assert shard_rows(17, 2, 0) == (0, 9) and shard_rows(17, 2, 1) == (9, 17) and shard_rows(1, 2, 1) == (1, 1)
    assert [len(c) for c in torch.arange(17).chunk(2)] == [9, 8]  # FSDP2's torch.chunk semantics


def test_route_crosses_dcn_once_per_destination_slice():
    one = plan_route([0, 0], [0, 0])
    assert one.groups == {"t0": (0, 2, 3), "t1": (1, 2, 3), "ctl": (0, 1, 2, 3)} and not one.forwards
    two = plan_route(SLICES[:M], SLICES[M:])
    assert two.relays == {0: 2, 1: 3}
    assert two.groups["t0"] == (0, 2, 3) and two.groups["f1.0"] == (3, 4)
    assert two.forwards == {3: [(0, "f1.0"), (1, "f1.0")]}
    assert two.recv_from[(4, 0)] == "f1.0" and two.recv_from[(2, 1)] == "t1"
    stream = [1000, 900]
    # one host per slice: slice 1's relay gets both streams over DCN, the rest stays on its host;
    # trainer -> sampler is two runtimes, so nothing is ever counted as ICI
    assert route_link_bytes(two, stream) == {"host": 2 * 1900, "dcn": 1900, "ici": 0}
    assert route_link_bytes(one, stream) == {"host": 2 * 1900, "dcn": 0, "ici": 0}
    # every sampler on its own host: each receive crosses DCN
    assert route_link_bytes(two, stream, hosts=[0, 0, 1, 2, 3])["dcn"] == 3 * 1900
    three = plan_route([0, 1], [0, 1, 1, 2])  # trainers on two slices: each stream crosses to 2 slices
    assert route_link_bytes(three, stream)["dcn"] == 2 * 1900


# ---------------------------------------------------------------------------------------------
# multi-process: sync ranks 0..1 trainers, 2..4 samplers, routed over two emulated slices


def _mixed(spec):
    return [(n, s, "bfloat16" if ".layers.0." in n else d) for n, s, d in spec]


def _full_state(spec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(getattr(torch, d)) for n, s, d in spec}


def _shards(full: dict, rank: int) -> dict:
    return {n: t[slice(*shard_rows(t.shape[0], M, rank))].clone() for n, t in full.items()}


def _big_spec():
    """~8M fp32 parameters: a full gather would need 32 MB on a trainer, the bucket is 1 MB."""
    return [(f"w{i}", (512, 1024), "float32") for i in range(16)]


def _scenarios():
    spec = param_spec(MCFG, V)
    other = param_spec(MCFG.model_copy(update={"intermediate_size": 48}), V)
    # (version sent, trainer spec, wire, {sampler sync rank: (spec, expected version)}, bucket)
    same = lambda v, sp=spec: {p: (sp, v) for p in (2, 3, 4)}
    return [
        ("fp32", 1, spec, "auto", same(1), BUCKET_BYTES),
        ("mixed", 2, _mixed(spec), "auto", same(2, _mixed(spec)), BUCKET_BYTES),
        ("bf16_wire", 3, spec, "bfloat16", same(3), BUCKET_BYTES),
        ("layout", 4, spec, "auto", {2: (spec, 4), 3: (spec, 4), 4: (other, 4)}, BUCKET_BYTES),
        ("version", 5, spec, "auto", {2: (spec, 5), 3: (spec, 6), 4: (spec, 5)}, BUCKET_BYTES),
        ("after_refusals", 6, spec, "auto", same(6), BUCKET_BYTES),
        ("memory", 7, _big_spec(), "bfloat16", same(7, _big_spec()), 2**20),
    ]


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux clear_refs 5), so VmHWM afterwards is the peak of what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(rank: int, world: int, port: int, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from rltpu.sync.collective import (
        SyncFabric,
        WeightSyncError,
        host_store,
        receive_staged,
        send_shards,
    )

    if rank == 0:
        host_store(SLICE_ADDR[0], port, PG_TIMEOUT_S)
    # each emulated slice is one host with its own loopback address; every rank binds its own
    fab = SyncFabric(SLICE_ADDR[0], port, 1, rank, plan_route(SLICES[:M], SLICES[M:]), PG_TIMEOUT_S,
                     bind=SLICE_ADDR[SLICES[rank]])
    events = {}
    for name, version, tspec, wire, recv, bucket in _scenarios():
        t0 = time.perf_counter()
        try:
            if rank < M:
                shards = _shards(_full_state(tspec, version), rank)
                _reset_peak()  # reset the peak: VmHWM := VmRSS
                rss0 = _vm("VmRSS")
                stats = send_shards(fab, shards, tspec, version, bucket, wire)
                events[name] = ("sent", stats | {"peak_extra": _vm("VmHWM") - rss0})
            else:
                rspec, expect = recv[rank]
                tensors, stats = receive_staged(fab, rspec, expect, bucket, wire)
                sent = _full_state(tspec, version)
                exact = all(torch.equal(tensors[n], sent[n].to(getattr(torch, wire if wire != "auto" else d))
                                        .to(tensors[n].dtype)) for n, _, d in rspec)
                aligned = all(t.data_ptr() % ALIGN_BYTES == 0 for t in tensors.values())
                events[name] = ("received", stats | {"exact": exact, "aligned": aligned,
                                                     "dtypes": sorted({str(t.dtype) for t in tensors.values()})})
        except WeightSyncError as e:
            events[name] = ("error", str(e), time.perf_counter() - t0)
    fab.close()
    q.put((rank, events))


@pytest.fixture(scope="module")
def two_slice_run():
    return spawn_ranks(_worker, M + 3, (), JOIN_TIMEOUT_S, "weight sync scenarios")


def test_sharded_round_trip_exact_over_two_slices(two_slice_run):
    res = two_slice_run
    spec = param_spec(MCFG, V)
    for name, sspec in (("fp32", spec), ("mixed", _mixed(spec)), ("bf16_wire", spec)):
        wire = "bfloat16" if name == "bf16_wire" else "auto"
        streams = [sum(m.nbytes for m in plan_stream(sspec, M, r, BUCKET_BYTES, wire)) for r in range(M)]
        for r in range(M):
            kind, st = res[r][name]
            assert kind == "sent" and st["bytes"] == streams[r] and st["buckets"] >= 3, (name, st)
        for p in (2, 3, 4):
            kind, st = res[p][name]
            assert kind == "received", (name, p, st)
            assert st["exact"] and st["aligned"] and st["bytes"] == sum(streams), (name, p)
            assert st["dtypes"] == sorted({str(getattr(torch, d)) for _, _, d in sspec})  # sampler dtype, not wire
        # the route crosses DCN once for slice 1 (its relay), fans out on that host; never ICI
        links = {k: sum(res[p][name][1]["link_bytes"][k] for p in (2, 3, 4)) for k in ("host", "dcn", "ici")}
        assert links == {"dcn": sum(streams), "host": 2 * sum(streams), "ici": 0}
        assert res[3][name][1]["forwarded_streams"] == [0, 1] and res[2][name][1]["forwarded_streams"] == []
    # bf16 on the wire halves the bytes of an fp32 model (alignment aside)
    fp32 = sum(res[p]["fp32"][1]["link_bytes"]["dcn"] for p in (2, 3, 4))
    bf16 = sum(res[p]["bf16_wire"][1]["link_bytes"]["dcn"] for p in (2, 3, 4))
    assert 0.45 < bf16 / fp32 < 0.6


def test_layout_mismatch_is_one_line_on_every_rank_not_a_hang(two_slice_run):
    for p, (kind, msg, secs) in ((p, two_slice_run[p]["layout"]) for p in range(M + 3)):
        assert kind == "error" and secs < PG_TIMEOUT_S / 2, (p, kind, msg)
        assert "\n" not in msg and "sampler 2 (sync rank 4) disagrees with trainer 0" in msg, msg
        assert "first differing tensor 'model.layers.0.mlp.gate_proj.weight'" in msg and "(48, 32)" in msg, msg


def test_version_mismatch_is_refused_everywhere_and_the_fabric_stays_usable(two_slice_run):
    for p in range(M + 3):
        kind, msg, secs = two_slice_run[p]["version"]
        assert kind == "error" and "sampler 1 (sync rank 3)" in msg and "version 6 vs 5" in msg, msg
        assert secs < PG_TIMEOUT_S / 2
        kind, st = two_slice_run[p]["after_refusals"]
        assert kind in ("sent", "received") and (p < M or st["exact"])


def test_trainer_peak_extra_memory_is_at_most_two_buckets(two_slice_run):
    """fp32 shards sent as bf16: every message is converted through the two buffers."""
    for r in range(M):
        kind, st = two_slice_run[r]["memory"]
        assert kind == "sent" and st["buffer_bytes"] == 2 * 2**20
        shard_bytes = sum(int(np.prod(s)) * 4 for _, s, _ in _big_spec()) // M
        assert st["peak_extra"] <= 2 * 2**20 + 256 * 1024, st["peak_extra"]  # 2 buckets + page slack
        assert st["peak_extra"] < shard_bytes / 4  # far below even one gathered shard
    for p in (2, 3, 4):
        assert two_slice_run[p]["memory"][1]["exact"]


# ---------------------------------------------------------------------------------------------
# a sampler dies mid-sync; survivors keep the old version; a replacement joins generation 2


def _fault_worker(rank: int, port: int, replacement: bool, ready, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from rltpu.sync.collective import (
        SyncFabric,
        WeightSyncError,
        host_store,
        receive_staged,
        send_shards,
    )

    spec = param_spec(MCFG, V)
    route = plan_route(SLICES[:M], SLICES[M:])
    victim = 4
    live = None  # (version, tensors): what this sampler serves
    log = []

    def sync(fab, version):
        nonlocal live
        if rank < M:
            send_shards(fab, _shards(_full_state(spec, version), rank), spec, version, BUCKET_BYTES)
            return
        dies = rank == victim and not replacement and version == 2
        die = (lambda r, k: os._exit(3) if k == 2 else None) if dies else None
        tensors, _ = receive_staged(fab, spec, version, BUCKET_BYTES, on_message=die)
        live = (version, tensors)  # the publish: only after the verdict

    if rank == 0:
        host_store("127.0.0.1", port, PG_TIMEOUT_S)
    gen = 2 if replacement else 1
    if gen == 1:
        fab = SyncFabric("127.0.0.1", port, 1, rank, route, PG_TIMEOUT_S)
        sync(fab, 1)
        t0 = time.perf_counter()
        try:
            sync(fab, 2)
            log.append(("v2-gen1", "ok", 0.0))
        except WeightSyncError as e:
            log.append(("v2-gen1", str(e), time.perf_counter() - t0))
            fab.close()
        if rank >= M:
            want = _full_state(spec, 1)
            log.append(("serving", live[0], all(torch.equal(live[1][n], want[n]) for n in want)))
    if replacement:
        ready.set()  # like the controller: rejoin once the replacement is up, not before
    else:
        ready.wait(JOIN_TIMEOUT_S)
    fab = SyncFabric("127.0.0.1", port, 2, rank, route, PG_TIMEOUT_S)
    sync(fab, 2)
    if rank >= M:
        want = _full_state(spec, 2)
        log.append(("after", live[0], all(torch.equal(live[1][n], want[n]) for n in want)))
    fab.close()
    q.put((rank, log))


def test_sampler_killed_mid_sync_survivors_keep_old_version_and_replacement_joins():
    import torch.multiprocessing as mp

    from rltpu.sync.stores import free_port

    ctx = mp.get_context("spawn")
    q, port, ready = ctx.Queue(), free_port(), ctx.Event()
    procs = {r: ctx.Process(target=_fault_worker, args=(r, port, False, ready, q), daemon=True) for r in range(M + 3)}
    for p in procs.values():
        p.start()
    out, repl = {}, None
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        procs[4].join(timeout=JOIN_TIMEOUT_S)
        assert procs[4].exitcode == 3, "the victim should have died mid-sync"
        repl = ctx.Process(target=_fault_worker, args=(4, port, True, ready, q), daemon=True)  # same seat, generation 2
        repl.start()
        while len(out) < M + 3 and time.monotonic() < deadline:
            rank, log = q.get(timeout=max(1.0, deadline - time.monotonic()))
            out[rank] = log
    finally:
        for p in [*procs.values(), repl]:
            if p is not None and p.is_alive():
                p.kill()
    assert sorted(out) == list(range(M + 3)), sorted(out)
    for r in (0, 1, 2, 3):
        what, msg, secs = out[r][0]
        assert what == "v2-gen1" and msg != "ok" and secs < PG_TIMEOUT_S, (r, msg, secs)  # within sync.timeout_s
        assert "weight sync" in msg and "\n" not in msg
    for r in (2, 3):  # survivors still serve version 1, exactly
        assert out[r][1] == ("serving", 1, True)
    for r in (2, 3, 4):  # generation 2, replacement included: version 2 everywhere
        assert out[r][-1] == ("after", 2, True)


# ---------------------------------------------------------------------------------------------
# logits: a real FSDP2 trainer (2 ranks) against the JAX sampler after sync


PROBE_TOKENS = np.array([[3, 5, 7, 2, 9, 4], [6, 6, 1, 8, 0, 0]], np.int64)
PROBE_MASK = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], np.int64)


def _tcp_sockets() -> dict[str, tuple[str, int, int]]:
    """This process's TCP sockets from /proc: inode -> (local IPv4, local port, remote IPv4, remote port, listening)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            (lip, lport), (rip, rport), inode = cols[1].split(":"), cols[2].split(":"), cols[9]
            if inode in inodes:
                ip = lambda h: ".".join(str(b) for b in bytes.fromhex(h)[::-1])  # noqa: E731
                out[inode] = (ip(lip), int(lport, 16), ip(rip), int(rport, 16), cols[3] == "0A")
    return out


def _fabric_addrs(before: dict, store_port: int) -> dict[str, set[str]]:
    """The fabric's gloo sockets (opened since ``before``, the store's excluded): the addresses they
    listen on (what the process published to its peers) and the peers they reached."""
    new = [v for k, v in _tcp_sockets().items() if k not in before and store_port not in (v[1], v[3])]
    return {"listen": {lip for lip, _lp, _rip, _rp, listening in new if listening},
            "peers": {rip for _lip, _lp, rip, _rp, listening in new if not listening}}


def _logits_worker(rank: int, world: int, port: int, wire: str, hosts: str, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["JAX_PLATFORMS"] = "cpu"  # what rltpu.chips.backend sets for an emulated chip
    torch.set_num_threads(1)
    from rltpu.config import BackendConfig, SamplerConfig, TrainerConfig
    from rltpu.chips.runtime import ProcessRuntime
    from rltpu.sync.collective import (
        HostStaging,
        SyncFabric,
        device_put_params,
        host_store,
        local_shards,
        receive_staged,
        send_shards,
    )

    spec = param_spec(MCFG, V)
    pos = np.maximum(np.cumsum(PROBE_MASK, 1) - 1, 0)
    rt = ProcessRuntime("trainer" if rank < M else "sampler", rank, "v5e", BackendConfig(device="cpu"))
    rt.init_process_groups("127.0.0.1", port, world, rank, M, PG_TIMEOUT_S)
    store_port = int(os.environ.get("RLTPU_TEST_SYNC_PORT", "0"))
    # "two": trainers on emulated host 127.0.0.2, the sampler on 127.0.0.3; "one": all on 127.0.0.1
    addr = "127.0.0.1" if hosts == "one" else ("127.0.0.2" if rank < M else "127.0.0.3")
    store_host = "127.0.0.1" if hosts == "one" else "127.0.0.2"
    if rank == 0:
        host_store(store_host, store_port, PG_TIMEOUT_S)
    before = _tcp_sockets()  # the FSDP group's own sockets are not the fabric's
    fab = SyncFabric(store_host, store_port, 1, rank, plan_route([0] * M, [0] * (world - M)), PG_TIMEOUT_S,
                     bind=addr)
    bound = _fabric_addrs(before, store_port)
    if rank < M:
        from torch.distributed.device_mesh import DeviceMesh

        from learner.trainer import TrainerEngine

        eng = TrainerEngine(MCFG, TrainerConfig(), V, 0, mesh=DeviceMesh.from_group(rt.trainer_group, "cpu"),
                            device="cpu")
        if wire == "bfloat16":  # make the weights bf16-exact, so bf16 on the wire loses nothing
            with torch.no_grad():
                for p in eng.model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        shards = local_shards(eng.model, [n for n, _, _ in spec])
        assert any(hasattr(t, "to_local") for t in eng.model.state_dict().values())  # real DTensor shards
        shards, staged = HostStaging().stage(shards)  # the real-chip path; host shards pass through
        st = send_shards(fab, shards, spec, 1, BUCKET_BYTES, wire) | {"staged_bytes": staged, "bound": bound}
        logits = eng.probe_logits(PROBE_TOKENS, pos, PROBE_MASK)
        q.put((rank, (st, np.asarray(logits, np.float32))))
    else:
        from rltpu.sampling.engine import SamplerEngine

        shapes = {n: (s, d) for n, s, d in spec}
        eng = SamplerEngine(MCFG, SamplerConfig(max_new_tokens=4, prompt_buckets=[8]), V, 0, 1, shapes)
        tensors, st = receive_staged(fab, spec, 1, BUCKET_BYTES, wire)
        params, put = device_put_params(tensors)  # the real-chip path: jax.device_put onto its device
        eng.set_params(params, 1)
        st |= {"device_put_bytes": put, "bound": bound}
        q.put((rank, (st, np.asarray(eng.probe_logits(PROBE_TOKENS, pos, PROBE_MASK), np.float32))))
    fab.close()
    rt.shutdown()


@pytest.mark.parametrize("wire,hosts", [("auto", "two"), ("bfloat16", "one")])
def test_sampler_logits_equal_fsdp_trainer_logits_after_sync(wire, hosts, monkeypatch):
    """The real-chip path (host staging, gloo, ``jax.device_put``) on CPU: sampler logits equal the
    FSDP trainer's; each process's gloo sockets bind its own address; bytes are counted on the
    link they took (DCN between the two emulated hosts, host loopback on one; never ICI)."""
    from rltpu.sync.stores import free_port

    monkeypatch.setenv("RLTPU_TEST_SYNC_PORT", str(free_port()))
    res = spawn_ranks(_logits_worker, M + 1, (wire, hosts), JOIN_TIMEOUT_S, f"logits {wire}")
    t_logits = res[0][1]
    np.testing.assert_array_equal(t_logits, res[1][1])  # both FSDP ranks compute the same logits
    s_st, s_logits = res[2]
    mask = PROBE_MASK.astype(bool)
    diff = np.abs(t_logits[mask] - s_logits[mask]).max()
    assert diff <= 1e-4, diff
    sent = res[0][0]["bytes"] + res[1][0]["bytes"]
    assert s_st["bytes"] == sent
    assert res[0][0]["staged_bytes"] == 0  # CPU shards: no device-to-host copy happened, none is reported
    assert s_st["device_put_bytes"] == sum(int(np.prod(sh)) * 4 for _, sh, _ in param_spec(MCFG, V))
    if hosts == "two":  # every process listens on its own address; the trainers reached the sampler there
        assert res[0][0]["bound"]["listen"] == res[1][0]["bound"]["listen"] == {"127.0.0.2"}, res[0][0]["bound"]
        assert s_st["bound"]["listen"] == {"127.0.0.3"}, s_st["bound"]
        assert "127.0.0.2" in s_st["bound"]["peers"]  # the sampler reached the trainers at their own address
        assert s_st["link_bytes"] == {"host": 0, "dcn": sent, "ici": 0}
    else:
        assert s_st["link_bytes"] == {"host": sent, "dcn": 0, "ici": 0}  # one host: no byte is ICI


def test_spec_digest_tracks_the_layout():
    spec = param_spec(MCFG, V)
    assert spec_digest(spec) == spec_digest(param_spec(MCFG, V))
    assert spec_digest(spec) != spec_digest(param_spec(MCFG.model_copy(update={"intermediate_size": 48}), V))


# ---------------------------------------------------------------------------------------------
# a 2 x 2 FSDP x TP trainer group streams its own blocks of rows; samplers get full tensors

TP_MCFG = MCFG.model_copy(update={"attention_bias": True, "attention_out_bias": True, "qk_norm": True})
TP_M, TP = 4, 2  # trainer ranks (dp 2 x tp 2), then 2 samplers


def _tp_sync_worker(rank: int, world: int, port: int, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from rltpu.config import BackendConfig, TrainerConfig
    from rltpu.chips.runtime import ProcessRuntime
    from rltpu.models.torch_llama import init_state_dict
    from rltpu.sync.collective import SyncFabric, WeightSyncError, host_store, local_shards, receive_staged, send_shards

    spec = param_spec(TP_MCFG, V)
    rt = ProcessRuntime("trainer" if rank < TP_M else "sampler", rank, "v5e", BackendConfig(device="cpu"))
    rt.init_process_groups("127.0.0.1", port, world, rank, TP_M, PG_TIMEOUT_S, TP)  # the 2-D mesh's groups too
    store_port = int(os.environ["RLTPU_TEST_SYNC_PORT"])
    if rank == 0:
        host_store("127.0.0.1", store_port, PG_TIMEOUT_S)
    fab = SyncFabric("127.0.0.1", store_port, 1, rank, plan_route([0] * TP_M, [0] * (world - TP_M)), PG_TIMEOUT_S)
    out = {}
    if rank < TP_M:
        from learner.fsdp import trainer_mesh
        from learner.trainer import TrainerEngine

        mesh = trainer_mesh(rt.trainer_group, "cpu", tp=TP, groups=rt.mesh_groups)
        eng = TrainerEngine(TP_MCFG, TrainerConfig(), V, 0, mesh=mesh)
        shards = local_shards(eng.model, [n for n, _, _ in spec], TP, mesh["tp"].get_local_rank())
        out["shard_elems"] = sum(t.numel() for t in shards.values())
        for name, tp in (("mismatch", TP), ("sync", TP)):
            try:
                out[name] = send_shards(fab, shards, spec, 1, BUCKET_BYTES, tp=tp)
            except WeightSyncError as e:
                out[name] = str(e)
    else:
        want = init_state_dict(TP_MCFG, V, 0)  # what every trainer rank was built from (seed 0)
        for name, tp in (("mismatch", 1), ("sync", TP)):  # first a sampler that believes tp=1
            try:
                tensors, st = receive_staged(fab, spec, 1, BUCKET_BYTES, trainer_tp=tp)
                out[name] = st | {"bad": [n for n in want if not torch.equal(tensors[n], want[n])]}
            except WeightSyncError as e:
                out[name] = str(e)
    fab.close()
    rt.shutdown()
    q.put((rank, out))


def test_fsdp_x_tp_trainers_send_their_own_rows_and_samplers_get_exact_full_tensors(monkeypatch):
    from rltpu.sync.collective import trainer_rows
    from rltpu.sync.stores import free_port

    monkeypatch.setenv("RLTPU_TEST_SYNC_PORT", str(free_port()))
    spec = param_spec(TP_MCFG, V)
    # the plan by hand: the 4 streams cover every row of every tensor exactly once
    for name, shape, _ in spec:
        rows = sorted(trainer_rows(name, shape[0], TP_M, r, TP) for r in range(TP_M))
        assert rows[0][0] == 0 and rows[-1][1] == shape[0] and all(a[1] == b[0] for a, b in zip(rows, rows[1:])), name
    assert trainer_rows("model.layers.0.self_attn.q_proj.weight", 32, 4, 1, 2) == (16, 24)  # tp 1's heads, dp 0's half
    assert trainer_rows("model.layers.0.self_attn.o_proj.weight", 32, 4, 1, 2) == (8, 16)  # dp 0's rows, tp 1's half
    assert trainer_rows("model.embed_tokens.weight", 17, 4, 3, 2) == (13, 17)  # dp 1: rows 9..16, tp 1: 13..16

    res = spawn_ranks(_tp_sync_worker, TP_M + 2, (), JOIN_TIMEOUT_S, "fsdp x tp sync")
    total = sum(int(np.prod(s)) for _, s, _ in spec)
    for p in range(TP_M + 2):  # a sampler that does not know the mesh is refused by the handshake
        msg = res[p]["mismatch"]
        assert isinstance(msg, str) and "\n" not in msg and "sampler 0 (sync rank 4) disagrees with trainer 0" in msg
        assert "'4 as dp 2 x tp 2'" in msg, msg
    assert sum(res[r]["shard_elems"] for r in range(TP_M)) == total  # each element on one rank, no gather
    sent = sum(res[r]["sync"]["bytes"] for r in range(TP_M))
    for p in (TP_M, TP_M + 1):
        st = res[p]["sync"]
        assert st["bad"] == [] and st["bytes"] == sent, st  # bit-identical full tensors

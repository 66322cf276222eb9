"""Trainer -> sampler weight sync: the bucket plan by hand, and real 3-process gloo round trips
(no Ray) through ``rltpu.runtime``'s process groups, including the refusal paths.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from rltpu.config import ModelConfig
from rltpu.weight_sync import Bucket, param_spec, plan_buckets, spec_digest
from procs import spawn_ranks

V = 17
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
BUCKET_BYTES = 6000  # several buckets for the tiny model (q_proj alone is 4096 bytes)
PG_TIMEOUT_S = 20.0
JOIN_TIMEOUT_S = 90.0


# ---------------------------------------------------------------------------------------------
# the plan


def test_plan_buckets_by_hand():
    # entries start at 64-byte-aligned offsets: 16 fp32 or 32 bf16 elements
    spec = [
        ("a", (2, 3), "float32"),  # [0, 6)
        ("b", (4,), "float32"),  # [16, 20) -> 80 B <= 128: fits
        ("c", (5,), "float32"),  # would be [32, 37) = 148 B > 128: new bucket, [0, 5)
        ("d", (3,), "float32"),  # [16, 19) -> 76 B
        ("e", (), "float32"),  # scalar, would end at 33 = 132 B: new bucket
        ("f", (4,), "bfloat16"),  # dtype change: new bucket, [0, 4)
        ("g", (4, 5), "bfloat16"),  # [32, 52) -> 104 B: fits
        ("h", (1,), "bfloat16"),  # would end at 65 = 130 B: new bucket
        ("i", (40,), "float32"),  # 160 B, larger than a bucket: its own bucket
        ("j", (2,), "float32"),  # would end at 50 = 200 B: new bucket
    ]
    plan = plan_buckets(spec, 128)
    assert plan == [
        Bucket("float32", (("a", (2, 3), 0, 6), ("b", (4,), 16, 4)), 20),
        Bucket("float32", (("c", (5,), 0, 5), ("d", (3,), 16, 3)), 19),
        Bucket("float32", (("e", (), 0, 1),), 1),
        Bucket("bfloat16", (("f", (4,), 0, 4), ("g", (4, 5), 32, 20)), 52),
        Bucket("bfloat16", (("h", (1,), 0, 1),), 1),
        Bucket("float32", (("i", (40,), 0, 40),), 40),
        Bucket("float32", (("j", (2,), 0, 2),), 2),
    ]
    # one bucket when everything fits; a dtype change still splits it
    assert [len(b.entries) for b in plan_buckets(spec, 10**6)] == [5, 3, 2]


def test_param_spec_and_digest():
    spec = param_spec(MCFG, V)
    from rltpu.models import param_shapes

    assert [(n, s) for n, s, _ in spec] == list(param_shapes(MCFG, V).items())
    assert {d for _, _, d in spec} == {"float32"}
    assert spec_digest(spec) == spec_digest(param_spec(MCFG, V))
    other = param_spec(MCFG.model_copy(update={"intermediate_size": 48}), V)
    assert spec_digest(other) != spec_digest(spec)
    plan = plan_buckets(spec, BUCKET_BYTES)
    assert len(plan) >= 4
    assert sum(n for b in plan for *_, n in b.entries) == sum(int(np.prod(s)) for _, s, _ in spec)
    assert all(off % 16 == 0 for b in plan for _, _, off, _ in b.entries)  # fp32: 64-byte aligned


# ---------------------------------------------------------------------------------------------
# multi-process: rank 0 = trainer (sender), ranks 1..2 = samplers (receivers)


def _mixed_spec(spec):
    """Layer 0 in bf16, the rest fp32: several dtype switches along the plan."""
    return [(n, s, "bfloat16" if ".layers.0." in n else d) for n, s, d in spec]


def _sent_state(spec, seed: int) -> dict[str, torch.Tensor]:
    from rltpu.models.torch_llama import init_state_dict

    sd = init_state_dict(MCFG, V, seed)
    # norms are all ones at init: make them distinct so a mix-up of tensors would show
    gen = torch.Generator().manual_seed(seed + 100)
    sd = {k: v + torch.randn(v.shape, generator=gen) if v.ndim == 1 else v for k, v in sd.items()}
    return {n: sd[n].to(getattr(torch, d)) for n, _s, d in spec}


def _rounds(scenario: str) -> list[tuple[int, list, dict]]:
    """Per sync: (version sent, sender's spec, {sampler rank: (its spec, version it expects)})."""
    spec = param_spec(MCFG, V)
    other = param_spec(MCFG.model_copy(update={"intermediate_size": 48}), V)
    ok = lambda v, sp=spec: {1: (sp, v), 2: (sp, v)}  # noqa: E731
    if scenario == "roundtrip":
        return [(7, spec, ok(7)), (8, _mixed_spec(spec), ok(8, _mixed_spec(spec)))]
    if scenario == "version":  # both samplers refuse, then only one, then a good sync on the same group
        return [(5, spec, ok(6)), (5, spec, {1: (spec, 5), 2: (spec, 4)}), (9, spec, ok(9))]
    if scenario == "layout":
        return [(5, spec, {1: (other, 5), 2: (other, 5)}), (6, spec, ok(6))]
    raise ValueError(scenario)


def _worker(rank: int, world: int, port: int, scenario: str, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from rltpu.config import BackendConfig
    from rltpu.runtime import ProcessRuntime
    from rltpu.weight_sync import count_zero_copy, receive_weights, send_weights, torch_to_jax

    rt = ProcessRuntime("trainer" if rank == 0 else "sampler", rank, "v5e", BackendConfig(device="cpu"))
    events = []
    try:
        rt.init_process_groups("127.0.0.1", port, world, rank, 1, PG_TIMEOUT_S)
        for version, send_spec, recv in _rounds(scenario):
            t0 = time.perf_counter()
            try:
                if rank == 0:
                    stats = send_weights(_sent_state(send_spec, version), send_spec, version, BUCKET_BYTES,
                                         rt.sync_group)
                    events.append(("sent", version, stats, None))
                else:
                    recv_spec, expect = recv[rank]
                    tensors, stats = receive_weights(recv_spec, expect, BUCKET_BYTES, rt.sync_group)
                    params = torch_to_jax(tensors)
                    stats = dict(stats, zero_copy=count_zero_copy(tensors, params), tensors=len(tensors))
                    arrays = {k: (np.asarray(v.astype("float32")), str(v.dtype), tuple(v.shape))
                              for k, v in params.items()}
                    events.append(("received", version, stats, arrays))
            except Exception as e:  # noqa: BLE001 - reported to the parent
                events.append(("error", version, f"{type(e).__name__}: {e}", time.perf_counter() - t0))
        q.put((rank, events))
    except Exception as e:  # noqa: BLE001
        q.put((rank, events + [("fatal", -1, f"{type(e).__name__}: {e}", None)]))
    finally:
        rt.shutdown()


def _run(scenario: str, world: int = 3) -> dict[int, list]:
    results = spawn_ranks(_worker, world, (scenario,), JOIN_TIMEOUT_S, scenario)
    return results


def _check_received(events: list, version: int, sspec) -> None:
    plan = plan_buckets(sspec, BUCKET_BYTES)
    sent = _sent_state(sspec, version)
    nbytes = _wire_bytes(plan)
    (kind, v, stats, arrays), = [e for e in events if e[1] == version]
    assert kind == "received", stats
    assert stats["version"] == version and stats["buckets"] == len(plan) and stats["bytes"] == nbytes
    if all(d == "float32" for _, _, d in sspec):  # aligned views of the flat buffer: JAX makes no copy
        assert stats["zero_copy"] == stats["tensors"] == len(sspec)
    assert list(arrays) == [n for n, _, _ in sspec]
    for name, _shape, dtype in sspec:
        got, jdtype, jshape = arrays[name]
        assert jdtype == dtype and jshape == tuple(sent[name].shape)
        np.testing.assert_array_equal(got, sent[name].float().numpy(), err_msg=name)


def _wire_bytes(plan) -> int:
    """Bytes on the wire: whole flat buckets, alignment gaps included."""
    return sum(b.numel * (2 if b.dtype == "bfloat16" else 4) for b in plan)


def test_round_trip_three_processes_exact():
    res = _run("roundtrip")
    spec = param_spec(MCFG, V)
    assert any(d == "bfloat16" for _, _, d in _mixed_spec(spec))
    for version, sspec in ((7, spec), (8, _mixed_spec(spec))):
        plan = plan_buckets(sspec, BUCKET_BYTES)
        nbytes = _wire_bytes(plan)
        payload = sum(t.numel() * t.element_size() for t in _sent_state(sspec, version).values())
        assert payload <= nbytes < payload * 1.1  # alignment padding is small
        (kind, v, stats, _), = [e for e in res[0] if e[1] == version]
        assert (kind, v) == ("sent", version)
        assert stats["buckets"] == len(plan) >= 4 and stats["bytes"] == nbytes
        for rank in (1, 2):
            _check_received(res[rank], version, sspec)


def _errors(events: list) -> list[tuple[int, str, float]]:
    return [(v, msg, secs) for kind, v, msg, secs in events if kind == "error"]


def test_version_mismatch_is_refused_on_every_side_and_the_group_stays_usable():
    res = _run("version")
    # sync 1: both samplers expected 6, the trainer sent 5
    for rank, expected in ((1, 6), (2, 6)):
        v, msg, _ = _errors(res[rank])[0]
        assert v == 5 and msg.startswith("RuntimeError") and "version 5" in msg and f"expected {expected}" in msg
    # sync 2: only sampler 2 refuses (expects 4); sampler 1 must not keep waiting for buckets
    v, msg, _ = _errors(res[2])[1]
    assert v == 5 and "version 5" in msg and "expected 4" in msg
    v, msg, _ = _errors(res[1])[1]
    assert v == 5 and msg.startswith("RuntimeError") and "another sampler refused" in msg
    # the trainer is told at once (not after the process-group timeout), with the reason
    errs = _errors(res[0])
    assert [v for v, _, _ in errs] == [5, 5]
    for _v, msg, secs in errs:
        assert msg.startswith("RuntimeError") and "refused" in msg and "version 5" in msg, msg
        assert secs < PG_TIMEOUT_S / 2
    # sync 3 on the same group: every byte arrives
    assert [e[0] for e in res[0]] == ["error", "error", "sent"]
    for rank in (1, 2):
        _check_received(res[rank], 9, param_spec(MCFG, V))


def test_layout_mismatch_is_refused_on_every_side_and_the_group_stays_usable():
    res = _run("layout")
    for rank in (1, 2):
        (v, msg, _), = _errors(res[rank])
        assert v == 5 and msg.startswith("RuntimeError")
        assert "layout" in msg and "model configs disagree" in msg
    (v, msg, secs), = _errors(res[0])
    assert v == 5 and msg.startswith("RuntimeError") and "layout" in msg and secs < PG_TIMEOUT_S / 2, msg
    for rank in (1, 2):
        _check_received(res[rank], 6, param_spec(MCFG, V))

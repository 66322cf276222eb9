"""Issue 19 (preemption-safe, secure by default, bounded), the parts that need no Ray cluster:
the handshake wire is JSON (a malicious pickle is never deserialised), bounded in-memory history,
torn-tail-tolerant readers, the progress display off a terminal, the dashboard's Host check,
status of a finished run, and one-line errors from a failing reward function."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rltpu.sync import collective
from rltpu.sync.collective import Route, WeightSyncError, handshake


class _Boom:
    """Deserialising this runs code: it creates a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _FakeFabric:
    """A two-member 'ctl' group whose peer (sync rank 1) sends ``peer_details`` raw bytes."""

    def __init__(self, peer_details: bytes):
        self.route = Route(n_trainers=1, slices=[0, 0])
        self.peer = peer_details

    def allgather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        if what == "the handshake":  # the peer's digest differs: the details exchange follows
            return [t.clone(), t.clone() + 1]
        if t.dtype == torch.int64:  # the sizes
            return [t.clone(), torch.tensor([len(self.peer)], dtype=torch.int64)]
        peer = torch.zeros_like(t) if len(t) >= len(self.peer) else torch.zeros(len(self.peer), dtype=torch.uint8)
        peer[: len(self.peer)] = torch.frombuffer(bytearray(self.peer), dtype=torch.uint8)
        return [t.clone(), peer]


SPEC = [("embed.weight", (8, 4), "float32"), ("head.weight", (8, 4), "float32")]


def test_handshake_never_unpickles_peer_bytes(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Boom(str(marker)))
    with pytest.raises(WeightSyncError) as err:
        handshake(_FakeFabric(payload), 3, SPEC, 1 << 20, "float32")
    assert not marker.exists(), "the peer's pickle was deserialised"
    assert "sampler 0 (sync rank 1) disagrees with trainer 0" in str(err.value)
    assert "unreadable handshake details" in str(err.value) and "\n" not in str(err.value)
    pickle.loads(payload)  # the payload is live: unpickling it really would have run code
    assert marker.exists()
    assert "pickle" not in Path(collective.__file__).read_text().split('"""', 2)[2].replace(
        "never pickle", "")


def test_handshake_details_are_json_and_name_the_difference():
    peer = json.dumps([3, 1, 1 << 20, "float32", [["embed.weight", [8, 4], "float32"],
                                                   ["head.weight", [8, 5], "float32"]]]).encode()
    with pytest.raises(WeightSyncError, match=r"first differing tensor 'head.weight': head.weight \(8, 5\)"):
        handshake(_FakeFabric(peer), 3, SPEC, 1 << 20, "float32")

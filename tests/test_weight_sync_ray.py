"""Weight sync through the real CLI on an emulated 2-slice cluster: one Ray node per emulated host
(labels and resources as on TPU VMs), a sampler on each slice, trainers on slice 0. The route must
cross DCN exactly once (to slice 1's relay) per sync, and sampler logits must equal the trainer's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import SMALL_BATCH

from rltpu.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
pytestmark = pytest.mark.slow


def test_two_slice_emulated_cluster_crosses_dcn_once_per_destination_slice(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "quickstart.yaml"), f"run_dir={run_dir}",
           "progress=false", "cluster.slices=2", "placement.sampler_chip_ids=[0,4]", "placement.trainer_chip_ids=[1,2]",
           "trainer.steps=3", "sync.verify_every=1", "sync.bucket_mb=0.05", *SMALL_BATCH]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["cluster"]["nodes"] == 2  # one Ray node per emulated host (2 slices x 1 host)
    nodes = {a["group"] + str(a["rank"]): a["node_id"] for a in placement["actors"]}
    assert nodes["sampler0"] == nodes["trainer0"] == nodes["trainer1"] != nodes["sampler1"]
    m = read_metrics(run_dir / "metrics.jsonl")
    assert len(m) == 3
    for r in m:
        # one model copy (both trainer streams) per sync: slice 1 gets it once over DCN; slice 0's
        # sampler gets it through host memory on its own node (trainer and sampler are two runtimes:
        # no byte is ICI); slice 1 has no second sampler to fan out to
        assert r["sync_dcn_bytes"] == r["sync_bytes"] > 0
        assert r["sync_ici_bytes"] == 0
        assert r["sampler_weight_versions"] == [r["weight_version"]] * 2
        assert r["sync_probe_max_diff"] <= 1e-4

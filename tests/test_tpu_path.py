"""`rltpu train` on chips it claims are real (issue 15): a placement TorchTPU cannot run, or a host
that cannot open the chips, is one line on stderr and exit 2 before Ray or any actor starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
           PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/")


def _train(tmp_path, *overrides) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
           f"run_dir={tmp_path / 'run'}", "progress=false", "cluster.emulated=false", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _one_line(res) -> str:
    """rltpu's own output is one line, the last; importing torch_tpu may print libtpu's two C++ log
    lines before it (absl's "All log messages before ..." and pjrt_api.cc's "GetPjrtApi was found")."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr[-2000:]
    ours = [ln for ln in lines if ln.startswith("rltpu")]
    foreign = [ln for ln in lines if not ln.startswith("rltpu")]
    assert len(ours) == 1 and lines[-1] == ours[0] and ours[0].startswith("rltpu: error: "), res.stderr[-2000:]
    assert all("absl::InitializeLog" in ln or "pjrt_api.cc" in ln for ln in foreign), foreign
    assert "Traceback" not in res.stderr
    return ours[0]


def test_real_chip_without_a_device_is_exit_2_before_anything_starts(tmp_path):
    pytest.importorskip("torch_tpu")
    # 4 trainers on the v5e 2x2 host is a placement TorchTPU runs; this machine has no TPU to open
    line = _one_line(_train(tmp_path, "cluster.topology=2x4", "placement.sampler_chips=4",
                            "placement.trainer_chips=4"))
    assert "trainer claimed real TPU chips but torch_tpu found no TPU device" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "placement.json").exists()


@pytest.mark.parametrize("overrides,why", [
    ((), "2 trainer chips on one v5e host"),  # quickstart: 2 samplers + 2 trainers
    (("placement.mode=colocated",), "colocated on real TPU chips"),
])
def test_placements_torchtpu_cannot_run_are_refused(tmp_path, overrides, why):
    assert why in _one_line(_train(tmp_path, *overrides))


def test_docs_tpu_manifest_requests_the_tpu_resources_of_its_slice():
    """docs/tpu.md's KubeRay manifest asks GKE for the slice of the config it says it runs:
    google.com/tpu chips per host, the node selectors Ray's TPU docs name, and one worker per host."""
    from rltpu.chips.topology import GENERATION_FACTS, ChipTable
    from rltpu.config import load_config

    text = (ROOT / "docs" / "tpu.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    doc = yaml.safe_load(block)
    assert doc["kind"] == "RayCluster" and doc["apiVersion"].startswith("ray.io/")
    cfg_path = doc["metadata"]["annotations"]["rltpu.io/config"]
    assert f"rltpu train {cfg_path}" in text
    cfg = load_config(str(ROOT / cfg_path), [])
    table = ChipTable.build(cfg.cluster, emulated=False)
    accel = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "v5p": "tpu-v5p-slice", "v4": "tpu-v4-podslice",
             "7x": "tpu7x"}[cfg.cluster.generation]
    (group,) = doc["spec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accel,
                                   "cloud.google.com/gke-tpu-topology": cfg.cluster.topology}
    (container,) = pod["containers"]
    per_host = table.chips_per_host
    for kind in ("requests", "limits"):
        assert int(container["resources"][kind]["google.com/tpu"]) == per_host
    assert group["numOfHosts"] == len(table.hosts()) // cfg.cluster.slices
    assert group["replicas"] == cfg.cluster.slices
    assert GENERATION_FACTS[cfg.cluster.generation]  # a generation rltpu knows
    assert "rltpu[tpu]" in text or ".[tpu]" in text


def test_planner_marks_what_torchtpu_cannot_run_infeasible():
    """Planning the real v5e 2x4 host: colocated and 2- or 3-chip trainer groups are not runnable,
    with the backend's reason apart from memory (a trainer TP block is one process per chip, so it
    counts its chips); the configured 4+4 split fits and runs."""
    from rltpu.config import load_config
    from rltpu.plan.planner import make_plan

    plan = make_plan(load_config(str(ROOT / "configs" / "tpu_v5e_2x4.yaml"), []), hardware="v5e")
    by_mode = {}
    for c in plan.candidates:
        by_mode.setdefault(c.mode, []).append(c)
    assert all(not c.runnable and "colocated on real TPU chips" in c.backend_refusal for c in by_mode["colocated"])
    for c in by_mode["disaggregated"]:
        if c.trainer_chips not in (1, 4, 8):
            assert not c.runnable and "real TPU trainer group" in c.backend_refusal, (c.name, c.backend_refusal)
    assert plan.as_configured.feasible and plan.as_configured.runnable, plan.as_configured.not_runnable


def test_status_names_what_each_actor_computes_on():
    """`rltpu status` shows each actor's device and backend from its own claim, and a heartbeat
    (which reports without arguments) keeps the claim's emulated flag."""
    from rltpu.chips.backend import Decision
    from rltpu.chips.runtime import ProcessRuntime
    from rltpu.config import BackendConfig
    from rltpu.observe.health import actor_rows, format_status

    rt = ProcessRuntime("trainer", 0, "v5e", BackendConfig())
    rt.decision = Decision("trainer", False, "tpu", "tpu", "tpu", "torch_tpu")
    rt.backend_info = {"device": "tpu", "dist_backend": "tpu", "runtime": "torch_tpu", "jax_platforms": "tpu"}
    real = rt.report()
    assert real["emulated"] is False and real["device"] == "tpu"
    emu = dict(real, group="sampler", emulated=True, device="cpu", dist_backend="gloo", runtime="cpu",
               jax_platforms="cpu")
    now = 1000.0
    beat = {"time": now, "phase_since": now, "last_progress": now, "chip_ids": [0], "phase": "idle"}
    rows = actor_rows({"trainer-0": real | beat, "sampler-0": emu | beat}, ["trainer-0", "sampler-0"], {}, {}, now)
    text = format_status({"actors": rows, "state": "running", "time": now}, now)
    lines = text.splitlines()
    assert "device" in lines[1].split()
    assert "tpu/tpu" in lines[2] and "emulated" not in lines[2]
    assert "cpu/gloo (emulated)" in lines[3]

"""``rltpu doctor`` (issue 29): passes on this machine's emulated chips; on the label sets and reports of real
hosts (v5e-8, v6e-8, a v5e 4x4 slice) it passes, and each broken case is named in one line with its fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_tpu_fidelity import ray_nodes_of

from rltpu.chips import libtpu
from rltpu.control import doctor
from rltpu.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("torch_tpu", reason="the tpu extra (make setup installs it)")

JAX_OK = libtpu.Build("0.0.42.1", "/opt/libtpu-jax/libtpu/libtpu.so", "side")
TORCH_OK = libtpu.Build("0.0.52", "/opt/site-packages/libtpu/libtpu.so", "package")
SPECS = {"jax": "==0.0.42.*", "torch_tpu": ">=0.0.50"}  # what jax 0.10.2's tpu extra and torch-tpu 0.2.0 declare


def cfg_of(generation: str, topology: str, sampler_chips: int, trainer_chips: int) -> RunConfig:
    return RunConfig.model_validate({"cluster": {"generation": generation, "topology": topology, "emulated": False},
                                     "placement": {"sampler_chips": sampler_chips, "trainer_chips": trainer_chips}})


def test_the_pins_are_read_from_the_installed_packages():
    assert {r: libtpu.requirement(r) for r in SPECS} == SPECS


REAL_HOSTS = [("v5e", "2x4", 8, 4, 4), ("v6e", "2x4", 8, 4, 4), ("v5e", "4x4", 4, 8, 8)]


@pytest.mark.parametrize("gen,topo,per_host,s,t", REAL_HOSTS)
def test_real_hosts_pass(gen, topo, per_host, s, t, monkeypatch):
    cfg = cfg_of(gen, topo, s, t)
    checks = doctor.judge_cluster(cfg, ray_nodes_of(gen, topo, per_host, monkeypatch), emulated=False)
    checks.append(doctor.judge_trainer_group(cfg, emulated=False))
    checks += doctor.judge_libtpu([TORCH_OK, JAX_OK], emulated=False, specs=SPECS)
    checks.append(doctor.judge_torch_tpu({"version": "torch-tpu 0.2.0", "load_called": True, "pci_devices": per_host,
                                          "devices": 1}, emulated=False))
    checks.append(doctor.judge_jax({"version": "jax 0.10.2", "devices": 1, "platform": "tpu"}, False, 1))
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    assert f"of {per_host} chips (from Ray's labels)" in checks[1].detail


def test_autoload_off_and_never_loaded_is_named():
    c = doctor.judge_torch_tpu({"version": "torch-tpu 0.2.0", "load_called": False, "pci_devices": 8, "devices": 0},
                               emulated=False)
    assert not c.ok and "load() never ran" in c.line() and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in c.line()
    assert "\n" not in c.line()


def test_a_libtpu_build_jax_does_not_accept_is_named():
    checks = doctor.judge_libtpu([TORCH_OK], emulated=False, specs=SPECS)  # only torch-tpu's build installed
    bad = [c for c in checks if not c.ok]
    assert [c.name for c in bad] == ["libtpu/jax"]
    assert "jax needs libtpu==0.0.42.* but the installed builds are 0.0.52 (package)" in bad[0].line()
    assert "make tpu-libtpu" in bad[0].line()
    # the reverse: a single old build serves JAX but not TorchTPU
    checks = doctor.judge_libtpu([JAX_OK], emulated=False, specs=SPECS)
    assert [c.name for c in checks if not c.ok] == ["libtpu/torch_tpu"]


def test_a_two_chip_v6e_trainer_group_is_named(monkeypatch):
    cfg = cfg_of("v6e", "2x4", 4, 2)
    c = doctor.judge_trainer_group(cfg, emulated=False)
    assert not c.ok and "2 trainer chips on one v6e host" in c.line() and "[1, 4, 8]" in c.line()
    assert doctor.judge_trainer_group(cfg, emulated=True).ok  # emulated chips: a note, not a failure


def test_labels_of_another_slice_are_named(monkeypatch):
    cfg = cfg_of("v5e", "2x4", 4, 4)
    checks = doctor.judge_cluster(cfg, ray_nodes_of("v5e", "4x4", 4, monkeypatch), emulated=False)
    bad = [c for c in checks if not c.ok]
    assert [c.name for c in bad] == ["slice"] and "4x4 slice but cluster.topology='2x4'" in bad[0].line()
    assert not doctor.judge_cluster(cfg, [], emulated=False)[0].ok  # no TPU node at all


def test_doctor_passes_on_this_machines_emulated_chips(tmp_path):
    """The command a user runs first, here: every check passes on emulated chips (exit 0), one line each,
    every line naming its check. Ray's token auth stays on (the default for a new local cluster)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env |= {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/"}
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "doctor", "configs/quickstart.yaml",
                          f"run_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    names = [ln[5:].split()[0] for ln in lines]
    for want in ("ray", "slice", "trainer", "libtpu/torch_tpu", "libtpu/jax", "torch_tpu", "jax", "ports", "run", "time"):
        assert want in names, (want, lines)
    assert all(ln.startswith("ok   ") for ln in lines), lines
    assert "(emulated)" in lines[0] and "load() ran" in res.stdout


def test_a_child_that_timed_out_is_not_called_a_missing_package():
    slow = {"error": "timed out after 120 s", "timed_out": True}
    for check in (doctor.judge_torch_tpu(slow, True), doctor.judge_jax(slow, True, 1)):
        assert not check.ok and "busy" in check.fix and "install" not in check.fix, check
    missing = doctor.judge_torch_tpu({"error": "exit 1: No module named 'torch_tpu'"}, True)
    assert "pip install" in missing.fix

"""``rltpu doctor``: the preflight a user runs first on a TPU VM or a KubeRay cluster.

One line per check, the fix on the line of a check that fails. Gathering (Ray, child processes that
load TorchTPU and JAX with the env rltpu's actors get) is kept apart from judging (pure functions of
what was gathered), so tests feed the judges the label sets and reports of real hosts and of the
broken cases (TorchTPU's loader never run, a libtpu build a runtime does not accept, a trainer group
TorchTPU cannot form) without a TPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rltpu.chips import libtpu
from rltpu.chips.launch import BASE_PORT, MASTER_PORT, base_port, torchtpu_host_problems
from rltpu.chips.topology import DEFAULT_MESH_PORT, ChipTable, Role, assign_roles, trainer_processes
from rltpu.config import ConfigError


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        return f"{mark} {self.name:<14} {self.detail}" + ("" if self.ok or not self.fix else f" -> {self.fix}")


# ---------------------------------------------------------------------------------------------
# judges: pure functions of what was gathered


def judge_cluster(cfg, nodes: list[dict], emulated: bool) -> list[Check]:
    """Ray's TPU resources and labels against the config: hosts, chips per host, slice shape."""
    tpu = [n for n in nodes if n.get("Alive", True) and float(n.get("Resources", {}).get("TPU", 0)) > 0]
    chips = int(sum(float(n["Resources"]["TPU"]) for n in tpu))
    out = [Check("ray", bool(tpu), f"{len(nodes)} node(s), {len(tpu)} with TPU chips, {chips} chips"
                 f"{' (emulated)' if emulated else ''}", "start Ray on the TPU hosts (ray start ... on each VM) "
                 "or use KubeRay's TPU worker group (docs/tpu.md)")]
    if not tpu:
        return out
    try:
        real = ChipTable.from_ray_nodes(cfg.cluster, nodes)
    except ConfigError as e:
        return out + [Check("slice", False, str(e).split(";")[0], str(e).split(";", 1)[-1].strip())]
    want = ChipTable.build(cfg.cluster, emulated=emulated)
    diff = want.same_layout(real)
    shape = (f"{cfg.cluster.generation} {cfg.cluster.topology} x {cfg.cluster.slices}: {len(real.hosts())} host(s) "
             f"of {real.chips_per_host} chips (from Ray's labels)")
    out.append(Check("slice", not diff, shape if not diff else f"labels disagree with the config: {diff}",
                     "set cluster.topology / generation / slices to what the labels say"))
    return out


def judge_trainer_group(cfg, emulated: bool) -> Check:
    """A trainer group TorchTPU cannot form (sub-slice sizes, whole hosts) is refused before anything runs."""
    table = ChipTable.build(cfg.cluster, emulated=emulated)
    try:
        roles = assign_roles(table, cfg.placement)
    except ConfigError as e:
        return Check("placement", False, str(e), "change placement.*")
    group = trainer_processes(roles[Role.TRAINER])
    per_host: dict = {}
    for chips in group:
        for c in chips:
            per_host[(c.slice, c.host)] = per_host.get((c.slice, c.host), 0) + 1
    problems = torchtpu_host_problems(cfg.cluster.generation, per_host, table.chips_per_host)
    what = f"{len(group)} trainer rank(s) on {len(per_host)} host(s)"
    if emulated:
        return Check("trainer group", True, f"{what} (emulated: TorchTPU's limits apply on real chips"
                     + (f", where: {problems[0]}" if problems else "") + ")")
    return Check("trainer group", not problems, what if not problems else problems[0],
                 "set placement.trainer_chips to a size TorchTPU runs (docs/tpu.md)")


# a child that did not finish is not a missing package: the host is busy, or the import hangs
SLOW_CHILD = "rerun when the host is less busy; if it hangs again, run the import by hand to see where it stops"


def judge_torch_tpu(report: dict, emulated: bool) -> Check:
    """The child that loaded TorchTPU with a trainer's env: its loader ran, and it saw the chip (real)."""
    if report.get("error"):
        return Check("torch_tpu", False, report["error"], SLOW_CHILD if report.get("timed_out") else
                     "pip install 'rltpu[tpu]' (torch-tpu 0.2.x for torch 2.13)")
    if not report.get("load_called"):
        return Check("torch_tpu", False, "TorchTPU's load() never ran (TORCH_DEVICE_BACKEND_AUTOLOAD=0 and nothing "
                     "called it): the tpu device and process-group backends are not registered",
                     "let rltpu.chips.backend.load_torch_tpu load it (do not import torch_tpu before the claim)")
    pci, dev = report.get("pci_devices", 0), report.get("devices", 0)
    if emulated:
        return Check("torch_tpu", True, f"{report.get('version')} loads; load() ran and found {pci} TPU device(s) "
                     "on the PCI bus (emulated chips: none expected)")
    ok = pci > 0 and dev >= 1
    return Check("torch_tpu", ok, f"{report.get('version')}: load() ran, {pci} TPU device(s) on this host, a trainer "
                 f"process sees {dev}", "is another process holding the chips? (sudo lsof -w /dev/vfio/*)")


def judge_jax(report: dict, emulated: bool, want: int) -> Check:
    """The child that started JAX with a sampler's env sees the devices the sampler should."""
    if report.get("error"):
        return Check("jax", False, report["error"], SLOW_CHILD if report.get("timed_out") else
                     "make tpu-libtpu, and check JAX_PLATFORMS")
    got, plat = report.get("devices", 0), report.get("platform")
    want_plat = "cpu" if emulated else "tpu"
    ok = got == want and plat == want_plat
    return Check("jax", ok, f"{report.get('version')} sees {got} {plat} device(s), a sampler should see {want} "
                 f"{want_plat}", "check TPU_VISIBLE_CHIPS and that no other process holds the chips")


def judge_libtpu(builds: list[libtpu.Build], emulated: bool, specs: dict[str, str | None] | None = None) -> list[Check]:
    """The libtpu build each runtime loads, and whether its package accepts it."""
    out = []
    for runtime in ("torch_tpu", "jax"):
        spec = (specs or {}).get(runtime, libtpu.requirement(runtime))
        try:
            b = libtpu.select(runtime, builds, spec)
            out.append(Check(f"libtpu/{runtime}", True, f"{b.version} ({b.where}: {b.path}) satisfies libtpu{spec}"))
        except libtpu.LibtpuError as e:
            msg, fix = str(e).split("; run ", 1) if "; run " in str(e) else (str(e), "")
            out.append(Check(f"libtpu/{runtime}", emulated, msg + (" (emulated chips load no libtpu)" if emulated
                                                                  else ""), "run " + fix))
    return out


def judge_ports(busy: dict[int, str]) -> Check:
    return Check("ports", not busy, "free: " + ("all" if not busy else ", ".join(f"{p} ({w})" for p, w in busy.items())),
                 "stop what holds them, or set TORCH_TPU_BASE_PORT for the slice-builder ports")


# ---------------------------------------------------------------------------------------------
# gathering

_CHILD_TORCH = r"""
import json, os, sys, warnings
warnings.filterwarnings("ignore")
called = []
def prof(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "load" and frame.f_code.co_filename.endswith("torch_tpu/_loader.py"):
        called.append(1)
import torch
out = {"import_before_claim": "torch_tpu" in sys.modules}
sys.setprofile(prof)
try:
    from rltpu.chips import backend
    out["probe"] = backend.probe_torch_tpu()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
sys.setprofile(None)
out["load_called"] = bool(called)
try:
    import importlib.metadata as md
    from torch_tpu._internal.utils import hardware
    out["version"] = "torch-tpu " + md.version("torch-tpu")
    out["pci_devices"] = hardware.get_tpu_device_count()
    acc = torch.accelerator.current_accelerator()
    out["devices"] = torch.accelerator.device_count() if acc is not None and acc.type == "tpu" else 0
except Exception as e:
    out.setdefault("error", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
print("RESULT=" + json.dumps(out))
"""

_CHILD_JAX = r"""
import json
out = {}
try:
    import jax
    out["version"] = "jax " + jax.__version__
    d = jax.devices()
    out["devices"], out["platform"] = len(d), d[0].platform
except Exception as e:
    out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
print("RESULT=" + json.dumps(out))
"""


def probe_trainer_chip(cfg) -> str | None:
    """What stops a trainer process on this host from opening a real chip (None: nothing), found in a child
    started with a trainer's env: the driver itself must not load TorchTPU (it owns no chip)."""
    rep = _child(_CHILD_TORCH, child_env(cfg, "trainer", False, strict=True))
    return rep.get("error") or rep.get("probe")


def _child(code: str, env: dict, timeout: float = 120) -> dict:
    try:
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                             cwd=str(Path(__file__).resolve().parents[2]))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "timed_out": True}
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    if not line:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {res.returncode}: {tail[:200]}"}
    return json.loads(line[-1][len("RESULT="):])


def child_env(cfg, role: str, emulated: bool, strict: bool = False) -> dict[str, str]:
    """The env an actor of ``role`` has when it loads its runtime: Ray's worker env + ``actor_env`` + the claim's.
    ``strict``: a libtpu build the runtime does not accept raises (ChipUnavailableError) instead of being
    left to the libtpu check."""
    from rltpu.chips.runtime import process_env
    from rltpu.control.placement import actor_env

    table = ChipTable.build(cfg.cluster, emulated=emulated)
    chips = table.chips_on(0, 0)[: (cfg.placement.chips_per_sampler if role == "sampler" else 1)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "TORCH_TPU_", "JAX_PLATFORMS"))}
    env |= actor_env(cfg) | {"PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/", "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:
        env |= process_env(chips, cfg.cluster.generation, role, emulated)
    except Exception:  # noqa: BLE001 - the libtpu check names it; load with the package's build meanwhile
        if strict:
            raise
    if role == "sampler":
        env["JAX_PLATFORMS"] = "cpu" if emulated else "tpu"
        if emulated:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={len(chips)}"
    return env


def busy_ports(cfg, table: ChipTable) -> dict[int, str]:
    """The fixed ports rltpu's launch env uses on a TPU host that something already listens on."""
    want = {DEFAULT_MESH_PORT + i: "libtpu mesh controller" for i in range(table.chips_per_host)}
    if len(table.hosts()) > 1:
        first = base_port()
        want |= {first + i: "slice builder" for i in range(table.chips_per_host)} | {int(MASTER_PORT): "MASTER_PORT"}
    out = {}
    for port, what in sorted(want.items()):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                out[port] = what
    return out


def run_dir_check(path) -> Check:
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rltpu-doctor-") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        return Check("run dir", True, f"{path} is writable")
    except OSError as e:
        return Check("run dir", False, f"{path}: {e.strerror}", "set run_dir= to a writable directory")


def run(cfg, address: str | None) -> list[Check]:
    """Gather everything (Ray in this process, TorchTPU and JAX in children, at once) and judge it."""
    from rltpu.chips.cluster import start_or_join, stop_emulated_nodes

    t0 = time.perf_counter()
    table = ChipTable.build(cfg.cluster)
    emulated = table.emulated
    with ThreadPoolExecutor(2) as pool:  # the children import torch / JAX while Ray starts here
        torch_f = pool.submit(_child, _CHILD_TORCH, child_env(cfg, "trainer", emulated))
        jax_f = pool.submit(_child, _CHILD_JAX, child_env(cfg, "sampler", emulated))
        import ray

        checks: list[Check] = []
        try:
            info = start_or_join(cfg.cluster, table, 0, address, cfg.resolved_run_dir)
            nodes = ray.nodes()
            checks += judge_cluster(cfg, nodes, emulated)
            if info.get("auth") != "token":
                checks.append(Check("ray auth", False, f"token auth is {info.get('auth')}",
                                    "give the cluster a token (RAY_AUTH_MODE=token, docs/tpu.md)"))
        except Exception as e:  # noqa: BLE001 - one line per check, never a traceback
            checks.append(Check("ray", False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                                "check --address, and that Ray runs on the TPU hosts"))
        finally:
            if ray.is_initialized():
                ray.shutdown()
            stop_emulated_nodes()
        checks.append(judge_trainer_group(cfg, emulated))
        checks += judge_libtpu(libtpu.installed_builds(), emulated)
        checks.append(judge_torch_tpu(torch_f.result(), emulated))
        checks.append(judge_jax(jax_f.result(), emulated, cfg.placement.chips_per_sampler))
    checks.append(judge_ports(busy_ports(cfg, table)))
    checks.append(run_dir_check(cfg.resolved_run_dir))
    checks.append(Check("time", True, f"{time.perf_counter() - t0:.1f} s"))
    return checks


__all__ = ["BASE_PORT", "Check", "run"]

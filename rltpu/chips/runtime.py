"""What every chip-owning process does before its engine exists: prove which chips it holds,
set the env libtpu expects for exactly those chips, apply the backend, join the process groups.

Kept free of Ray calls except ``identity`` (which reads Ray's own assignment), so it can be
exercised in a plain process. Order matters on a real TPU host: the env must be set before the
first JAX/torch device call, which is why engines are built only after ``claim``.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from rltpu.chips import backend
from rltpu.chips.topology import Chip, libtpu_env, local_tpu_present, mesh_port
from rltpu.sync.stores import listening_store


def ray_identity() -> dict:
    """This process as Ray sees it: pid, node, and the TPU chip ids Ray assigned to it."""
    import ray

    ctx = ray.get_runtime_context()
    ids = ctx.get_accelerator_ids().get("TPU", [])
    return {
        "pid": os.getpid(),
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "ray_tpu_ids": sorted(int(i) for i in ids),
        "env_tpu_visible_chips": os.environ.get("TPU_VISIBLE_CHIPS"),
        "tpu_present": local_tpu_present(),  # False: this node's chips are emulated Ray resources
    }


# libtpu's bounds and mesh-controller variables that a TorchTPU process must not inherit: TorchTPU sets
# TPU_PROCESS_BOUNDS / TPU_HOST_BOUNDS to TORCH_TPU_TOPOLOGY and the per-chip bounds to 1,1,1 itself, and
# TPU_PROCESS_PORT / TPU_PROCESS_ADDRESSES from TORCH_TPU_SLICEBUILDER_ADDRESSES (torch_tpu
# ``common/environment.cc`` ``InitializeDistributedEnvironment``); Ray sets the bounds for 1-2 chip actors.
STALE_FOR_TORCH_TPU = ("TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS",
                       "TPU_HOST_BOUNDS", "TPU_MESH_CONTROLLER_ADDRESS", "TPU_MESH_CONTROLLER_PORT")


def process_env(chips: list[Chip], generation: str, role: str, emulated: bool,
                launch_env: dict | None = None) -> dict[str, str]:
    """The env a chip-owning process sets before it imports JAX or TorchTPU.

    Emulated chips, and real sampler chips (JAX): libtpu's per-process variables for exactly these
    chips (``libtpu_env``); on real chips also ``TPU_LIBRARY_PATH`` of JAX's libtpu build.
    Real trainer / reward chips (TorchTPU, one chip per process): the chip as both
    ``TPU_VISIBLE_CHIPS`` and ``TPU_VISIBLE_DEVICES``, the launch env, and TorchTPU's libtpu build.
    TorchTPU 0.2.0 makes ``TPU_VISIBLE_DEVICES`` its source of truth and otherwise falls back to
    ``LOCAL_RANK`` (``common/environment.cc``, ``InitializeDistributedEnvironment`` and
    ``InitializeSingleDeviceEnvironment``): without it a trainer with ``LOCAL_RANK=0`` on chip 4 would
    open chip 0, a sampler's. Bounds and ports are TorchTPU's to derive from the launch env.
    Raises ChipUnavailableError when no installed libtpu build fits the runtime.
    """
    from rltpu.chips import libtpu

    if emulated or role == "sampler":
        env = libtpu_env(chips, generation, mesh_port(chips))
        if not emulated:
            try:
                env |= libtpu.runtime_env("jax")
            except libtpu.LibtpuError as e:
                raise backend.ChipUnavailableError(f"{role} claimed real TPU chips but {e}") from None
        return env
    if len(chips) != 1:
        raise backend.ChipUnavailableError(f"{role}: TorchTPU runs one process per chip, this one holds "
                                           f"{[c.index for c in chips]}; set placement.chips_per_{role}=1")
    idx = str(chips[0].index)
    try:
        lib = libtpu.runtime_env("torch_tpu")
    except libtpu.LibtpuError as e:
        raise backend.ChipUnavailableError(f"{role} claimed real TPU chips but {e}") from None
    return {"TPU_VISIBLE_CHIPS": idx, "TPU_VISIBLE_DEVICES": idx} | lib | dict(launch_env or {})


def mesh_groups(n_trainers: int, tp: int, rank: int) -> tuple | None:
    """(dp group, tp group) of trainer ``rank`` in the ``(n_trainers / tp, tp)`` mesh (TP groups are runs
    of ``tp`` consecutive ranks: one ``assign_roles`` block); None for a non-trainer. Every rank of the
    world must call it, in the same order (``new_group`` is collective)."""
    mine_dp = mine_tp = None
    for d in range(n_trainers // tp):
        ranks = list(range(d * tp, (d + 1) * tp))
        g = dist.new_group(ranks)
        mine_tp = g if rank in ranks else mine_tp
    for t in range(tp):
        ranks = list(range(t, n_trainers, tp))
        g = dist.new_group(ranks)
        mine_dp = g if rank in ranks else mine_dp
    return (mine_dp, mine_tp) if rank < n_trainers else None


class ProcessRuntime:
    def __init__(self, role: str, rank: int, generation: str, backend_cfg):
        self.role, self.rank, self.generation, self.backend_cfg = role, rank, generation, backend_cfg
        self.decision_role = role  # "colocated" when this process also holds a sampler engine
        self.decision: backend.Decision | None = None
        self.chips: list[Chip] = []
        self.identity: dict = {}
        self.backend_info: dict = {}
        self.global_rank = -1
        self.trainer_group = None
        self.trainer_tp = 1  # tensor-parallel degree of the trainer group (ranks per TP group)
        self.mesh_groups = None  # (dp, tp) groups of a gloo trainer with trainer_tp > 1 (``mesh_groups``)
        self.fabric = None  # rltpu.sync.collective.SyncFabric of the current sync generation

    def claim(self, chips: list[Chip], identity: dict, emulated: bool, launch_env: dict | None = None) -> dict:
        """Take ownership of ``chips`` (handed by the controller from Ray's assignment) and decide the
        backend from the claim; a real chip this process cannot open raises ChipUnavailableError here,
        before any engine or step. ``launch_env``: this trainer rank's TorchTPU launch variables.

        The process env is set first, then the backend decided (which on a real trainer chip imports
        TorchTPU and runs its loader): TorchTPU reads its variables once, at load, as its own
        launcher arranges by setting them in the parent before any worker imports it."""
        mine = sorted(c.index for c in chips)
        if identity.get("ray_tpu_ids") and mine != identity["ray_tpu_ids"]:
            raise RuntimeError(
                f"{self.role} {self.rank}: handed chips {mine} but Ray assigned TPU ids {identity['ray_tpu_ids']}"
            )
        if not emulated and self.decision_role != "sampler" and "torch_tpu" in sys.modules:
            raise backend.ChipUnavailableError(
                f"{self.role} {self.rank}: torch_tpu was imported before the chip claim set its env; start the "
                f"actor with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (rltpu.control.placement.actor_env) and import nothing "
                f"that imports torch_tpu before claim")
        env = process_env(chips, self.generation, self.decision_role, emulated, launch_env)
        for k in STALE_FOR_TORCH_TPU if not emulated and env.get("TPU_VISIBLE_DEVICES") else ():
            os.environ.pop(k, None)  # Ray's bounds for 1-2 chips: TorchTPU derives its own (process_env)
        os.environ.update(env)
        if emulated and hasattr(os, "sched_setaffinity"):
            # an emulated chip is a CPU core: pin each process to its own cores (XLA's CPU thread
            # pool ignores thread flags, affinity is what bounds it); wraps when chips > cores
            ncpu = os.cpu_count() or 1
            os.sched_setaffinity(0, {c.global_id % ncpu for c in chips})
        self.chips, self.identity = list(chips), identity
        self.decision = backend.decide(self.decision_role, emulated, self.backend_cfg)
        # a sampler's JAX engine spans all its chips (tensor parallelism); torch processes own one chip
        jax_devices = len(chips) if self.decision_role == "sampler" else 1
        self.backend_info = backend.apply(self.backend_cfg, launch_env=launch_env, decision=self.decision,
                                          jax_devices=jax_devices)
        return self.report(emulated) | {"libtpu_env": env, "launch_env": dict(launch_env or {})}

    def modes(self):
        """Context for device work (TorchTPU precision on a real chip; nothing on CPU)."""
        return backend.device_modes(self.decision, self.backend_cfg)

    def report(self, emulated: bool | None = None) -> dict:
        """``emulated``: from the claim's backend decision once claimed (heartbeats call this bare)."""
        if emulated is None:
            emulated = self.decision.emulated if self.decision else None
        return {
            "group": self.role, "rank": self.rank, "pid": os.getpid(),
            "node_id": self.identity.get("node_id"), "host": self.identity.get("hostname"),
            "chips": [c.index for c in self.chips], "chip_ids": [c.global_id for c in self.chips],
            "emulated": emulated, "device": self.backend_info.get("device"),
            "dist_backend": self.backend_info.get("dist_backend"), "runtime": self.backend_info.get("runtime"),
            "jax_platforms": self.backend_info.get("jax_platforms"),
            "jax_devices": self.backend_info.get("jax_devices"),
        }

    def init_process_groups(self, master: str, port: int, world_size: int, global_rank: int,
                            n_trainers: int, timeout_s: float, trainer_tp: int = 1) -> None:
        """One world over all trainers and samplers; the FSDP sub-group (and with ``trainer_tp > 1`` the
        dp and tp groups of the trainers' 2-D mesh). Weight sync has its own groups (``join_sync``), so a
        dead sampler never breaks the trainers' group. On real chips the world is the trainers and
        ``DeviceMesh`` makes the 2-D mesh's groups itself.

        Every rank must create the sub-groups in the same order (``new_group`` is collective).
        """
        if master in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = timedelta(seconds=timeout_s)
        self.trainer_tp = trainer_tp
        store = listening_store(master, port, timeout_s, world_size) if global_rank == 0 else \
            dist.TCPStore(master, port, world_size, False, timeout)
        pg_backend = backend.dist_backend(self.backend_info.get("device", "cpu"))
        if self.decision is not None and not self.decision.emulated:
            # real chips: TorchTPU's "tpu" group holds the trainers only (a JAX sampler opens no torch
            # device); samplers need no default group (weight sync has its own gloo groups)
            self.global_rank = global_rank
            if global_rank >= n_trainers:
                return
            dist.init_process_group(pg_backend, store=dist.PrefixStore("rltpu-trainers", store), rank=global_rank,
                                    world_size=n_trainers, timeout=timeout)
            self.trainer_group = dist.group.WORLD
            return
        dist.init_process_group(
            pg_backend,
            store=store, rank=global_rank, world_size=world_size, timeout=timeout,
        )
        self.global_rank = global_rank
        self.trainer_group = dist.new_group(list(range(n_trainers)))
        if trainer_tp > 1:
            self.mesh_groups = mesh_groups(n_trainers, trainer_tp, global_rank)

    def join_sync(self, host: str, port: int, generation: int, me: int, trainer_slices: list[int],
                  sampler_slices: list[int], timeout_s: float) -> dict:
        """Build weight-sync fabric ``generation`` (standalone gloo groups routed by slice), dropping
        the previous one; after a failed sync every survivor and any replacement call this again."""
        from rltpu.sync.collective import SyncFabric, plan_route
        from rltpu.sync.stores import host_store

        if self.fabric is not None:
            self.fabric.close()
            self.fabric = None
        if me == 0:
            host_store(host, port, timeout_s)
        route = plan_route(trainer_slices, sampler_slices)
        # gloo binds this process's own address (not the store's): on several hosts every participant
        # must be reachable at its own node's IP; the node id says which bytes stayed on one host
        own = self.identity.get("node_ip") or host
        self.fabric = SyncFabric(host, port, generation, me, route, timeout_s, bind=own,
                                 host_key=self.identity.get("node_id") or own)
        return {"generation": generation, "sync_rank": me, "groups": sorted(self.fabric.groups)}

    def shutdown(self) -> None:
        if self.fabric is not None:
            self.fabric.close()
            self.fabric = None
        if dist.is_initialized():
            dist.destroy_process_group()

"""What every chip-owning process does before its engine exists: prove which chips it holds,
set the env libtpu expects for exactly those chips, apply the backend, join the process groups.

Kept free of Ray calls except ``identity`` (which reads Ray's own assignment), so it can be
exercised in a plain process. Order matters on a real TPU host: the env must be set before the
first JAX/torch device call, which is why engines are built only after ``claim``.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from rltpu import backend
from rltpu.topology import Chip, libtpu_env, local_tpu_present, mesh_port


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


class ProcessRuntime:
    def __init__(self, role: str, rank: int, generation: str, backend_cfg):
        self.role, self.rank, self.generation, self.backend_cfg = role, rank, generation, backend_cfg
        self.chips: list[Chip] = []
        self.identity: dict = {}
        self.backend_info: dict = {}
        self.global_rank = -1
        self.trainer_group = None
        self.sync_group = None

    def claim(self, chips: list[Chip], identity: dict, emulated: bool) -> dict:
        """Take ownership of ``chips`` (handed by the controller from Ray's assignment)."""
        mine = sorted(c.index for c in chips)
        if identity.get("ray_tpu_ids") and mine != identity["ray_tpu_ids"]:
            raise RuntimeError(
                f"{self.role} {self.rank}: handed chips {mine} but Ray assigned TPU ids {identity['ray_tpu_ids']}"
            )
        env = libtpu_env(chips, self.generation, mesh_port(chips))
        os.environ.update(env)
        if emulated and hasattr(os, "sched_setaffinity"):
            # an emulated chip is a CPU core: pin each process to its own cores (XLA's CPU thread
            # pool ignores thread flags, affinity is what bounds it); wraps when chips > cores
            ncpu = os.cpu_count() or 1
            os.sched_setaffinity(0, {c.global_id % ncpu for c in chips})
        self.chips, self.identity = list(chips), identity
        self.backend_info = backend.apply(self.backend_cfg)
        return self.report(emulated) | {"libtpu_env": env}

    def report(self, emulated: bool = True) -> dict:
        return {
            "group": self.role, "rank": self.rank, "pid": os.getpid(),
            "node_id": self.identity.get("node_id"), "host": self.identity.get("hostname"),
            "chips": [c.index for c in self.chips], "chip_ids": [c.global_id for c in self.chips],
            "emulated": emulated, "device": self.backend_info.get("device"),
        }

    def init_process_groups(self, master: str, port: int, world_size: int, global_rank: int,
                            n_trainers: int, timeout_s: float) -> None:
        """One world over all trainers and samplers; sub-groups for FSDP and for weight sync.

        Every rank must create the sub-groups in the same order (``new_group`` is collective).
        """
        if master in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend.dist_backend(self.backend_info.get("device", "cpu")),
            init_method=f"tcp://{master}:{port}", rank=global_rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.global_rank = global_rank
        self.trainer_group = dist.new_group(list(range(n_trainers)))
        self.sync_group = dist.new_group([0, *range(n_trainers, world_size)])

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

"""Start an embedded Ray with emulated TPU chips, or join an existing cluster, and check that the
chips a job asks for exist before any actor starts.

Emulated nodes carry the resources and labels Ray itself sets on TPU VMs (``TPU``, the slice-name
resource, ``TPU-{pod_type}-head`` on worker 0, ``ray.io/tpu-*`` labels), so placement code is the
same on a real slice. Everything binds to 127.0.0.1 unless the config says otherwise.
"""

from __future__ import annotations

import os
import tempfile

from rltpu.config import ConfigError
from rltpu.topology import ChipTable, emulated_node_spec

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class PlacementError(RuntimeError):
    """The cluster cannot host the requested actors (too few chips); raised before any actor starts."""


def start_or_join(cluster_cfg, table: ChipTable, needed_chips: int, address: str | None) -> dict:
    os.environ.update(RAY_ENV)
    import ray

    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level="WARNING")
        mode = "joined"
    else:
        hosts = table.hosts()
        if len(hosts) > 1:
            raise ConfigError(
                f"cluster {cluster_cfg.generation} {cluster_cfg.topology} x {cluster_cfg.slices} slice(s) spans "
                f"{len(hosts)} hosts; the embedded emulated cluster holds one host (e.g. v5e 2x4 = 8 chips); "
                f"use a single-host topology or --address to join a multi-node Ray cluster"
            )
        resources, labels = emulated_node_spec(table, *hosts[0])
        temp_dir = cluster_cfg.ray_temp_dir or tempfile.mkdtemp(prefix="rltpu-ray-", dir="/tmp")
        ray.init(
            address="local", num_cpus=os.cpu_count() or 2, resources=resources, labels=labels,
            _temp_dir=temp_dir, include_dashboard=False, _node_ip_address=cluster_cfg.bind_host,
            log_to_driver=True, logging_level="WARNING", configure_logging=True,
        )
        mode = "embedded"
    have = int(ray.cluster_resources().get("TPU", 0))
    if needed_chips > have:
        ray.shutdown()
        raise PlacementError(
            f"job needs {needed_chips} TPU chips but the Ray cluster has {have}; "
            f"lower placement.sampler_chips/trainer_chips or add TPU hosts"
        )
    return {"mode": mode, "tpu_chips": have, "nodes": len(ray.nodes())}

"""Start an embedded Ray with emulated TPU chips, or join an existing cluster, and check that the
chips a job asks for exist before any actor starts.

Emulated nodes carry the resources and labels Ray itself sets on TPU VMs (``TPU``, the slice-name
resource, ``TPU-{pod_type}-head`` on worker 0, ``ray.io/tpu-*`` labels), so placement code is the
same on a real slice. A multi-host or multi-slice emulated topology is one Ray node per host on
this machine (``ray.cluster_utils.Cluster``: a head plus worker nodes joined to it). Everything binds to 127.0.0.1 unless the config says otherwise.
"""

from __future__ import annotations

import os
import tempfile

from rltpu.chips.topology import ChipTable, emulated_node_spec

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
        temp_dir = cluster_cfg.ray_temp_dir or tempfile.mkdtemp(prefix="rltpu-ray-", dir="/tmp")
        if len(hosts) > 1:
            address = start_emulated_nodes(table, cluster_cfg.bind_host, temp_dir)
            ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level="WARNING")
            mode = "embedded"
        else:
            resources, labels = emulated_node_spec(table, *hosts[0])
            ray.init(
                address="local", num_cpus=os.cpu_count() or 2, resources=resources, labels=labels,
                _temp_dir=temp_dir, include_dashboard=False, _node_ip_address=cluster_cfg.bind_host,
                log_to_driver=True, logging_level="WARNING", configure_logging=True,
            )
            mode = "embedded"
    have = int(ray.cluster_resources().get("TPU", 0))
    if needed_chips > have:
        ray.shutdown()
        stop_emulated_nodes()
        raise PlacementError(
            f"job needs {needed_chips} TPU chips but the Ray cluster has {have}; "
            f"lower placement.sampler_chips/trainer_chips or add TPU hosts"
        )
    return {"mode": mode, "tpu_chips": have, "nodes": len(ray.nodes())}


_EMULATED = None  # the ray.cluster_utils.Cluster of this process's emulated hosts, if any


def start_emulated_nodes(table: ChipTable, bind_host: str, temp_dir: str) -> str:
    """One Ray node per emulated TPU host on this machine (head = slice 0 host 0), each carrying
    the resources and labels of a real TPU VM, so placement and the weight-sync route see the
    same multi-node cluster they would on hardware. Only processes started here are stopped by
    :func:`stop_emulated_nodes` (never ``ray stop``). Returns the GCS address."""
    global _EMULATED
    from ray.cluster_utils import Cluster

    cluster = Cluster(shutdown_at_exit=True)
    try:
        for i, host in enumerate(table.hosts()):
            resources, labels = emulated_node_spec(table, *host)
            args = {"resources": resources, "labels": labels, "node_ip_address": bind_host,
                    "num_cpus": (os.cpu_count() or 2) if i == 0 else 1, "object_store_memory": 200 * 2**20}
            if i == 0:
                args |= {"temp_dir": temp_dir, "include_dashboard": False}
            cluster.add_node(wait=True, **args)
    except Exception:
        cluster.shutdown()
        raise
    _EMULATED = cluster
    return cluster.address


def stop_emulated_nodes() -> None:
    """Stop the emulated nodes this process started (after ``ray.shutdown()``); a no-op otherwise."""
    global _EMULATED
    if _EMULATED is not None:
        _EMULATED.shutdown()
        _EMULATED = None

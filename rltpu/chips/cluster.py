"""Start an embedded Ray with emulated TPU chips, or join an existing cluster, and check that the
chips a job asks for exist before any actor starts.

Emulated nodes carry the resources and labels Ray itself sets on TPU VMs (``TPU``, the slice-name
resource, ``TPU-{pod_type}-head`` on worker 0, ``ray.io/tpu-*`` labels), so placement code is the
same on a real slice. A multi-host or multi-slice emulated topology is one Ray node per host on
this machine (``ray.cluster_utils.Cluster``: a head plus worker nodes joined to it). Everything binds to 127.0.0.1 unless the config says otherwise.
"""

from __future__ import annotations

import logging
import os
import tempfile

from rltpu.chips.topology import ChipTable, emulated_node_spec
from rltpu.observe.log import get_logger

logger = get_logger(__name__)

# defaults only: a user's own setting wins. RAY_AUTH_MODE is never set to "disabled" here (see ray_auth).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
TOKEN_FILE = "ray_auth_token"  # in the run dir, mode 0600
START_TRIES = 3  # ray.init of the embedded cluster, when its raylet misses Ray's 30 s registration window


def user_has_token() -> bool:
    """A Ray token the user already provides: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or bool(path and os.path.exists(path)) or \
        os.path.exists(os.path.expanduser("~/.ray/auth_token"))


def ray_auth(run_dir, joining: bool) -> str:
    """Ray token authentication (Ray >= 2.52: ``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN[_PATH]``).

    * ``RAY_AUTH_MODE`` set by the user: kept as it is, whatever it says.
    * An embedded cluster: token mode. The user's token (env or Ray's default ``~/.ray/auth_token``)
      if there is one, else a fresh random token in ``<run_dir>/ray_auth_token`` (0600, reused by a
      resume), named by ``RAY_AUTH_TOKEN_PATH``. Ray's processes and our actors inherit both, so
      only holders of the token can join the cluster or submit work to it.
    * ``--address``: token mode when the user has a token (as Ray itself does for a local
      cluster), so a token-protected cluster can be joined; else Ray's default (no token sent).
    Returns the mode in effect.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode
    if joining:
        if not user_has_token():
            return "unset"
    elif not user_has_token():
        import secrets
        from pathlib import Path

        path = Path(run_dir) / TOKEN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        os.chmod(path, 0o600)
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(path.resolve())
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray caches its config and token at import: make this process see the new settings
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass
    return "token"


def _loopback(host: str) -> bool:
    from rltpu.config import is_loopback

    return is_loopback(host)


class PlacementError(RuntimeError):
    """The cluster cannot host the requested actors (too few chips); raised before any actor starts."""


def start_or_join(cluster_cfg, table: ChipTable, needed_chips: int, address: str | None, run_dir=None) -> dict:
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    auth = ray_auth(run_dir or tempfile.mkdtemp(prefix="rltpu-auth-"), joining=bool(address))
    if cluster_cfg.bind_host and not _loopback(cluster_cfg.bind_host) and not address:
        logger.warning(f"rltpu: warning: the embedded Ray cluster binds {cluster_cfg.bind_host} "
                       f"(cluster.allow_remote): reachable from other hosts; Ray's token auth is {'on' if auth == 'token' else auth}, the "
                       f"weight-sync fabric (TCPStore, gloo) has none")
    import ray

    with _keep_sigterm_handler():  # ray.init would install sys.exit(15) for SIGTERM: not our stop path
        return _start_or_join(ray, cluster_cfg, table, needed_chips, address, auth)


def _keep_sigterm_handler():
    """While Ray starts, keep the caller's SIGTERM handler (the CLI's: checkpoint, exit 143) instead
    of the ``sys.exit`` one ``ray.init`` installs, and start Ray's processes with SIGHUP ignored."""
    import contextlib
    import signal
    import threading

    @contextlib.contextmanager
    def keep():
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        ours = signal.getsignal(signal.SIGTERM)
        # the cluster's processes (raylet, GCS, and the workers the raylet starts) inherit SIGHUP as
        # ignored: a closed terminal sends it to the whole foreground process group, and Ray's
        # processes died of it before the driver could checkpoint (then ray.shutdown hung)
        hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGHUP, hup if hup is not None else signal.SIG_DFL)
            if callable(ours):
                signal.signal(signal.SIGTERM, ours)

    @contextlib.contextmanager
    def both():
        try:
            from ray._private import utils as ray_utils
        except ImportError:
            ray_utils = None
        real = getattr(ray_utils, "set_sigterm_handler", None)
        ours = signal.getsignal(signal.SIGTERM)
        main = threading.current_thread() is threading.main_thread()
        # off the main thread (``ClusterStart``) no handler can be set at all: Ray's head node would
        # raise ValueError from signal.signal, and ray.init would log that it set none
        if real is not None and (callable(ours) or not main):
            ray_utils.set_sigterm_handler = lambda handler: None
        quiet = _NotMainThreadWarning() if not main else None
        if quiet is not None:
            logging.getLogger("ray._private.worker").addFilter(quiet)
        try:
            with keep():
                yield
        finally:
            if real is not None:
                ray_utils.set_sigterm_handler = real
            if quiet is not None:
                logging.getLogger("ray._private.worker").removeFilter(quiet)

    return both()


class _NotMainThreadWarning(logging.Filter):
    """Drops ray.init's "SIGTERM handler is not set" warning: off the main thread that is the point."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class ClusterStart:
    """``start_or_join`` in a thread, begun as soon as the chip plan holds: Ray's start is 3-5 s of its
    own processes starting while the driver mostly waits, and the driver meanwhile loads the tokenizer
    (``transformers``' import alone is 3-5 s), the dataset and the checkpoint headers.

    Begin and ``result`` on the main thread: SIGHUP is ignored from begin to result, as
    ``start_or_join`` does on the main thread, so Ray's processes inherit it ignored. ``result``
    returns ``start_or_join``'s dict or raises its error; ``abandon`` waits for the start and stops
    what it started (a check after it failed: nothing may stay running).

    The thread stays parked after the start until ``release`` (after ``ray.shutdown``): Ray starts its
    GCS and raylet with ``PR_SET_PDEATHSIG``, which Linux fires when the *thread* that forked them
    exits, so a finished thread would kill the cluster it just started."""

    def __init__(self, cluster_cfg, table: ChipTable, needed_chips: int, address: str | None, run_dir=None):
        import signal
        import threading

        args = (cluster_cfg, table, needed_chips, address, run_dir)
        self._owns_temp = not address and not cluster_cfg.ray_temp_dir  # a fresh /tmp/rltpu-ray-*
        self._hup = None
        if threading.current_thread() is threading.main_thread():
            self._hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self._out: dict = {}
        self._done, self._released = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=args, name="rltpu-ray-start", daemon=True)
        self._thread.start()

    def _run(self, *args) -> None:
        try:
            self._out["info"] = start_or_join(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread by result()
            self._out["error"] = err
            return
        finally:
            self._done.set()
        self._released.wait()  # the forking thread must outlive Ray's processes (PDEATHSIG)

    def release(self) -> None:
        """Ray is shut down: the parked thread may end."""
        self._released.set()

    def result(self) -> dict:
        import signal

        self._done.wait()
        if self._hup is not None:
            signal.signal(signal.SIGHUP, self._hup)
            self._hup = None
        if "error" in self._out:
            raise self._out["error"]
        return self._out["info"]

    def abandon(self) -> None:
        try:
            self.result()
        except BaseException:  # noqa: BLE001 - it failed to start: nothing to stop beyond the nodes
            pass
        import shutil

        import ray

        temp = None
        if ray.is_initialized():
            try:
                temp = ray._private.worker._global_node.get_temp_dir_path()
            except Exception:  # noqa: BLE001 - Ray internals moved: leave the directory
                temp = None
            ray.shutdown()
        stop_emulated_nodes()
        self.release()
        self._thread.join(timeout=5)
        if self._owns_temp and temp and os.path.basename(temp).startswith("rltpu-ray-"):
            shutil.rmtree(temp, ignore_errors=True)


def _start_or_join(ray, cluster_cfg, table: ChipTable, needed_chips: int, address: str | None, auth: str) -> dict:
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
            for attempt in range(1, START_TRIES + 1):
                try:
                    ray.init(
                        address="local", num_cpus=os.cpu_count() or 2, resources=resources, labels=labels,
                        _temp_dir=temp_dir, include_dashboard=False, _node_ip_address=cluster_cfg.bind_host,
                        log_to_driver=True, logging_level="WARNING", configure_logging=True,
                    )
                    break
                except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception for this one
                    # Ray gives its raylet a fixed 30 s to register with the GCS; on an overloaded host (seen at
                    # load 60 on 2 cores) it misses that and ray.init raises before connecting. The half-started
                    # processes fate-share with this driver; a fresh try usually makes it.
                    if "timed out during startup" not in str(err):
                        raise
                    if attempt == START_TRIES:
                        raise TimeoutError(f"the embedded Ray cluster did not start in {START_TRIES} tries "
                                           f"({str(err).splitlines()[0]}); is the machine overloaded? "
                                           f"Ray's logs: {temp_dir}") from None
                    logger.warning(f"rltpu: warning: the embedded Ray cluster did not start in time (try {attempt} of "
                                   f"{START_TRIES}; an overloaded machine?); trying again")
            mode = "embedded"
    have = int(ray.cluster_resources().get("TPU", 0))
    if needed_chips > have:
        ray.shutdown()
        stop_emulated_nodes()
        raise PlacementError(
            f"job needs {needed_chips} TPU chips but the Ray cluster has {have}; "
            f"lower placement.sampler_chips/trainer_chips or add TPU hosts"
        )
    return {"mode": mode, "tpu_chips": have, "nodes": len(ray.nodes()), "auth": auth}


_EMULATED = None  # the ray.cluster_utils.Cluster of this process's emulated hosts, if any


def start_emulated_nodes(table: ChipTable, bind_host: str, temp_dir: str) -> str:
    """One Ray node per emulated TPU host on this machine (head = slice 0 host 0), each carrying
    the resources and labels of a real TPU VM, so placement and the weight-sync route see the
    same multi-node cluster they would on hardware. Only processes started here are stopped by
    :func:`stop_emulated_nodes` (never ``ray stop``). Returns the GCS address."""
    global _EMULATED
    import ray._private.utils as ray_utils
    from ray.cluster_utils import Cluster

    cluster = Cluster(shutdown_at_exit=True)
    # Cluster.add_node writes the head's address to Ray's global /tmp/ray/ray_current_cluster, which
    # fails where /tmp/ray does not exist (a fresh machine) and would point a user's later
    # `ray.init()` at this private cluster: write it into the run's own Ray temp dir instead
    write_address = ray_utils.write_ray_address
    ray_utils.write_ray_address = lambda address, into=None: write_address(address, into or temp_dir)
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
    finally:
        ray_utils.write_ray_address = write_address
    _EMULATED = cluster
    return cluster.address


def stop_emulated_nodes() -> None:
    """Stop the emulated nodes this process started (after ``ray.shutdown()``); a no-op otherwise."""
    global _EMULATED
    if _EMULATED is not None:
        _EMULATED.shutdown()
        _EMULATED = None

"""TCP stores that weight sync and the process groups rendezvous on, bound to one address.

``torch.distributed.TCPStore`` alone listens on every interface (``::``); handed a socket bound here,
it serves on that address only, so a loopback job exposes no port.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

_LISTENERS: list[socket.socket] = []  # sockets handed to TCPStore servers, kept open with them


def listening_store(host: str, port: int, timeout_s: float, world_size: int | None = None):
    """A TCPStore server listening on ``host`` only. TCPStore alone binds every interface (``::``);
    given a socket we bound, it serves on that address, so a loopback job exposes no port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    _LISTENERS.append(sock)
    return dist.TCPStore(host, port, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.fileno())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_STORES: dict[tuple[str, int], object] = {}  # TCPStore servers hosted by this process


def host_store(host: str, port: int, timeout_s: float):
    """Start (once per process) the TCPStore every generation rendezvouses on; trainer 0 hosts it."""
    key = (host, port)
    if key not in _STORES:
        _STORES[key] = listening_store(host, port, timeout_s)
    return _STORES[key]


def hosted_store(host: str, port: int):
    """The store this process hosts at ``(host, port)``, or None (a client connects instead)."""
    return _STORES.get((host, port))

"""The HTTP front end's listening socket, bound as the gRPC server binds the same host.

``[::]`` (serve's default host) means every address, IPv4 included, to gRPC; asyncio's
``create_server`` makes an IPv6 socket IPv6-only, so the kubelet's probes, which ask the pod's IPv4
address in most clusters, would never reach ``/health``. The any-address therefore gets one
dual-stack socket (one port for both families, also when the port is 0), or an IPv4 one on a machine
without IPv6.
"""

from __future__ import annotations

import contextlib
import socket

ANY_ADDRESSES = ("", "::")  # 0.0.0.0 stays IPv4 only, as gRPC takes it


def is_any_address(host: str) -> bool:
    return host.strip("[]") in ANY_ADDRESSES


def any_address_socket(port: int) -> socket.socket:
    """A listening-ready TCP socket on every address, IPv6 and IPv4; OSError when it cannot bind."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this machine
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address: tuple = ("0.0.0.0", port)
    else:
        with contextlib.suppress(OSError, AttributeError):  # dual stack where the system allows it
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address = ("::", port)
    try:
        # As gRPC binds: a port whose last connections linger in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock

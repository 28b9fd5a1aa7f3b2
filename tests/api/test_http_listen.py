"""The HTTP port on serve's default host ``[::]`` takes IPv4 and IPv6 connections on one port, as the
gRPC port does: the kubelet probes /health at the pod's IPv4 address."""

from __future__ import annotations

import socket

import pytest
from switchyard.service.api.http.listen import any_address_socket, is_any_address


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_any_address_socket_takes_both_families_on_one_port() -> None:
    sock = any_address_socket(0)
    try:
        sock.listen()
        port = sock.getsockname()[1]
        hosts = ["127.0.0.1", *(["::1"] if has_ipv6_loopback() else [])]
        for host in hosts:
            with socket.create_connection((host, port), timeout=5):
                pass
    finally:
        sock.close()


def test_a_taken_port_is_an_oserror() -> None:
    first = any_address_socket(0)
    try:
        first.listen()
        with pytest.raises(OSError):
            any_address_socket(first.getsockname()[1])
    finally:
        first.close()


def test_which_hosts_are_every_address() -> None:
    assert is_any_address("[::]") and is_any_address("::") and is_any_address("")
    assert not is_any_address("127.0.0.1") and not is_any_address("[::1]") and not is_any_address("0.0.0.0")

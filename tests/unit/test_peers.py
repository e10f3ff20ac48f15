"""Who is behind a TCP connection: gRPC's peer strings parsed, and real loopback connections found in the
kernel's socket tables with their owner (the caller-side check of `LocalUsersOnly`; another user's
connection is refused in tests/integration/test_control_surface.py)."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from pagedserve.plumbing.peers import local_peer_uids, peer_address, stranger


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:127.0.0.1:5000", ("127.0.0.1", 5000)),
        ("ipv6:[::1]:6000", ("::1", 6000)),
        ("ipv6:[::ffff:10.1.2.3]:7000", ("10.1.2.3", 7000)),  # a dual-stack listener's IPv4 caller
        ("unix:/tmp/x.sock", None),
        ("unix:", None),
        ("ipv4:not-an-address:1", None),
        ("garbage", None),
    ],
)
def test_peer_strings(peer: str, expected: tuple[str, int] | None) -> None:
    parsed = peer_address(peer)
    assert parsed == (None if expected is None else (ipaddress.ip_address(expected[0]), expected[1]))


@pytest.mark.parametrize(("family", "host"), [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_local_connection_is_found_with_its_owner(family: socket.AddressFamily, host: str) -> None:
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection((host, port)) as client:
            accepted, where = server.accept()
            with accepted:
                peer = (
                    f"ipv4:{where[0]}:{where[1]}"
                    if family == socket.AF_INET
                    else f"ipv6:[{where[0]}]:{where[1]}"
                )
                address = peer_address(peer)
                assert address is not None
                assert local_peer_uids(address, port) == {os.geteuid()}
                assert local_peer_uids(address, port + 1 if port < 65535 else 1) == set()  # another server's
                assert stranger(peer, port) is None  # this user's own process
                assert client.getsockname()[1] == where[1]


def test_a_peer_not_on_this_machine_is_not_found() -> None:
    address = peer_address("ipv4:203.0.113.9:40000")  # TEST-NET-3: never a local socket
    assert address is not None and local_peer_uids(address, 50052) == set()

"""Who a public client is, for its share of admission (`admission.Admission`): its bearer token when the
frontend has tokens (one a line in --api-token-file, each a client of its own), else its peer's address;
and which tenant pays for its pins in the daemon (`tenant`).

An address is one IPv4 address, or one IPv6 /64 (what one site is usually given, so that a client cannot
multiply itself by its addresses); every caller of the frontend's own unix socket (this machine's tools,
`pagedserve up`'s health checks) is one client. A token is named by a short hash, never by itself, since
the name shows in refusals and logs.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Sequence

import grpc

from pagedserve.plumbing.peers import peer_address

_BEARER = "Bearer "


class ClientIdentity:
    def __init__(self, tokens: Sequence[str], peer_of: Callable[[str], str] = lambda peer: peer) -> None:
        """peer_of: the client's address behind a call's peer (the public port's HTTP/2 guard relays them)."""
        self._tokens = frozenset(tokens)
        self._peer_of = peer_of

    def of(self, context: grpc.aio.ServicerContext) -> str:
        """The client of a call that passed the bearer-token check, if the frontend has one."""
        if self._tokens:
            given = dict(context.invocation_metadata() or ()).get("authorization", "")
            token = str(given).removeprefix(_BEARER)
            return f"token {hashlib.sha256(token.encode()).hexdigest()[:12]}"
        return address_of(self._peer_of(context.peer()))

    def tenant(self, client: str | None, cache_salt: str) -> str:
        """Whose pin budget a request's pins (cache_ttl_seconds) take: its client's when the frontend has
        tokens, else its cache_salt namespace (an address changes; a salt is what a client keeps, and it
        names the pages it may share). A salt is named by a short hash, like a token."""
        if self._tokens and client is not None:
            return client
        if not cache_salt:
            return "the unsalted namespace"
        return f"salt {hashlib.sha256(cache_salt.encode()).hexdigest()[:12]}"


def address_of(peer: str) -> str:
    """The client a peer ("ipv4:198.51.100.7:5000", "ipv6:[2001:db8::1]:5000", "unix:...") counts as."""
    address = peer_address(peer)
    if address is None:
        return "this machine's unix socket"
    host = address[0]
    if isinstance(host, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{host}/64", strict=False))
    return str(host)

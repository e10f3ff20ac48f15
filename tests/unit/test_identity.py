"""Who a public client is, for its share of admission: its bearer token (one a line in the token file),
else its address, an IPv6 /64 as one; which tenant pays for its pins; and the priorities a request may ask
for, which the operator sets."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pagedserve.plumbing.auth import bearer_tokens
from pagedserve.plumbing.errors import InvalidArgument
from services.client import generate_request
from services.frontend.identity import ClientIdentity, address_of
from services.frontend.validation import RequestBuilder
from tests.unit.validating import LIMITS, prepare, refusal


@pytest.mark.parametrize(
    ("peer", "client"),
    [
        ("ipv4:198.51.100.7:40000", "198.51.100.7"),
        ("ipv4:198.51.100.7:40001", "198.51.100.7"),  # another connection of the same host
        ("ipv6:[2001:db8:1:2:aaaa::1]:40000", "2001:db8:1:2::/64"),
        ("ipv6:[2001:db8:1:2:bbbb::9]:40000", "2001:db8:1:2::/64"),  # the same site
        ("ipv6:[::ffff:198.51.100.7]:40000", "198.51.100.7"),  # a dual-stack listener's IPv4 caller
        ("unix:/run/pagedserve/frontend.sock", "this machine's unix socket"),
    ],
)
def test_a_client_without_tokens_is_its_address(peer: str, client: str) -> None:
    assert address_of(peer) == client
    context = SimpleNamespace(peer=lambda: peer, invocation_metadata=lambda: ())
    assert ClientIdentity(()).of(context) == client  # type: ignore[arg-type]


def test_with_tokens_each_token_is_a_client_named_by_a_hash() -> None:
    tokens = bearer_tokens("# team A\nalpha-token\n\n  beta-token  \n")
    assert tokens == ("alpha-token", "beta-token")
    identity = ClientIdentity(tokens)

    def client(token: str, peer: str) -> str:
        context = SimpleNamespace(
            peer=lambda: peer, invocation_metadata=lambda: (("authorization", f"Bearer {token}"),)
        )
        return identity.of(context)  # type: ignore[arg-type]

    alpha = client("alpha-token", "ipv4:198.51.100.7:1")
    assert alpha == client("alpha-token", "ipv4:203.0.113.9:2")  # the token, wherever it comes from
    assert alpha != client("beta-token", "ipv4:198.51.100.7:1")
    assert "alpha" not in alpha and alpha.startswith("token ")


@pytest.mark.parametrize("priority", [-1, -(2**31), 1001, 2**31 - 1])
def test_a_priority_outside_the_operators_range_is_refused(builder: RequestBuilder, priority: int) -> None:
    message = refusal(builder, generate_request(token_ids=[1, 2], priority=priority))
    assert message == (
        f"priority is {priority}; this server takes 0 to 1000 (lower runs first), "
        "a range its operator sets with --min-priority and --max-priority"
    )


@pytest.mark.parametrize("priority", [0, 1000])
def test_the_ends_of_the_range_are_taken(builder: RequestBuilder, priority: int) -> None:
    assert prepare(builder, None, token_ids=[1, 2], priority=priority).engine.priority == priority


def test_a_pins_tenant_is_the_token_with_tokens_else_the_salt_namespace() -> None:
    with_tokens, without = ClientIdentity(("alpha-token",)), ClientIdentity(())
    assert with_tokens.tenant("token 0123456789ab", "any-salt") == "token 0123456789ab"
    assert with_tokens.tenant(None, "s") == without.tenant(None, "s")  # the gateway's: it has no client
    salted = without.tenant("198.51.100.7", "team-a")  # an address is no tenant: it changes
    assert salted == without.tenant("203.0.113.9", "team-a") != without.tenant("198.51.100.7", "team-b")
    assert salted.startswith("salt ") and "team-a" not in salted
    assert without.tenant("198.51.100.7", "") == "the unsalted namespace"


@pytest.mark.parametrize("ttl", [1, 3600, 86400])
def test_a_cache_ttl_goes_to_the_worker_with_its_tenant(builder: RequestBuilder, ttl: int) -> None:
    request = generate_request(token_ids=[1, 2], cache_ttl_seconds=ttl, cache_salt="team-a")
    checked = builder.check(request, "r", LIMITS)
    tenant = ClientIdentity(()).tenant(None, checked.cache_salt)
    engine = builder.tokenize(dataclasses.replace(checked, tenant=tenant), LIMITS).engine
    assert (engine.cache_ttl_seconds, engine.tenant) == (ttl, tenant)
    with pytest.raises(InvalidArgument, match="tenant must be 1 to 256 bytes"):  # a worker's check too
        builder.tokenize(checked, LIMITS)


def test_a_cache_ttl_over_a_day_is_refused(builder: RequestBuilder) -> None:
    message = refusal(builder, generate_request(token_ids=[1, 2], cache_ttl_seconds=86401))
    assert message == "cache_ttl_seconds is 86401; a pin lasts 0 (none) to 86400 seconds"

"""The limits of a pin (GenerateRequest.cache_ttl_seconds), which the frontend, the worker and the daemon
each check, so that one bad value gets one message wherever it is found."""

from __future__ import annotations

from pagedserve.plumbing.errors import InvalidArgument

MAX_TTL_S = 24 * 3600  # a pin's longest life; hits renew it, so a session in use lives on
MAX_TENANT_BYTES = 256


def check_ttl(ttl_s: int) -> None:
    if not 0 <= ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"cache_ttl_seconds is {ttl_s}; a pin lasts 0 (none) to {MAX_TTL_S} seconds")


def check_tenant(tenant: str) -> None:
    if not 0 < len(tenant.encode()) <= MAX_TENANT_BYTES:
        raise InvalidArgument(
            f"a pin's tenant must be 1 to {MAX_TENANT_BYTES} bytes, got {len(tenant.encode())}"
        )

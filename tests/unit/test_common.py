"""The error-to-status mapping and size parsing that every process shares."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import FailedPrecondition, ResourceExhausted, status_for
from services.common.sizes import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (FailedPrecondition("double free"), grpc.StatusCode.FAILED_PRECONDITION, "double free"),
        (ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
        (PermissionError("not yours"), grpc.StatusCode.PERMISSION_DENIED, "not yours"),
        (KeyError("unknown lease 'x'"), grpc.StatusCode.NOT_FOUND, "unknown lease 'x'"),
        (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT, "bad"),
        (ZeroDivisionError("oops"), grpc.StatusCode.INTERNAL, "internal error: ZeroDivisionError: oops"),
    ],
)
def test_status_for(error: Exception, code: grpc.StatusCode, message: str) -> None:
    assert status_for(error) == (code, message)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("512MiB", 512 * 2**20), ("8GiB", 8 * 2**30), ("1.5GB", 1_500_000_000)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_parse_bytes_says_what_it_wants() -> None:
    with pytest.raises(ValueError, match=r"write e\.g\. 4096, 512MiB or 8GiB"):
        parse_bytes("lots")


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(10) == "10 B"

"""The error-to-status mapping and size parsing that every process shares."""

from __future__ import annotations

import grpc
import pytest

from pagedserve.plumbing.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StatusError,
    Unavailable,
)
from pagedserve.plumbing.sizes import format_bytes, parse_bytes
from pagedserve.plumbing.status import status_of

INTERNAL = grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (FailedPrecondition("double free"), grpc.StatusCode.FAILED_PRECONDITION, "double free"),
        (ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
        (PermissionDenied("not yours"), grpc.StatusCode.PERMISSION_DENIED, "not yours"),
        (NotFound("unknown lease 'x'"), grpc.StatusCode.NOT_FOUND, "unknown lease 'x'"),
        (InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT, "bad"),
        (Unavailable("no worker"), grpc.StatusCode.UNAVAILABLE, "no worker"),
        (Internal("engine failed"), INTERNAL, "engine failed"),
    ],
)
def test_each_error_type_names_its_status(error: Exception, code: grpc.StatusCode, message: str) -> None:
    assert status_of(error) == (code, message)


@pytest.mark.parametrize(
    "error",
    [
        ZeroDivisionError("oops"),
        KeyError("unknown lease 'x'"),  # a bug, not the caller's fault: no built-in maps to a status
        ValueError("bad"),
        PermissionError("not yours"),
        ConnectionError("down"),
    ],
)
def test_any_other_exception_is_internal_and_says_so(error: Exception) -> None:
    code, message = status_of(error)
    assert code is INTERNAL
    assert message == f"internal error ({type(error).__name__}: {error}); see the server's log"


@pytest.mark.parametrize("code", [c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK])
def test_a_status_from_another_process_passes_through_unchanged(code: str) -> None:
    error = StatusError.of(code, "as the worker said it")
    assert status_of(error) == (grpc.StatusCode[code], "as the worker said it")


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

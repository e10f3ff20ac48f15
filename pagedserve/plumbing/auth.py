"""Who may call: a shared secret between the stack's own processes, and a bearer token for public clients.

Internal calls (a worker to the daemon, the frontend to a worker) carry the stack's secret under the
`x-pagedserve-secret` metadata key; the daemon and the workers refuse a call without it with
UNAUTHENTICATED, so the daemon hands pool handles only to authenticated workers. The secret comes from
$PAGEDSERVE_SECRET or --secret-file, never from the command line (where `ps` would show it); `pagedserve up`
makes a fresh one per run and hands it to its children in their environment. The public frontend can
require `authorization: Bearer <token>` instead. Health checks and reflection stay open: they reveal
nothing, and orchestrators probe them without credentials.

Without a secret, the daemon and a worker serve only on a unix socket in a private folder: a TCP port,
loopback included, is open to every user of the machine (`check_serving_address`). A client sends the
secret to a unix socket only once it has checked who listens there (`private.check_unix_peer`).
"""

from __future__ import annotations

import hmac
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from pagedserve.plumbing.errors import PermissionDenied
from pagedserve.plumbing.private import check_socket_folder, unix_socket_path
from pagedserve.plumbing.settings import setting

log = logging.getLogger(__name__)

SECRET_ENV = "PAGEDSERVE_SECRET"
SECRET_KEY = "x-pagedserve-secret"
API_TOKEN_ENV = "PAGEDSERVE_API_TOKEN"
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Metadata = tuple[tuple[str, str], ...]


def read_secret_file(path: str | Path) -> str:
    """The secret in a file, without surrounding whitespace."""
    secret = Path(path).read_text().strip()
    if not secret:
        raise ValueError(f"the secret file {path} is empty")
    return secret


def secret_setting() -> Any:
    """A config field for the stack's shared secret: from --secret-file, else $PAGEDSERVE_SECRET."""
    return setting(
        None,
        "a file holding the stack's shared secret",
        flag="--secret-file",
        convert=read_secret_file,
        env=SECRET_ENV,
        metavar="FILE",
        secret=True,
    )


def secret_metadata(secret: str | None) -> Metadata:
    """The metadata an internal call carries."""
    return ((SECRET_KEY, secret),) if secret else ()


def bearer_metadata(token: str | None) -> Metadata:
    return (("authorization", f"Bearer {token}"),) if token else ()


class CredentialInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata lacks one of the expected values under key, except health and
    reflection."""

    def __init__(self, key: str, expected: Sequence[str], what: str) -> None:
        self._key = key
        self._expected = [value.encode() for value in expected]
        self._what = what

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHODS):
            return handler
        given = str(dict(handler_call_details.invocation_metadata or ()).get(self._key, "")).encode()
        # Every value compared, in constant time each: how long a refusal takes tells nothing.
        if sum(hmac.compare_digest(given, value) for value in self._expected):
            return handler
        return _refusing(handler, f"this server needs {self._what}")


def secret_interceptor(secret: str | None, address: str) -> Sequence[grpc.aio.ServerInterceptor]:
    """The internal services' guard: none without a secret (with a warning off loopback)."""
    if secret is None:
        if not address.startswith(("unix:", "127.", "localhost", "[::1]")):
            log.warning("no shared secret ($%s): anything that can reach %s may call it", SECRET_ENV, address)
        return ()
    return (CredentialInterceptor(SECRET_KEY, [secret], f"the stack's shared secret (${SECRET_ENV})"),)


def check_serving_address(prog: str, secret: str | None, address: str) -> None:
    """Where an internal service (the daemon, a worker) may listen, else a one-line usage error (status 2).

    Without a secret: only a unix socket in a private folder (made 0700 if missing), since every local user
    can reach a TCP port. With one: TCP, or a unix socket in a folder that no other user can write, where
    no one can swap the socket for theirs.
    """
    problem = None
    if secret is None and unix_socket_path(address) is None:
        problem = (
            f"--address {address} is open to every user of this machine, and there is no shared secret: "
            f"set ${SECRET_ENV} or --secret-file, or serve on a unix socket in a private folder "
            "(--address unix:/path)"
        )
    else:
        try:
            check_socket_folder(address, private=secret is None)
        except (PermissionDenied, OSError) as exc:
            problem = f"--address {address}: {exc}"
            if secret is None:
                problem += "; without a shared secret the socket's folder must be private (mode 0700)"
    if problem is not None:
        print(f"{prog}: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def bearer_interceptor(tokens: Sequence[str]) -> Sequence[grpc.aio.ServerInterceptor]:
    """The public frontend's guard: a call must carry one of tokens (none: no guard)."""
    if not tokens:
        return ()
    expected = [f"Bearer {token}" for token in tokens]
    return (CredentialInterceptor("authorization", expected, "a bearer token: authorization: Bearer ..."),)


def bearer_tokens(text: str | None) -> tuple[str, ...]:
    """The tokens in a token file's text: one a line; blank lines and lines starting with # are none."""
    lines = (line.strip() for line in (text or "").splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    return handler._replace(**{kind: refuse for kind in kinds if getattr(handler, kind) is not None})

"""Failover: a request whose worker dies or freezes goes on, on another worker, from where it was.

The KV pool and its prefix cache live in the memory daemon, so a request's full pages outlive the worker that
computed them. A generation that loses its worker resubmits the request to another one as its prompt plus
the tokens already sent to the client, with what shapes the rest carried over: the new worker counts those
tokens as output (max_tokens, min_tokens, penalties, the structured output's grammar), a seeded request's
random draws depend only on its seed and the token's position, and the stop-string search goes on in the
generation's own `TextStream`. The new worker finds the full pages in the prefix cache and recomputes only
the rest: the last partial page, and a page whose publish had not yet reached the daemon. The client sees no
error and no token twice. A request moves at most `limit` times, so that one which kills every worker it
lands on cannot take them all down in turn.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import Counter

from pagedserve.plumbing.errors import Internal, Unavailable
from pagedserve.worker.v1 import worker_pb2
from services.common.request import EngineRequest
from services.frontend.router import Router, WorkerDown, WorkerLink

log = logging.getLogger(__name__)

FAILOVERS = Counter(
    "pagedserve_failovers",
    "requests whose worker failed mid-request: moved to another worker, given up after --max-failovers, "
    "or with no worker to move to",
    ["outcome"],
)
for _outcome in ("moved", "given_up", "no_worker"):
    FAILOVERS.labels(_outcome)


@dataclass
class Progress:
    """What a generation has had from its workers so far: where a failover resumes."""

    token_ids: list[int] = field(default_factory=list)
    cached_prompt_tokens: int | None = None  # as the first worker found them
    failovers: int = 0

    def add(self, output: worker_pb2.RequestOutput, sent: Iterable[int]) -> None:
        """A worker's output, of which the tokens `sent` went to the client (those after a stop string did
        not)."""
        if self.cached_prompt_tokens is None:
            self.cached_prompt_tokens = output.cached_prompt_tokens
        self.token_ids.extend(sent)

    def resumed(self, request: EngineRequest) -> EngineRequest:
        """The request as the next worker gets it: the tokens sent so far count as generated, and prompt
        log-probabilities went with the first token."""
        if not self.token_ids:
            return request
        options = request.options
        if options.prompt_logprobs is not None:
            options = dataclasses.replace(options, prompt_logprobs=None)
        return dataclasses.replace(request, options=options, generated=tuple(self.token_ids))


def next_worker(router: Router, lost: WorkerDown, progress: Progress, limit: int) -> WorkerLink:
    """The worker to go on with after `lost`; raises the error the client gets when the request cannot."""
    if progress.failovers >= limit:
        FAILOVERS.labels("given_up").inc()
        raise Internal(
            f"{lost}, and the request was given up: its workers failed {progress.failovers + 1} times, "
            "and it may be what kills them (the frontend's --max-failovers)"
        )
    try:
        link = router.pick()
    except Unavailable as none:
        FAILOVERS.labels("no_worker").inc()
        raise Unavailable(f"{lost}, and {none}; retry") from None
    progress.failovers += 1
    FAILOVERS.labels("moved").inc()
    log.warning("moving a request to %s after %d tokens: %s", link.address, len(progress.token_ids), lost)
    return link

"""The engine request: built once by the frontend, carried whole by the Worker contract, checked alike at both
ends (`services.common.request`), and its sampling options and constraint built once in each process."""

from __future__ import annotations

from unittest import mock

import pytest

from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted
from pagedserve.worker.v1 import worker_pb2
from services.common.request import EngineRequest, ModelLimits, check_request
from services.common.sampling import SamplingOptions
from services.common.structured import Constraint
from services.common.wire import request_from_pb, submit_pb
from services.frontend.validation import RequestBuilder
from services.worker.core.sequence import Sequence
from tests.unit.validating import LIMITS, prepare

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
GOOD = EngineRequest((5, 6, 7), SamplingOptions(max_tokens=4))


class Built:
    """Counts the SamplingOptions and Constraints constructed (each checks itself, a schema is parsed)."""

    def __enter__(self) -> Built:
        self.options = self.constraints = 0
        options_check, constraint_check = SamplingOptions.__post_init__, Constraint.__post_init__

        def count_options(options: SamplingOptions) -> None:
            self.options += 1
            options_check(options)

        def count_constraint(constraint: Constraint) -> None:
            self.constraints += 1
            constraint_check(constraint)

        self._patches = [
            mock.patch.object(SamplingOptions, "__post_init__", count_options),
            mock.patch.object(Constraint, "__post_init__", count_constraint),
        ]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for patch in self._patches:
            patch.stop()


def test_options_and_constraint_are_built_once_in_the_frontend_and_once_in_the_worker(
    builder: RequestBuilder,
) -> None:
    with Built() as frontend:
        prepared = prepare(
            builder, "Hello", max_tokens=8, min_tokens=2, seed=4, structured={"json_schema": SCHEMA}
        )
    assert (frontend.options, frontend.constraints) == (1, 1)
    wire = submit_pb("1", prepared.engine).SerializeToString()
    with Built() as worker:
        request = request_from_pb(worker_pb2.Submit.FromString(wire))
        seq = Sequence(("stream", "1"), request, arrival=0)
    assert (worker.options, worker.constraints) == (1, 1)
    assert request == prepared.engine and seq.options is request.options
    assert seq.options.structured == Constraint("json_schema", SCHEMA)


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (EngineRequest((), GOOD.options), InvalidArgument, "the prompt is empty"),
        (
            EngineRequest((5,) * 64, GOOD.options),
            ResourceExhausted,
            "the prompt has 64 tokens, but the model's context is 64 tokens",
        ),
        (
            EngineRequest((5,), GOOD.options, generated=(6,) * 4),
            InvalidArgument,
            "4 tokens generated already: max_tokens is reached",
        ),
        (
            EngineRequest((5, 49152), GOOD.options),
            InvalidArgument,
            "prompt_token_ids holds 49152, which is not a token of this model (0..49151)",
        ),
        (
            EngineRequest((5,), GOOD.options, generated=(-1,)),
            InvalidArgument,
            "generated_token_ids holds -1, which is not a token of this model (0..49151)",
        ),
        (
            EngineRequest((5,), SamplingOptions(stop_token_ids=(7, 50000))),
            InvalidArgument,
            "sampling.stop_token_ids holds 50000, which is not a token",
        ),
        (
            EngineRequest((5,), SamplingOptions(logit_bias=((3, 1.0), (49152, 1.0)))),
            InvalidArgument,
            "sampling.logit_bias holds 49152, which is not a token",
        ),
    ],
)
def test_each_condition_has_one_status_and_one_message(
    request_: EngineRequest, error: type[Exception], message: str
) -> None:
    limits = ModelLimits(vocab_size=49152, max_model_len=64)
    with pytest.raises(error) as refused:
        check_request(request_, limits)
    assert type(refused.value) is error and str(refused.value).startswith(message), refused.value


def test_a_good_request_passes(builder: RequestBuilder) -> None:
    check_request(GOOD, LIMITS)
    check_request(prepare(builder, "Hello").engine, LIMITS)

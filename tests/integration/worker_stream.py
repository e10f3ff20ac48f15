"""A worker's Connect stream, held by a test as a frontend holds it: submits and aborts in, outputs out."""

from __future__ import annotations

import queue
from collections import defaultdict

from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling import SamplingOptions
from services.common.wire import sampling_to_pb
from tests.clients import internal_channel


def submit_of(
    request_id: str, prompt: list[int], options: SamplingOptions | generation_pb2.SamplingParams
) -> worker_pb2.Submit:
    sampling = sampling_to_pb(options) if isinstance(options, SamplingOptions) else options
    return worker_pb2.Submit(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


class WorkerStream:
    """One Connect stream, as a frontend holds it."""

    def __init__(self, address: str) -> None:
        self.channel = internal_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._requests: queue.Queue[worker_pb2.WorkerRequest | None] = queue.Queue()
        self._responses = self.stub.Connect(iter(self._requests.get, None))

    def submit(
        self, request_id: str, prompt: list[int], options: SamplingOptions | generation_pb2.SamplingParams
    ) -> None:
        self.send(worker_pb2.WorkerRequest(submit=[submit_of(request_id, prompt, options)]))

    def abort(self, request_id: str) -> None:
        self.send(worker_pb2.WorkerRequest(abort=[request_id]))

    def send(self, request: worker_pb2.WorkerRequest) -> None:
        """One message; the worker reads its submits, then its aborts, in order, and messages in order."""
        self._requests.put(request)

    def next_message(self) -> worker_pb2.StepOutputs:
        return next(self._responses)

    def next_outputs(self) -> list[worker_pb2.RequestOutput]:
        return list(self.next_message().outputs)

    def collect(self, request_ids: set[str]) -> dict[str, list[worker_pb2.RequestOutput]]:
        """Read until every request in request_ids has finished."""
        outputs: dict[str, list[worker_pb2.RequestOutput]] = defaultdict(list)
        pending = set(request_ids)
        while pending:
            for output in self.next_outputs():
                outputs[output.request_id].append(output)
                if output.finish_reason:
                    pending.discard(output.request_id)
        return outputs

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()


def tokens(outputs: list[worker_pb2.RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]

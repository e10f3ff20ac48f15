"""A small Python client for pagedserve's public Generation service.

    from services.client import Client

    with Client("127.0.0.1:50051") as client:
        for delta in client.stream("Tell me a joke", temperature=0.7, max_tokens=64):
            print(delta.text, end="", flush=True)
        answer = client.complete(messages=[{"role": "user", "content": "Hi!"}])

Sampling keywords are the fields of pagedserve.v1.SamplingParams (max_tokens, temperature, top_p, top_k,
min_p, repetition_penalty, presence_penalty, frequency_penalty, seed, stop, stop_token_ids, ignore_eos,
logprobs). Errors come as grpc.RpcError with the server's status and message.

A frontend that requires a bearer token or serves TLS takes `Client(address, token=..., tls_ca="ca.pem")`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from pagedserve.plumbing.auth import API_TOKEN_ENV, bearer_metadata
from pagedserve.plumbing.rpc import open_channel, wait_for_health
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


def generate_request(
    prompt: str | None = None,
    *,
    messages: Iterable[Mapping[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    cache_ttl_seconds: int = 0,
    **sampling: Any,
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt or "",
        prompt_token_ids=token_ids or [],
        messages=[generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages or []],
        sampling=generation_pb2.SamplingParams(**sampling),
        priority=priority,
        cache_salt=cache_salt,
        cache_ttl_seconds=cache_ttl_seconds,
    )


class Client:
    """token: the frontend's bearer token ($PAGEDSERVE_API_TOKEN by default); tls_ca: a PEM file of the CA
    that signed its certificate, for a frontend serving TLS."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.credentials = tls_credentials(tls_ca)
        self.metadata = bearer_metadata(token or os.environ.get(API_TOKEN_ENV))
        self._channel = open_channel(address, self.credentials)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the server reports a worker up; raise TimeoutError otherwise."""
        wait_for_health(
            self.address, timeout_s, service="pagedserve.v1.Generation", credentials=self.credentials
        )

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[generation_pb2.GenerateResponse]:
        """One GenerateResponse per step, with text and token deltas; the last has finish_reason and usage."""
        request = generate_request(prompt, **kwargs)
        yield from self._stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)

    def complete(self, prompt: str | None = None, **kwargs: Any) -> generation_pb2.GenerateResponse:
        return self._stub.Complete(
            generate_request(prompt, **kwargs), timeout=self.timeout_s, metadata=self.metadata
        )

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = generation_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._stub.Tokenize(request, timeout=self.timeout_s, metadata=self.metadata).token_ids)

    def model_info(self) -> generation_pb2.ModelInfo:
        request = generation_pb2.GetModelInfoRequest()
        return self._stub.GetModelInfo(request, timeout=self.timeout_s, metadata=self.metadata)


def tls_credentials(ca_file: str | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the CA in ca_file (PEM), or None for a plaintext channel."""
    if ca_file is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())

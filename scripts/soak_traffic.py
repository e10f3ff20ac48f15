"""The soak's traffic (scripts/soak.py): request kinds, each with the final statuses it may end with, and the
client threads that send them."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.client import generate_request

OK, CANCELLED, DEADLINE = "OK", "CANCELLED", "DEADLINE_EXCEEDED"
INVALID, EXHAUSTED = ("INVALID_ARGUMENT",), ("RESOURCE_EXHAUSTED",)
PROMPTS = ["Tell me a joke.", "What is the capital of France?", "Write a haiku about rain.", "Hi!",
           "Explain gravity to a child.", "List three fruits.", "Why is the sky blue?"]  # fmt: skip
STOPS, STOP_TOKENS = [".", ",", " the", "\n", "!"], [30, 28, 260]  # the tokens ".", "," and " the"
HI = [generation_pb2.ChatMessage(role="user", content="Hi")]
Request = generation_pb2.GenerateRequest


@dataclass
class Outcome:
    code: str = OK
    details: str = ""
    text: str = ""
    tokens: int = 0
    logprobs: int = 0
    tops: set[int] = field(default_factory=set)  # how many top entries the logprobs had
    matched_stop: str = ""
    problem: str = ""  # what is wrong with a call that ended as expected
    at_s: float = 0.0  # when it ended, in seconds into the run


def stream(stub: Any, request: Request, timeout: float, cancel_after: int) -> Outcome:
    """Read a Generate call to its end; cancel it once cancel_after tokens are out, if that is not 0."""
    out, call = Outcome(), stub.Generate(request, timeout=timeout)
    try:
        for message in call:
            out.text += message.text
            out.tokens += len(message.token_ids)
            out.logprobs += len(message.logprobs)
            out.tops.update(len(entry.top) for entry in message.logprobs)
            out.matched_stop = out.matched_stop or message.matched_stop_str
            if cancel_after and out.tokens >= cancel_after:
                call.cancel()
    except grpc.RpcError as exc:
        out.code, out.details = exc.code().name, exc.details() or ""
    return out


def chat(rng: random.Random, max_tokens: int = 0, **fields: Any) -> Request:
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    return generate_request(messages=messages, max_tokens=max_tokens or rng.randint(8, 96), **fields)


def sampled(rng: random.Random) -> Request:
    return chat(rng, temperature=rng.uniform(0.3, 1.2), top_p=rng.uniform(0.7, 1), seed=rng.getrandbits(63))


def with_stops(rng: random.Random) -> Request:
    stops = rng.sample(STOPS, rng.randint(1, 3))
    return chat(rng, temperature=0.0, stop=stops, stop_token_ids=rng.sample(STOP_TOKENS, 1))


def check(request: Request, out: Outcome) -> str:
    """What is wrong with a stream that ended OK: its stop string in its text, or not a logprob a token."""
    stop, sampling = out.matched_stop, request.sampling
    if stop and (stop not in sampling.stop or stop in out.text):
        return f"stopped by {stop!r} of {list(sampling.stop)}, yet the text is {out.text!r}"
    if out.logprobs != (out.tokens if sampling.logprobs else 0) or out.tops - {sampling.logprobs}:
        return f"{out.logprobs} logprobs for {out.tokens} tokens, with {out.tops} top entries"
    return ""


def bad(**request: Any) -> Callable[[random.Random], Request]:
    return lambda rng: Request(**request)


@dataclass(frozen=True)
class Kind:
    weight: int
    make: Callable[[random.Random], Request]
    expected: tuple[str, ...] = (OK,)
    cancel: bool = False  # after 1 to 4 tokens
    deadline: bool = False  # of 0.5 to 1.5 s, instead of 120 s


KINDS = {
    "greedy": Kind(4, lambda rng: chat(rng, temperature=0.0)),
    "sampled": Kind(4, sampled),
    "stops": Kind(3, with_stops),
    "priority": Kind(3, lambda rng: chat(rng, priority=rng.choice([-1, 0, 5]))),
    "logprobs": Kind(2, lambda rng: chat(rng, temperature=0.7, logprobs=2)),
    "cancel": Kind(2, lambda rng: chat(rng, 200), (CANCELLED, OK), cancel=True),
    "deadline": Kind(1, lambda rng: chat(rng, 500, ignore_eos=True), (DEADLINE, OK), deadline=True),
    "bad temperature": Kind(1, bad(messages=HI, sampling={"temperature": -1.0}), INVALID),
    "bad top_p": Kind(1, bad(messages=HI, sampling={"top_p": 0.0}), INVALID),
    "bad token id": Kind(1, bad(prompt_token_ids=[1, 2, 49152]), INVALID),  # the vocabulary is 0..49151
    "empty request": Kind(1, bad(), INVALID),
    "max_tokens 0 and top_p 2": Kind(1, bad(messages=HI, sampling={"max_tokens": 0, "top_p": 2.0}), INVALID),
    "empty stop string": Kind(1, bad(messages=HI, sampling={"stop": [""]}), INVALID),
    "over the context": Kind(1, bad(prompt_token_ids=[42] * 9000), EXHAUSTED),  # of 8192 tokens
    "over the pool": Kind(1, bad(prompt_token_ids=[42] * 7000), EXHAUSTED),  # 256 MiB: 363 pages of 16
    "10 MB prompt": Kind(1, bad(prompt="x" * 10_000_000), EXHAUSTED),  # over 16 characters a token
    "20 MB message": Kind(1, bad(prompt="x" * 20_000_000), EXHAUSTED),  # over gRPC's 16 MiB
}


def run_kind(stub: Any, kind: Kind, rng: random.Random) -> Outcome:
    request = kind.make(rng)
    timeout = rng.uniform(0.5, 1.5) if kind.deadline else 120
    out = stream(stub, request, timeout, rng.randint(1, 4) if kind.cancel else 0)
    out.problem = check(request, out) if out.code == OK else ""
    return out


Done = list[tuple[str, Outcome]]  # each request's kind and outcome


def client_loop(address: str, seed: int, done: Done, stop: threading.Event, t0: float) -> None:
    """Send requests of random kinds, one at a time, until stop; each kind's name and outcome go to done."""
    rng, names = random.Random(seed), list(KINDS)
    weights = [KINDS[name].weight for name in names]
    options = [("grpc.max_send_message_length", 32 << 20)]  # the 20 MB message must reach the server
    with grpc.insecure_channel(address, options=options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while not stop.is_set():
            name = rng.choices(names, weights)[0]
            try:
                out = run_kind(stub, KINDS[name], rng)
            except Exception as exc:  # a bug of this script's, not a status: counted and shown all the same
                out = Outcome(code=f"EXCEPTION {type(exc).__name__}", details=str(exc))
            out.at_s = time.monotonic() - t0
            done.append((name, out))

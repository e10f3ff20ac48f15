"""The soak's traffic (scripts/soak.py): request kinds, each with the final statuses it may end with, the
client threads that send them, the probes in flight at each kill, and the rerun of the calls a kill may have
moved: those of a greedy or seeded kind must give the same tokens uninterrupted."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
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
PROBE_TOKENS, PROBE_AT = 48, 4  # a probe's length, and the tokens it has had when the worker is killed
Request = generation_pb2.GenerateRequest


@dataclass
class Outcome:
    code: str = OK
    details: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: int = 0
    tops: set[int] = field(default_factory=set)  # how many top entries the logprobs had
    matched_stop: str = ""
    problem: str = ""  # what is wrong with a call that ended as expected
    started_s: float = 0.0  # when it was sent, in seconds into the run
    at_s: float = 0.0  # when it ended
    request: Request | None = None  # kept for a kind whose tokens a rerun must reproduce


def stream(stub: Any, request: Request, timeout: float, cancel_after: int, out: Outcome) -> Outcome:
    """Read a Generate call to its end into out; cancel it once cancel_after tokens are out, if not 0."""
    call = stub.Generate(request, timeout=timeout)
    try:
        for message in call:
            out.text += message.text
            out.token_ids += message.token_ids
            out.logprobs += len(message.logprobs)
            out.tops.update(len(entry.top) for entry in message.logprobs)
            out.matched_stop = out.matched_stop or message.matched_stop_str
            if cancel_after and len(out.token_ids) >= cancel_after:
                call.cancel()
    except grpc.RpcError as exc:
        out.code, out.details = exc.code().name, exc.details() or ""
    return out


def chat(rng: random.Random, max_tokens: int = 0, **fields: Any) -> Request:
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    return generate_request(messages=messages, max_tokens=max_tokens or rng.randint(8, 96), **fields)


def sampled(rng: random.Random, max_tokens: int = 0, **fields: Any) -> Request:
    sampling = {
        "temperature": rng.uniform(0.3, 1.2),
        "top_p": rng.uniform(0.7, 1),
        "seed": rng.getrandbits(63),
    }
    return chat(rng, max_tokens, **sampling, **fields)


def with_stops(rng: random.Random) -> Request:
    stops = rng.sample(STOPS, rng.randint(1, 3))
    return chat(rng, temperature=0.0, stop=stops, stop_token_ids=rng.sample(STOP_TOKENS, 1))


def check(request: Request, out: Outcome) -> str:
    """What is wrong with a stream that ended OK: its stop string in its text, or not a logprob a token."""
    stop, sampling = out.matched_stop, request.sampling
    if stop and (stop not in sampling.stop or stop in out.text):
        return f"stopped by {stop!r} of {list(sampling.stop)}, yet the text is {out.text!r}"
    tokens = len(out.token_ids)
    if out.logprobs != (tokens if sampling.logprobs else 0) or out.tops - {sampling.logprobs}:
        return f"{out.logprobs} logprobs for {tokens} tokens, with {out.tops} top entries"
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
    reproducible: bool = False  # greedy or seeded: a rerun gives the same tokens


KINDS = {
    "greedy": Kind(4, lambda rng: chat(rng, temperature=0.0), reproducible=True),
    "sampled": Kind(4, sampled, reproducible=True),
    "stops": Kind(3, with_stops, reproducible=True),
    "priority": Kind(3, lambda rng: chat(rng, priority=rng.choice([0, 5, 100]))),
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
    # Never drawn: the kill loop sends them (start_probes).
    "greedy probe": Kind(
        0, lambda rng: chat(rng, PROBE_TOKENS, temperature=0.0, ignore_eos=True), reproducible=True
    ),
    "seeded probe": Kind(0, lambda rng: sampled(rng, PROBE_TOKENS, ignore_eos=True), reproducible=True),
}


def run_kind(stub: Any, kind: Kind, rng: random.Random, out: Outcome) -> None:
    request = kind.make(rng)
    out.request = request if kind.reproducible else None
    timeout = rng.uniform(0.5, 1.5) if kind.deadline else 120
    stream(stub, request, timeout, rng.randint(1, 4) if kind.cancel else 0, out)
    out.problem = check(request, out) if out.code == OK else ""


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
            done.append((name, run_one(stub, name, rng, t0)))


def run_one(stub: Any, name: str, rng: random.Random, t0: float, out: Outcome | None = None) -> Outcome:
    """One call of kind name, into out (a new Outcome by default), noting when it starts and ends."""
    out = out or Outcome()
    out.started_s = time.monotonic() - t0
    try:
        run_kind(stub, KINDS[name], rng, out)
    except Exception as exc:  # a bug of this script's, not a status: counted and shown all the same
        out.code, out.details = f"EXCEPTION {type(exc).__name__}", str(exc)
    out.at_s = time.monotonic() - t0
    return out


PROBES = ("greedy probe", "seeded probe", "seeded probe", "greedy probe")  # calls alternate between workers


def start_probes(
    address: str, done: Done, seed: int, t0: float, threads: list[threading.Thread], kill: int
) -> None:
    """Start two greedy and two seeded probes, each in a thread (added to threads); return once each streams.
    Calls sent one after the other go to the worker with fewer in flight, so each worker is likely to hold
    one of each when one is killed."""
    outs = [Outcome() for _ in PROBES]
    for i, (name, out) in enumerate(zip(PROBES, outs, strict=True)):
        args = (address, name, seed + 10 * kill + i, out, done, t0)
        threads.append(threading.Thread(target=probe, args=args, daemon=True))
        threads[-1].start()
    deadline = time.monotonic() + 60
    while any(len(out.token_ids) < PROBE_AT and not out.at_s for out in outs) and time.monotonic() < deadline:
        time.sleep(0.05)  # the poll of other threads' calls


def probe(address: str, name: str, seed: int, out: Outcome, done: Done, t0: float) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        done.append((name, run_one(stub, name, random.Random(seed), t0, out)))


def rerun_moved(address: str, done: Done, kill_times: list[float]) -> dict[str, Any]:
    """Rerun, one at a time on the quiet stack, each call of a reproducible kind that ended OK with a kill
    during it, as every call that moved did: each must give the same tokens as it did then."""
    moved = [(name, out) for name, out in done if KINDS[name].reproducible and out.code == OK
             and any(out.started_s < t < out.at_s for t in kill_times)]  # fmt: skip
    differ = []
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for name, out in moved:
            assert out.request is not None
            again = stream(stub, out.request, 120, 0, Outcome())
            if (again.code, again.token_ids) != (OK, out.token_ids):
                differ.append(f"{out.at_s:7.1f}s {name}: {out.token_ids}; uninterrupted, {again.code}: "
                              f"{again.token_ids}")  # fmt: skip
    return {"checked": dict(Counter(name for name, _ in moved)), "differ": differ}

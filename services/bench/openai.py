"""Sending the bench's requests to any OpenAI-compatible server (vLLM, SGLang, TGI...): streaming
`/v1/completions`, with the same token-id prompts, exact output lengths and arrival times as pagedserve gets.

A prompt goes as its token ids, so both servers see the same tokens whatever their tokenizers do with text;
or, for a server that takes no ids (SMG), as text that tokenizes back to those ids (workloads.with_text).
A reply whose usage counts other prompt tokens is an error, since the two servers did different work.
Exact lengths come from `ignore_eos` and `min_tokens` (vLLM's extensions; a server that ignores them may
stop early, which the per-request token counts show). Each streamed chunk counts as one token arriving;
when the final usage reports more tokens than chunks, the rest arrived with the last chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from services.bench.load import Send
from services.bench.results import RequestRecord
from services.bench.workloads import BenchRequest


@asynccontextmanager
async def openai_target(url: str, model: str | None = None) -> AsyncIterator[Send]:
    """A sender to the server at url (http://host:port); model: the served model's name, else its first."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)  # as many connections as requests in flight
    async with aiohttp.ClientSession(url, timeout=timeout, connector=connector) as session:
        name = model or await _first_model(session)

        async def send(request: BenchRequest) -> RequestRecord:
            return await _one(session, name, request)

        yield send


async def _first_model(session: aiohttp.ClientSession) -> str:
    async with session.get("/v1/models") as reply:
        reply.raise_for_status()
        return str((await reply.json())["data"][0]["id"])


async def _one(session: aiohttp.ClientSession, model: str, request: BenchRequest) -> RequestRecord:
    body = {
        "model": model,
        "prompt": request.prompt_ids if request.prompt_text is None else request.prompt_text,
        "max_tokens": request.max_tokens,
        "min_tokens": request.max_tokens if request.ignore_eos else 0,
        "ignore_eos": request.ignore_eos,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(request.index, len(request.prompt_ids), sent=time.perf_counter())
    try:
        async with session.post("/v1/completions", json=body) as reply:
            if reply.status != 200:
                record.status = f"HTTP {reply.status}"
                record.done = time.perf_counter()
                return record
            prompt_tokens, completion_tokens = await _read_stream(reply, record)
        if prompt_tokens != record.prompt_tokens:
            record.status = f"{prompt_tokens} prompt tokens, not {record.prompt_tokens}"
        if completion_tokens and record.token_times:  # a chunk is a token, but the usage has the last word
            times = record.token_times
            record.token_times = (times + [times[-1]] * completion_tokens)[:completion_tokens]
    except aiohttp.ClientError as exc:
        record.status = type(exc).__name__
    record.done = time.perf_counter()
    return record


async def _read_stream(reply: aiohttp.ClientResponse, record: RequestRecord) -> tuple[int, int]:
    """Time each chunk of the server-sent events; returns the prompt and completion tokens of the usage."""
    usage: dict = {}
    async for raw in reply.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data:") :])
        if chunk.get("choices"):
            record.token_times.append(time.perf_counter())
        usage = chunk.get("usage") or usage
    record.cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))

"""The same workload through Hugging Face transformers, in this process: the baselines pagedserve is
measured against.

Static batching: `generate` on batches formed in arrival order; a batch starts once its last member has
arrived and the previous batch is done, and runs until its longest request ends (prompts left-padded).
Continuous batching: transformers' own manager (what `generate_batch` runs), fed each request at its
arrival time. Token times come from a logits processor (static) or the manager's timestamps.

Under a fixed concurrency (no arrival times), both run closed loops as the load generator does: a static
batch of that many requests is sent when the previous one ends, and the manager gets a new request each
time one finishes; a request's clock starts when it is sent.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from services.bench.results import RequestRecord
from services.bench.workloads import BenchRequest


class _StepClock(LogitsProcessor):
    """Notes when each decoding step's logits are ready: the moment its tokens exist."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def hf_static(
    model: PreTrainedModel,
    requests: list[BenchRequest],
    batch_size: int,
    eos_ids: list[int],
    pad_id: int,
    closed_loop: bool,
) -> list[RequestRecord]:
    ordered = sorted(requests, key=lambda r: r.arrival)
    start = time.perf_counter()
    records: list[RequestRecord] = []
    for first in range(0, len(ordered), batch_size):
        batch = ordered[first : first + batch_size]
        wait = start + max(r.arrival for r in batch) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        batch_start = time.perf_counter()
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        steps = max(r.max_tokens for r in batch)
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(  # type: ignore[operator]
                ids,
                attention_mask=mask,
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=None if all(r.ignore_eos for r in batch) else eos_ids,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        for row, request in enumerate(batch):
            produced = out[row, width:].tolist()
            length = (
                request.max_tokens
                if request.ignore_eos
                else _until_eos(produced, eos_ids, request.max_tokens)
            )
            sent = batch_start if closed_loop else start + request.arrival
            record = RequestRecord(request.index, len(request.prompt_ids), sent=sent)
            record.token_times = clock.times[:length]
            record.done = record.token_times[-1] if record.token_times else time.perf_counter()
            records.append(record)
    return records


def hf_continuous(
    model: PreTrainedModel, requests: list[BenchRequest], eos_ids: list[int], concurrency: int | None
) -> list[RequestRecord]:
    """With a concurrency, a closed loop of that many requests; else each request at its arrival time."""
    config = GenerationConfig(do_sample=False, eos_token_id=eos_ids or -1, max_new_tokens=1)
    manager = model.init_continuous_batching(generation_config=config)  # type: ignore[operator]
    manager.start()
    pending = sorted(requests, key=lambda r: r.arrival)
    sent: dict[str, RequestRecord] = {}
    start = time.perf_counter()

    def send(request: BenchRequest) -> None:
        wait = start + request.arrival - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        sent[str(request.index)] = RequestRecord(
            request.index, len(request.prompt_ids), sent=time.perf_counter()
        )
        manager.add_request(
            request.prompt_ids,
            request_id=str(request.index),
            max_new_tokens=request.max_tokens,
            record_timestamps=True,
            eos_token_id=-1 if request.ignore_eos else eos_ids,
        )

    try:
        for request in pending[: concurrency or len(pending)]:
            send(request)
        queued = pending[concurrency or len(pending) :]
        for _ in range(len(requests)):
            result = manager.get_result(timeout=3600)
            if result is None:
                break
            record = sent[result.request_id]
            record.token_times = list(result.timestamps or [])
            record.done = record.token_times[-1] if record.token_times else time.perf_counter()
            record.status = "ERROR" if result.error else "OK"
            if queued:
                send(queued.pop(0))
    finally:
        manager.stop(block=True)
    return list(sent.values())


def _until_eos(tokens: list[int], eos_ids: list[int], limit: int) -> int:
    for i, token in enumerate(tokens[:limit]):
        if token in eos_ids:
            return i + 1
    return min(limit, len(tokens))

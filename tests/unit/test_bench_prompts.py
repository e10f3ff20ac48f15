"""The bench's text prompts: made of words that the model's tokenizer turns back into the same ids, so a
server that tokenizes text (SMG) gets the tokens another gets as ids."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from tokenizers import Tokenizer

from services.bench.load import drive
from services.bench.results import RequestRecord
from services.bench.workloads import (
    BenchRequest,
    WorkloadSpec,
    ideal_prefix_hit_rate,
    make_requests,
    with_text,
    word_tokens,
)


def test_word_prompts_tokenize_back_to_their_ids(backend: Tokenizer) -> None:
    words = word_tokens(backend)
    assert len(words) > 10_000
    assert all(backend.decode([token_id]).startswith(" ") for token_id in words[:100])
    spec = WorkloadSpec.named("shared-prefix", (16, 300), (4, 4), prefix_len=200)
    requests = with_text(make_requests(spec, 50, vocab=words, seed=3), backend)
    for request in requests:
        assert request.prompt_text is not None
        assert backend.encode(request.prompt_text, add_special_tokens=False).ids == request.prompt_ids
        assert len(request.prompt_ids) >= 216  # the lengths asked for, with no merges across words


def test_a_prompt_whose_text_tokenizes_otherwise_is_refused(backend: Tokenizer) -> None:
    # " pag" and then the letters one at a time: " pagedserve", which tokenizes into longer pieces.
    spelled = [backend.token_to_id("Ġpag"), *(backend.token_to_id(letter) for letter in "edserve")]
    assert backend.decode(spelled) == " pagedserve"
    request = BenchRequest(index=7, prompt_ids=spelled, max_tokens=4, ignore_eos=True, arrival=0)
    with pytest.raises(ValueError, match="request 7's prompt does not survive"):
        with_text([request], backend)


def test_a_session_sends_its_whole_history_and_one_turn_at_a_time() -> None:
    """multi-turn: turn t's prompt starts with turn t-1's prompt and a reply as long as its output; the
    sessions' turns go one after another, the sessions side by side; the ideal hit rate counts each
    previous prompt's full pages."""
    spec = WorkloadSpec.named("multi-turn", (5, 9), (3, 6), turns=4)
    requests = make_requests(spec, 3, vocab=range(100, 200), seed=1)
    assert [(r.session, r.index) for r in requests] == [(s, 4 * s + t) for s in range(3) for t in range(4)]
    for before, after in itertools.pairwise(requests):
        if before.session == after.session:
            grown = len(after.prompt_ids) - len(before.prompt_ids) - before.max_tokens
            assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids and 5 <= grown <= 9
    cached = sum(len(requests[i - 1].prompt_ids) // 16 * 16 for i in range(12) if i % 4)
    assert ideal_prefix_hit_rate(requests, 16) == cached / sum(len(r.prompt_ids) for r in requests)
    assert ideal_prefix_hit_rate(make_requests(WorkloadSpec.named("random"), 4, vocab=range(9)), 16) is None

    events: list[tuple[str, int]] = []

    async def send(request: BenchRequest) -> RequestRecord:
        events.append(("sent", request.index))
        await asyncio.sleep(0.01 * (request.index % 3 + 1))
        events.append(("done", request.index))
        return RequestRecord(request.index, len(request.prompt_ids), sent=0.0)

    records = asyncio.run(drive(requests, send, concurrency=3, label="test"))
    assert [record.index for record in records] == list(range(12))
    for request in requests[1:]:
        if request.index % 4:  # a later turn: sent only once the turn before it was done
            assert events.index(("done", request.index - 1)) < events.index(("sent", request.index))
    assert [kind for kind, _ in events[:3]] == ["sent"] * 3  # three sessions at once

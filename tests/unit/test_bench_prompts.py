"""The bench's text prompts: made of words that the model's tokenizer turns back into the same ids, so a
server that tokenizes text (SMG) gets the tokens another gets as ids."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from services.bench.workloads import BenchRequest, WorkloadSpec, make_requests, with_text, word_tokens


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

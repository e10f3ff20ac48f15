"""TextStream against the real SmolLM2 tokenizer (byte-level BPE): UTF-8 safe deltas, special tokens, and
priming with the prompt.

The reference for every stream is the tokenizer's own one-shot decode of the same ids, with special tokens
skipped. The `tokenizer` and `backend` fixtures are in tests/unit/conftest.py.
Texts with Chinese, Japanese, emoji and some accented letters are chosen because their characters are
split across several byte tokens, so a naive token-by-token decode would emit U+FFFD.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from services.frontend.detokenizer import PROMPT_CONTEXT, TextStream
from tests.unit.detokenizing import (
    ASCII,
    EMOJI,
    ENDOFTEXT_ID,
    EOS_ID,
    IM_START_ID,
    JAPANESE,
    LATIN,
    MIXED,
    REPLACEMENT,
    SPLIT_TEXTS,
    TEXTS,
    decode,
    encode,
    feed,
    in_context,
)

# UTF-8 safety ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_inputs_split_characters_across_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = encode(tokenizer, text)
    singles = [decode(tokenizer, [token]) for token in ids]
    assert any(REPLACEMENT in piece for piece in singles), singles
    assert decode(tokenizer, ids) == text  # the round trip itself is exact


def test_plain_inputs_do_not_split(tokenizer: PreTrainedTokenizerBase) -> None:
    for text in (ASCII, LATIN):
        assert not any(REPLACEMENT in decode(tokenizer, [token]) for token in encode(tokenizer, text))


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_is_utf8_safe_and_complete(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, text: str
) -> None:
    ids = encode(tokenizer, text)
    deltas, stream = feed(backend, ids)
    assert [d for d in deltas if REPLACEMENT in d] == []
    assert "".join(deltas) == decode(tokenizer, ids) == text
    assert stream.text == text
    assert stream.stopped == ""
    assert deltas[-1] == ""  # nothing is held back without stop strings


def test_split_character_comes_out_whole_with_its_last_token(backend: Tokenizer) -> None:
    # "世界" is five byte tokens here: 7906 (E4 B8) and 240 (96) make "世"; 178, 239, 230 make "界".
    stream = TextStream(backend, [])
    assert [stream.push([token]) for token in (7906, 240, 178, 239, 230)] == ["", "世", "", "", "界"]


@pytest.mark.parametrize("size", [2, 3, 5, 7, 1000])
@pytest.mark.parametrize("text", [MIXED, EMOJI, JAPANESE])
def test_chunk_size_does_not_change_the_text(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, text: str, size: int
) -> None:
    ids = encode(tokenizer, text)
    deltas, _ = feed(backend, ids, chunk=size)
    assert [d for d in deltas if REPLACEMENT in d] == []
    assert "".join(deltas) == text


def test_empty_push_returns_nothing(backend: Tokenizer) -> None:
    stream = TextStream(backend, [])
    assert stream.push([]) == ""
    assert stream.finish() == ""
    assert stream.text == ""


# Special tokens -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("special", [EOS_ID, IM_START_ID, ENDOFTEXT_ID])
def test_special_token_alone_gives_no_text(backend: Tokenizer, special: int) -> None:
    stream = TextStream(backend, [IM_START_ID])
    assert stream.push([special]) == ""
    assert stream.finish() == ""


def test_special_tokens_inside_the_output_are_skipped(tokenizer: PreTrainedTokenizerBase) -> None:
    backend = tokenizer.backend_tokenizer
    ids = [*encode(tokenizer, "Hi 世界"), EOS_ID, IM_START_ID, *encode(tokenizer, " there 🎉"), EOS_ID]
    deltas, _ = feed(backend, ids)
    assert "".join(deltas) == decode(tokenizer, ids) == "Hi 世界 there 🎉"
    assert all("<|" not in d for d in deltas)


# Priming with the prompt ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_text", "output_text"),
    [
        ("The capital of France is", " Paris, of course."),
        ("A long prompt with more than six tokens before the answer:", " 世界 🎉 done"),
        ("Say it in Japanese:", "こんにちは"),
        ("🎉🚀 hi", " 👍🏽!"),  # the priming window starts inside the 🎉 character
    ],
)
def test_first_token_decodes_as_in_context(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, prompt_text: str, output_text: str
) -> None:
    prompt = encode(tokenizer, prompt_text)
    output = encode(tokenizer, output_text)
    deltas, _ = feed(backend, output, prompt=prompt)
    first = next(d for d in deltas if d)
    first_whole = next(
        piece
        for n in range(1, len(output) + 1)
        if (piece := in_context(tokenizer, prompt, output[:n])) and not piece.endswith(REPLACEMENT)
    )
    assert first == first_whole
    assert "".join(deltas) == in_context(tokenizer, prompt, output) == output_text


def test_priming_window_starting_inside_a_character(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = encode(tokenizer, "🎉🚀 hi")  # 7 tokens: the last 6 start with a continuation byte of 🎉
    assert len(prompt) == PROMPT_CONTEXT + 1
    assert decode(tokenizer, prompt[-PROMPT_CONTEXT:]).startswith(REPLACEMENT)
    deltas, _ = feed(tokenizer.backend_tokenizer, encode(tokenizer, " ok 世界"), prompt=prompt)
    assert deltas[0] == " ok"
    assert "".join(deltas) == " ok 世界"


def test_chat_prompt_primes_the_stream(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> None:
    chat = [{"role": "user", "content": "Say hi"}]
    prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    output = [*encode(tokenizer, "Hi! 👋"), EOS_ID]
    deltas, _ = feed(backend, output, prompt=prompt)
    assert "".join(deltas) == in_context(tokenizer, prompt, output) == "Hi! 👋"


@pytest.mark.parametrize("cut", [5, 7, 11])
def test_prompt_ending_inside_a_character(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, cut: int
) -> None:
    # prompt_token_ids may end in the middle of a character (a continuation of an output cut at max_tokens,
    # say). Priming DecodeStream with that whole prefix would re-emit prompt text or a stray U+FFFD once the
    # character completes; the output must start with the completed character and never repeat what the
    # prompt showed.
    ids = encode(tokenizer, "héllo 世界 🎉")
    prompt, output = ids[:cut], ids[cut:]
    shown = decode(tokenizer, prompt)
    assert shown.endswith(REPLACEMENT)  # the prompt really ends inside a character
    expected = decode(tokenizer, ids)[len(shown.rstrip(REPLACEMENT)) :]
    deltas, _ = feed(backend, output, prompt=prompt)
    assert "".join(deltas) == expected

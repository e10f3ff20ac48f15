"""TextStream against the real SmolLM2 tokenizer when the output ends inside a character: finish() flushes
the bytes DecodeStream held, with U+FFFD wherever the tokenizer's decode puts it.

The reference for every stream is the tokenizer's own one-shot decode of the same ids, with special tokens
skipped. The `tokenizer` and `backend` fixtures are in tests/unit/conftest.py.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, pre_tokenizers
from transformers import PreTrainedTokenizerBase

from services.frontend.detokenizer import TextStream
from tests.unit.detokenizing import (
    ENDOFTEXT_ID,
    EOS_ID,
    IM_START_ID,
    REPLACEMENT,
    assert_stopped_before,
    chunks,
    decode,
    encode,
    feed,
    in_context,
)

# Output that ends inside a character ----------------------------------------------------------------------
# A request can finish (max_tokens, a stop token, an abort) after only some of a character's bytes.
# DecodeStream yields nothing for those bytes, so finish() has to flush them: the text must still be the
# tokenizer's decode of the output, with U+FFFD wherever the decode puts it.

LEAD_E4 = 175  # the byte-level token of the lone byte E4 ('ä' in the ByteLevel alphabet): 世's first byte
LEAD_F0 = 187  # the lone byte F0 ('ð'): the first byte of every emoji here

UNFINISHED = [
    [LEAD_F0],  # one lead byte
    [7906],  # E4 B8: two of 世's three bytes in one token
    [10813, 232],  # F0 9F, 8E: three of 🎉's four bytes
    [LEAD_E4, LEAD_E4, LEAD_E4],  # lead bytes whose continuations never come
    [7906, 240, 178],  # 世, then the first byte of 界
    [7906, 240, 178, 239],  # 世, then two bytes of 界
    [10813, 232, 227, 10813],  # 🎉, then two bytes of 🚀
    [7906, EOS_ID],  # the stop token right after an unfinished character
    [10813, 232, IM_START_ID, 178, 239],  # a special token inside the unfinished tail
]


def byte_tokens(backend: Tokenizer) -> list[int]:
    """The ids of the single-byte tokens of the ByteLevel alphabet (a few bytes have none in SmolLM2)."""
    ids = (backend.token_to_id(char) for char in pre_tokenizers.ByteLevel.alphabet())
    return sorted(token for token in ids if token is not None)


def test_unfinished_outputs_really_end_inside_a_character(tokenizer: PreTrainedTokenizerBase) -> None:
    assert [decode(tokenizer, [token]) for token in (LEAD_E4, LEAD_F0)] == [REPLACEMENT, REPLACEMENT]
    for ids in UNFINISHED:
        assert decode(tokenizer, ids).endswith(REPLACEMENT), ids


@pytest.mark.parametrize("stop", [(), ("zzz",), ("界!", "世界 and more")], ids=["none", "short", "long"])
@pytest.mark.parametrize("size", [1, 2, 1000])
@pytest.mark.parametrize("ids", UNFINISHED, ids=str)
def test_finish_flushes_an_unfinished_character(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, ids: list[int], size: int, stop: tuple[str, ...]
) -> None:
    deltas, stream = feed(backend, ids, stop=stop, chunk=size)
    assert "".join(deltas) == decode(tokenizer, ids) == stream.text
    assert deltas[-1].endswith(REPLACEMENT)  # what only the flush could give
    assert all(REPLACEMENT not in d for d in deltas[:-1])  # mid-stream deltas never split a character
    assert stream.stopped == ""
    assert stream.finish() == ""  # a second finish has nothing left


def test_text_then_an_unfinished_character(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> None:
    ids = [*encode(tokenizer, "Hi 世界"), LEAD_F0]
    stream = TextStream(backend, [])
    pushed = "".join(stream.push([token]) for token in ids)
    assert pushed == "Hi 世界"
    assert stream.finish() == REPLACEMENT
    assert stream.text == decode(tokenizer, ids) == "Hi 世界" + REPLACEMENT


def test_unfinished_character_after_the_prompt(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer
) -> None:
    prompt = encode(tokenizer, "Say it in Chinese:")
    output = [*encode(tokenizer, " 世"), 178]  # ' 世', then the first byte of 界
    deltas, _ = feed(backend, output, prompt=prompt)
    assert "".join(deltas) == in_context(tokenizer, prompt, output) == " 世" + REPLACEMENT


@pytest.mark.parametrize(
    ("output", "expected"), [([], ""), ([232], REPLACEMENT), ([232, 227, 187], "🎉\ufffd")]
)
def test_prompt_ending_inside_a_character_then_output_ending_inside_one(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, output: list[int], expected: str
) -> None:
    # The prompt ends with the first token of ' 🎉' (' ' and F0 9F); the output has one more of its bytes,
    # or all and then a lone lead byte. As in test_prompt_ending_inside_a_character, the output owns the
    # character the prompt left unfinished; an output of no tokens has no text.
    prompt = encode(tokenizer, "héllo 🎉")[:-2]
    shown = decode(tokenizer, prompt)
    assert shown == "héllo " + REPLACEMENT
    if output:
        assert decode(tokenizer, [*prompt, *output])[len(shown) - 1 :] == expected
    deltas, _ = feed(backend, output, prompt=prompt)
    assert "".join(deltas) == expected


def test_an_unfinished_character_after_a_stop_string_never_comes_out(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer
) -> None:
    ids = [*encode(tokenizer, "Hi 世界"), LEAD_F0]
    deltas, stream = feed(backend, ids, stop=["界"])
    assert_stopped_before(deltas, stream, ["界"], "Hi 世")


def test_a_stop_string_in_the_flushed_text_still_cuts_it(backend: Tokenizer) -> None:
    deltas, stream = feed(backend, [7906, 240, LEAD_E4], stop=[REPLACEMENT])
    assert_stopped_before(deltas, stream, [REPLACEMENT], "世")


@pytest.mark.parametrize("stop", [(), ("<never>",)])
def test_random_byte_tokens_come_out_as_the_tokenizer_decodes_them(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, stop: tuple[str, ...]
) -> None:
    # Random bytes make every kind of malformed UTF-8: lone lead bytes, stray continuation bytes, overlong and
    # truncated sequences. Whatever the bytes and however they are chunked, the deltas add up to the decode.
    rng = random.Random(1234)
    pool = [*byte_tokens(backend), 7906, 240, 10813, 18645, 48392, EOS_ID, IM_START_ID, ENDOFTEXT_ID]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        expected = decode(tokenizer, ids)
        assert not any(s in expected for s in stop)
        stream = TextStream(backend, [], stop)
        so_far = ""
        for part in chunks(ids, rng.randint(1, 4)):
            so_far += stream.push(part)
            assert expected.startswith(so_far), ids
        assert so_far + stream.finish() == expected, ids
        assert stream.stopped == ""

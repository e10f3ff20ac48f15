"""TextStream's stop strings against the real SmolLM2 tokenizer: cut before, never emitted, the earliest
wins whatever the chunking, and a held-back prefix is released at finish.

The reference for every stream is the tokenizer's own one-shot decode of the same ids, with special tokens
skipped. The `tokenizer` and `backend` fixtures are in tests/unit/conftest.py.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from services.frontend.detokenizer import TextStream
from tests.unit.detokenizing import EMOJI, MIXED, assert_stopped_before, decode, encode, feed

# Stop strings ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        # one token
        ("Hello, world! Goodbye, world!", "!", "Hello, world"),
        # several tokens: ',' + ' world'
        ("Hello, world! Goodbye, world!", ", world", "Hello"),
        # several tokens, starting inside one: 'bye' + ',' + ' world'
        ("Hello, world! Goodbye, world!", "ye, wor", "Hello, world! Goodb"),
        # multi-byte stops whose characters are split across byte tokens
        (MIXED, "世界", "héllo "),
        (MIXED, "🎉", "héllo 世界 "),
        (MIXED, "こんにちは", "héllo 世界 🎉 naïve "),
        (MIXED, "ï", "héllo 世界 🎉 na"),
        (EMOJI, "👍🏽", "🎉🚀"),
        # at the very start
        (MIXED, "hé", ""),
    ],
)
@pytest.mark.parametrize("size", [1, 2, 3, 1000])
def test_stop_string_is_cut_before_and_never_emitted(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, text: str, stop: str, expected: str, size: int
) -> None:
    deltas, stream = feed(backend, encode(tokenizer, text), stop=[stop], chunk=size)
    assert_stopped_before(deltas, stream, [stop], expected)


@pytest.mark.parametrize("stop", [("Goodbye", "world"), ("world", "Goodbye")])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_earliest_of_two_stop_strings_wins(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, stop: tuple[str, str], size: int
) -> None:
    ids = encode(tokenizer, "Hello, world! Goodbye, world!")
    deltas, stream = feed(backend, ids, stop=stop, chunk=size)
    assert_stopped_before(deltas, stream, stop, "Hello, ")


def test_nothing_comes_out_after_a_stop(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> None:
    ids = encode(tokenizer, "Hello, world! Goodbye")
    stream = TextStream(backend, [], ["!"])
    out = [stream.push([token]) for token in ids]
    assert "".join(out) == "Hello, world"
    assert stream.stopped == "!"  # the stop string found
    assert stream.push(encode(tokenizer, " more text")) == ""
    assert stream.finish() == ""
    assert stream.text == "Hello, world"


def test_prefix_of_a_stop_string_is_held_then_released_at_finish(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer
) -> None:
    ids = encode(tokenizer, "Say Hello wor")  # 'Say', ' Hello', ' wor'
    stream = TextStream(backend, [], ["world!"])  # holds back len("world!") - 1 = 5 characters
    pushed = [stream.push([token]) for token in ids]
    assert pushed == ["", "Say ", "Hell"]
    assert stream.text == "Say Hell"
    assert stream.finish() == "o wor"
    assert stream.stopped == ""
    assert stream.text == "Say Hello wor"


def test_multibyte_prefix_of_a_stop_string_is_released_at_finish(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer
) -> None:
    ids = encode(tokenizer, "héllo 世界 🎉")
    deltas, stream = feed(backend, ids, stop=["🎉🚀"])
    assert "".join(deltas[:-1]) == "héllo 世界 "
    assert deltas[-1] == "🎉"
    assert stream.stopped == ""


def test_without_stop_strings_every_push_returns_all_it_can(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer
) -> None:
    ids = encode(tokenizer, "Hello, world! Goodbye, world!")
    stream = TextStream(backend, [])
    assert [stream.push([token]) for token in ids] == [decode(tokenizer, [token]) for token in ids]
    assert stream.finish() == ""


def test_empty_stop_strings_are_ignored(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> None:
    ids = encode(tokenizer, "Hello, world!")
    stream = TextStream(backend, [], ["", ""])
    assert [stream.push([token]) for token in ids] == ["Hello", ",", " world", "!"]
    assert stream.stopped == ""


def test_overlapping_stops_do_not_depend_on_chunking(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer
) -> None:
    # When one push completes several stop strings, the one completed first wins, as token by token: "d"
    # completes at "abcd" (text "abc") before "bcd ab", although "bcd ab" starts earlier. Otherwise the same
    # tokens would give different text depending on how the worker batched them.
    ids = encode(tokenizer, "abcd abcd")  # 'ab', 'cd', ' ab', 'cd'
    stop = ["bcd ab", "d"]
    one_by_one, _ = feed(backend, ids, stop=stop, chunk=1)
    assert "".join(one_by_one) == "abc"
    for size in (2, 3, 4):
        deltas, stream = feed(backend, ids, stop=stop, chunk=size)
        assert ("".join(deltas), stream.stopped) == ("abc", "d"), f"chunks of {size}"


def test_under_min_tokens_a_stop_string_counts_only_if_it_ends_after_them(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer
) -> None:
    """vLLM's rule: stop strings are looked for from min_tokens on, in the text that comes from then on. A
    short stop completed before min_tokens does not stop the request later, while the long stop held back
    its text."""
    ids = encode(tokenizer, " the cat is here. the cat sat on")
    stream = TextStream(backend, [], ["cat", "the cat sat on"], min_tokens=3)
    text = "".join(stream.push([token]) for token in ids)
    assert stream.stopped == "cat" and text == " the cat is here. the "  # the second "cat", not the first
    plain = TextStream(backend, [], ["cat", "the cat sat on"])
    assert "".join(plain.push([token]) for token in ids) == " the " and plain.stopped == "cat"

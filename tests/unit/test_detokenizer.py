"""TextStream, the frontend's detokenizer, against the real SmolLM2 tokenizer (byte-level BPE).

Sections: texts and streams (the helpers: texts whose characters are split across several byte tokens, and
ways to stream them); UTF-8 safety; special tokens; priming with the prompt; stop strings (cut before,
never emitted, the earliest wins whatever the chunking, a held-back prefix released at finish); and output
that ends inside a character (finish() flushes the bytes DecodeStream held, with U+FFFD wherever the
tokenizer's decode puts it).

The reference for every stream is the tokenizer's own one-shot decode of the same ids, with special tokens
skipped. The `tokenizer` and `backend` fixtures are in tests/unit/conftest.py.
Texts with Chinese, Japanese, emoji and some accented letters are chosen because their characters are
split across several byte tokens, so a naive token-by-token decode would emit U+FFFD.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import pytest
from tokenizers import Tokenizer, pre_tokenizers
from transformers import PreTrainedTokenizerBase

from services.frontend.detokenizer import PROMPT_CONTEXT, TextStream

# Texts and streams ----------------------------------------------------------------------------------------

REPLACEMENT = "\ufffd"
EOS_ID = 2  # <|im_end|>
IM_START_ID = 1  # <|im_start|>
ENDOFTEXT_ID = 0  # <|endoftext|>

ASCII = "Hello, world! This is plain ASCII text."
LATIN = "Zürich façade, crème brûlée, naïve résumé"
LATIN_SPLIT = "Ångström Øresund Łódź señor"  # Å, Ø, Ł and ź are split across tokens
CHINESE = "你好\uff0c世界\uff01机器学习很有趣。"  # with a full-width comma and exclamation mark
JAPANESE = "こんにちは、世界。ありがとう"
EMOJI = "🎉🚀👍🏽 party 👨\u200d👩\u200d👧"
MIXED = "héllo 世界 🎉 naïve こんにちは"

TEXTS = [ASCII, LATIN, LATIN_SPLIT, CHINESE, JAPANESE, EMOJI, MIXED]
SPLIT_TEXTS = [LATIN_SPLIT, CHINESE, JAPANESE, EMOJI, MIXED]


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def chunks(ids: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])


def feed(
    backend: Tokenizer,
    ids: Sequence[int],
    *,
    prompt: Sequence[int] = (),
    stop: Sequence[str] = (),
    chunk: int = 1,
) -> tuple[list[str], TextStream]:
    """Push ids in chunks of `chunk`, then finish; return every delta (finish's last) and the stream."""
    stream = TextStream(backend, prompt, stop)
    deltas = [stream.push(part) for part in chunks(ids, chunk)]
    deltas.append(stream.finish())
    return deltas, stream


def assert_stopped_before(deltas: list[str], stream: TextStream, stop: Sequence[str], expected: str) -> None:
    total = "".join(deltas)
    assert total == expected
    assert stream.text == expected
    assert stream.stopped in stop
    for s in stop:
        assert all(s not in d for d in deltas)
        assert s not in total


def in_context(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[int], output: Sequence[int]) -> str:
    """The output's text as a one-shot decode of prompt + output shows it."""
    whole = decode(tokenizer, [*prompt, *output])
    before = decode(tokenizer, prompt)
    assert whole.startswith(before)
    return whole[len(before) :]


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

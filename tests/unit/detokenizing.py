"""For the TextStream tests: texts whose characters are split across several byte tokens of the SmolLM2
tokenizer (byte-level BPE), so a naive token-by-token decode would emit U+FFFD, and ways to stream them.

The reference for every stream is the tokenizer's own one-shot decode of the same ids, with special tokens
skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from services.frontend.detokenizer import TextStream

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

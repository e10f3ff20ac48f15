"""Incremental detokenization: UTF-8 safe text deltas, with stop strings held back and never emitted.

tokenizers' DecodeStream yields a piece of text only once the bytes of a character are complete, so a
multi-byte character split across tokens never comes out half. It is primed with the end of the prompt, so
that the first generated token decodes as it would in context (a leading space, say); when the prompt ends
inside a character, the decoder is primed up to the last whole character and fed the rest, and what the
prompt already showed of that character is not repeated. The last len(longest stop string) - 1 characters
stay held back until they can no longer begin a stop string; when several stop strings appear, the one
completed first wins, as it would token by token. When the request ends inside a character (max_tokens, a
stop token or an abort after some of its bytes), finish() flushes the tokens DecodeStream still holds, decoded
in context as it would decode them (U+FFFD where the tokenizer puts it), so that the deltas always add up to
the tokenizer's decode of the output. Under min_tokens, stop strings are looked for only once that many
tokens are out, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 6  # prompt tokens that prime the decoder


class TextStream:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (), min_tokens: int = 0
    ) -> None:
        self._tokenizer = tokenizer
        window = list(prompt_ids[-PROMPT_CONTEXT:])
        self._decoder, whole, self._shown = self._primed(window)
        self._context = window[:whole]  # the last tokens up to the decoder's last piece
        self._pending = window[whole:]  # tokens fed since: bytes of an unfinished character, special tokens
        self._from_prompt = len(self._pending)  # how many of those the prompt gave, not the output
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # everything decoded so far
        self._emitted = 0  # how much of it has gone out
        self.stopped = ""  # the stop string found, if any; the text ends before it
        self._unchecked = min_tokens  # tokens to come before stop strings count (min_tokens)

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def push(self, token_ids: Sequence[int]) -> str:
        """Decode new tokens; return the text that is safe to emit now."""
        if self.stopped:
            return ""
        before = len(self._text)
        for token_id in token_ids:
            self._pending.append(token_id)
            piece = self._decoder.step(self._tokenizer, token_id)
            if piece:
                self._context = [*self._context, *self._pending][-PROMPT_CONTEXT:]
                self._pending, self._from_prompt = [], 0
                self._add(piece)
        self._unchecked -= len(token_ids)
        if self._cut_at_stop(before):
            return self._release(len(self._text))
        return self._release(len(self._text) - self._hold)

    def finish(self) -> str:
        """The request is over: flush the bytes of an unfinished character, and release what was held back."""
        if len(self._pending) > self._from_prompt and not self.stopped:
            before = len(self._text)
            context = self._decode(self._context)
            self._add(self._decode(self._context + self._pending)[len(context) :])
            self._pending, self._from_prompt = [], 0
            self._cut_at_stop(before)
        return self._release(len(self._text))

    def _add(self, piece: str) -> None:
        skipped = min(self._shown, len(piece))  # what the prompt already showed of its unfinished character
        self._shown -= skipped
        self._text += piece[skipped:]

    def _cut_at_stop(self, before: int) -> bool:
        """Cut the text before the stop string completed first, if any; whether one was found. Only a stop
        string that ends in the text added since `before` counts: one that ended earlier was found then, or
        came before min_tokens."""
        if self._unchecked > 0:
            return False
        found = [
            (i + len(s), i, s)
            for s in self._stop
            if (i := self._text.find(s, max(self._emitted, before - len(s) + 1))) >= 0
        ]
        if found:
            _, start, self.stopped = min(found)
            self._text = self._text[:start]
        return bool(found)

    def _primed(self, window: list[int]) -> tuple[DecodeStream, int, int]:
        """A decoder primed with the prompt's last tokens, how many of them end in a whole character, and
        how many characters of a character the prompt left unfinished were already shown (a leading space)."""
        whole = len(window)
        while whole and self._decode(window[:whole]).endswith("\ufffd"):
            whole -= 1
        decoder = DecodeStream(window[:whole], skip_special_tokens=True)
        for token_id in window[whole:]:
            decoder.step(self._tokenizer, token_id)  # bytes of an unfinished character: nothing comes out
        shown = len(self._decode(window).rstrip("\ufffd")) - len(self._decode(window[:whole]))
        return decoder, whole, shown

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

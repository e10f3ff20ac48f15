"""Chat messages to token ids through the model's chat template, with what a user wrote kept as text.

The template's own special tokens (the turn markers) are tokens; a message's content is text, even when it
spells a special token: "<|im_end|><|im_start|>system" typed into a user message must not open a system
turn. The template is rendered to a string as transformers renders it. When no message holds the text of a
special token (nearly always), that string is tokenized as transformers' apply_chat_template would, so the
ids are exactly the same. Otherwise the template is rendered again with a random mark in place of each such
content (less the whitespace around it, which a template may trim): the marks, not a search for the text,
say where the contents are, since a content may spell the template's own markers that come before it. The
contents are tokenized with special tokens read as plain text, the template's text around them as usual. A
template that treats such a content as more than text to copy (it changes it, repeats it or tests it), so
that putting the contents in for the marks does not give the first rendering, is refused.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence

from jinja2 import TemplateError
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.v1 import generation_pb2

ROLES = ("system", "user", "assistant", "tool")


class ChatRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        backend: Tokenizer = tokenizer.backend_tokenizer
        added = backend.get_added_tokens_decoder().values()
        self._specials = tuple(token.content for token in added if token.special)
        self._plain = Tokenizer.from_str(
            backend.to_str()
        )  # a copy: the setting below is the tokenizer's state
        self._plain.encode_special_tokens = True

    def ids(self, messages: Sequence[generation_pb2.ChatMessage]) -> list[int]:
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role is {message.role!r}; it must be one of {', '.join(ROLES)}"
                )
        if self.tokenizer.chat_template is None:
            raise InvalidArgument("this model has no chat template; send a prompt instead of messages")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        rendered = self._render(chat)
        literal = [i for i, m in enumerate(messages) if any(token in m.content for token in self._specials)]
        if not literal:
            return self._tokens(rendered)
        # One random word for this call, in private-use characters that no template's markers use.
        nonce = secrets.token_hex(16)
        contents: dict[str, str] = {}  # by the mark that stands for it
        for i in literal:
            content = chat[i]["content"]
            core = content.strip()
            mark = f"\ue000{nonce}-{i}\ue001"
            start = content.index(core)
            chat[i] = {**chat[i], "content": content[:start] + mark + content[start + len(core) :]}
            contents[mark] = core
        marked = self._render(chat)
        marks = re.compile(f"\ue000{nonce}-\\d+\ue001")
        found = marks.findall(marked)
        if sorted(found) != sorted(contents) or marks.sub(lambda m: contents[m[0]], marked) != rendered:
            raise InvalidArgument(
                "a message holds the text of a special token, and the model's chat template changes that "
                "message; remove the special token's text from it"
            )
        ids: list[int] = []
        cursor = 0
        for found_mark in marks.finditer(marked):
            ids += self._tokens(marked[cursor : found_mark.start()])
            ids += self._plain.encode(contents[found_mark[0]], add_special_tokens=False).ids
            cursor = found_mark.end()
        return ids + self._tokens(marked[cursor:])

    def _render(self, chat: list[dict[str, str]]) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        except TemplateError as exc:
            raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from None

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

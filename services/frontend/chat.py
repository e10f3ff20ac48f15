"""Chat messages to token ids through the model's chat template, with what a user wrote kept as text.

The template's own special tokens (the turn markers) are tokens; a message's content is text, even when it
spells a special token: "<|im_end|><|im_start|>system" typed into a user message must not open a system
turn. The template is rendered to a string as transformers renders it. When no message holds the text of a
special token (nearly always), that string is tokenized as transformers' apply_chat_template would, so the
ids are exactly the same; otherwise the contents that do are found in the rendered string, in order, and
tokenized with special tokens read as plain text, while the template's text around them is tokenized as
usual. A template that rewrites such a content, so that it cannot be found, is refused.
"""

from __future__ import annotations

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
        try:
            rendered = str(
                self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            )
        except TemplateError as exc:
            raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from None
        literal = [m.content for m in messages if any(special in m.content for special in self._specials)]
        if not literal:
            return self._tokens(rendered)
        ids: list[int] = []
        cursor = 0
        for content in literal:
            start = rendered.find(content, cursor)
            if start < 0:
                raise InvalidArgument(
                    "a message holds the text of a special token, and the model's chat template changes that "
                    "message; remove the special token's text from it"
                )
            ids += self._tokens(rendered[cursor:start])
            ids += self._plain.encode(content, add_special_tokens=False).ids
            cursor = start + len(content)
        return ids + self._tokens(rendered[cursor:])

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

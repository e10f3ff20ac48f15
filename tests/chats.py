"""Where a chat's special tokens are: at the template's own markers, never where a message's content spells
one."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


def specials(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    return {i: token.content for i, token in tokenizer.added_tokens_decoder.items() if token.special}


def shown(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """ids as text, each special token in brackets."""
    special = specials(tokenizer)
    return "".join(f"[{special[i]}]" if i in special else tokenizer.decode([i]) for i in ids)


def expected_shown(tokenizer: PreTrainedTokenizerBase, chat: Sequence[tuple[str, str]]) -> str:
    """The chat as the template renders it, the template's special tokens in brackets and the contents as
    they are (their special tokens' text too)."""
    stand_ins = [{"role": role, "content": f"\x00{i}\x00"} for i, (role, _) in enumerate(chat)]
    text = str(tokenizer.apply_chat_template(stand_ins, add_generation_prompt=True, tokenize=False))
    for special in specials(tokenizer).values():
        text = text.replace(special, f"[{special}]")
    for i, (_, content) in enumerate(chat):
        text = text.replace(f"\x00{i}\x00", content)
    return text

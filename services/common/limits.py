"""The checks on a request that the frontend and the worker both make, so that one condition gets one
status and one message wherever it is found."""

from __future__ import annotations

from pagedserve.plumbing.errors import ResourceExhausted


def check_prompt_fits(prompt_tokens: int, max_model_len: int) -> int:
    """Raise ResourceExhausted for a prompt that leaves no room in the context; return the room left."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ResourceExhausted(
            f"the prompt has {prompt_tokens} tokens, but the model's context is {max_model_len} tokens "
            "and at least one must be left to generate; shorten the prompt"
        )
    return room

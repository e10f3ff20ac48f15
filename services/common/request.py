"""One request as an engine runs it, and the checks on it that the frontend and the worker both make.

The frontend builds an `EngineRequest` once, from a public request it has checked and tokenized; the Worker
contract carries it (`wire.submit_pb` and `wire.request_from_pb`, the one place it is converted); the worker
builds its engine's sequence from it. Both ends check it with `check_request`, so that one condition gets one
status and one message wherever it is found: a frontend refuses what a worker would, and a worker refuses the
same way a request that did not come through a frontend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.plumbing.errors import InvalidArgument, ResourceExhausted
from pagedserve.plumbing.pin_limits import check_tenant, check_ttl
from services.common.sampling import SamplingOptions

# A prompt's text may be at most this many characters a token of the model's context: a bound checked before
# any tokenizer runs, generous for real text (about 4 characters a token), so that megabytes of text cost
# microseconds to refuse, not seconds and gigabytes to tokenize.
CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the model's, as its workers report them."""

    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: tuple[int, ...]
    options: SamplingOptions
    priority: int = 0  # lower runs first
    cache_salt: str = ""  # the prefix cache's namespace: only requests with the same salt share pages
    follows: str = ""  # the id of an earlier sample of the same prompt, whose prefill this one waits for
    generated: tuple[int, ...] = ()  # tokens it generated already elsewhere (on a worker that failed)
    cache_ttl_seconds: int = 0  # pin its pages in the prefix cache this long after it ends
    tenant: str = ""  # whose pin budget pays for them


def check_request(request: EngineRequest, limits: ModelLimits) -> None:
    """Raise InvalidArgument for a request this model cannot run, ResourceExhausted for one too long. The
    order is the frontend's: sizes first, then the vocabulary, so a request wrong in two ways is refused for
    the same one at either end."""
    if not request.prompt_ids:
        raise InvalidArgument("the prompt is empty")
    check_prompt_fits(len(request.prompt_ids) + len(request.generated), limits.max_model_len)
    options = request.options
    if len(request.generated) >= options.max_tokens:
        raise InvalidArgument(f"{len(request.generated)} tokens generated already: max_tokens is reached")
    check_token_ids("prompt_token_ids", request.prompt_ids, limits.vocab_size)
    check_token_ids("generated_token_ids", request.generated, limits.vocab_size)
    check_token_ids("sampling.stop_token_ids", options.stop_token_ids, limits.vocab_size)
    check_token_ids("sampling.logit_bias", [token for token, _ in options.logit_bias], limits.vocab_size)
    if request.cache_ttl_seconds:
        check_ttl(request.cache_ttl_seconds)
        check_tenant(request.tenant)


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise InvalidArgument for a token id outside the vocabulary."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):  # in C: 1M ids take ms
        return
    bad = next(token for token in token_ids if not 0 <= token < vocab_size)
    raise InvalidArgument(f"{field} holds {bad}, which is not a token of this model (0..{vocab_size - 1})")


def check_prompt_fits(prompt_tokens: int, max_model_len: int) -> int:
    """Raise ResourceExhausted for a prompt that leaves no room in the context; return the room left."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ResourceExhausted(
            f"the prompt has {prompt_tokens} tokens, but the model's context is {max_model_len} tokens "
            "and at least one must be left to generate; shorten the prompt"
        )
    return room


def check_text_fits(chars: int, limits: ModelLimits) -> None:
    """Refuse, before tokenizing, a text that cannot fit the context by its length alone."""
    most = limits.max_model_len * CHARS_PER_TOKEN
    if chars > most:
        raise ResourceExhausted(
            f"the prompt has {chars} characters, but the model's context is {limits.max_model_len} tokens, "
            f"which takes at most {most} characters ({CHARS_PER_TOKEN} a token); shorten the prompt"
        )

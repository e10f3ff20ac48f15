"""Structured outputs: what a request's output must match, checked before any grammar is compiled.

The worker compiles a constraint into a grammar (`services.worker.core.grammar`) and masks each step's
logits with it; here are only the checks that need no compiler, so that the frontend can refuse a schema that
is not JSON, or an empty choice, before the request is admitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pagedserve.plumbing.errors import InvalidArgument

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_TEXT_BYTES = 64 * 1024  # a schema, regex or grammar
MAX_CHOICES = 256
MAX_CHOICE_BYTES = 1024


@dataclass(frozen=True)
class Constraint:
    kind: Kind
    text: str = ""  # the JSON schema, regex or grammar
    choices: tuple[str, ...] = ()  # for a choice

    def __post_init__(self) -> None:
        field = f"sampling.structured.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidArgument(f"sampling.structured has no kind {self.kind!r}; use one of {KINDS}")
        if self.kind == "choice":
            _check_choices(field, self.choices)
            return
        if len(self.text.encode()) > MAX_TEXT_BYTES:
            raise InvalidArgument(f"{field} is {len(self.text.encode())} bytes; at most {MAX_TEXT_BYTES}")
        if self.kind in ("regex", "grammar") and not self.text:
            raise InvalidArgument(f"{field} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{field} is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidArgument(
                    f"{field} must be a JSON object (a schema), got {type(schema).__name__}"
                )


def _check_choices(field: str, choices: tuple[str, ...]) -> None:
    if not 0 < len(choices) <= MAX_CHOICES:
        raise InvalidArgument(f"{field} holds {len(choices)} strings; give 1 to {MAX_CHOICES}")
    for i, choice in enumerate(choices):
        if not 0 < len(choice.encode()) <= MAX_CHOICE_BYTES:
            raise InvalidArgument(f"{field}[{i}] must be 1 to {MAX_CHOICE_BYTES} bytes")
    if (total := sum(len(choice.encode()) for choice in choices)) > MAX_TEXT_BYTES:
        raise InvalidArgument(f"{field} holds {total} bytes in all; at most {MAX_TEXT_BYTES}")

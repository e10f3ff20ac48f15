"""Structured outputs in the engine: a compiled grammar per constraint, a matcher per sequence, and the masks.

xgrammar compiles a constraint against the model's tokenizer; compiled grammars are kept (least recently used
out, within CACHE_BYTES), so the same schema twice compiles once. Each constrained sequence has a matcher that
follows its tokens. Before sampling, the matchers of the batch's constrained rows fill one bitmask of the
tokens they allow, which sets every other logit to -inf. The model's end-of-sequence tokens are the grammar's
stop tokens: the mask lets them through only where the grammar may end, and a matcher that accepts one is
terminated, which finishes the sequence (`ignore_eos` cannot keep a finished grammar going).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagedserve.plumbing.errors import InvalidArgument
from services.common.structured import Constraint

CACHE_BYTES = 512 * 2**20  # compiled grammars kept, by their size (a large choice takes tens of MB)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill(self, masks: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(masks, row)

    def accept(self, token_id: int) -> bool:
        """Advance past token_id; False if the grammar does not allow it (the mask was not applied)."""
        return bool(self._matcher.accept_token(token_id))

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of tokens, from the first, the grammar allows from here, short of a token that ends it;
        its place does not move."""
        count = 0
        while count < len(tokens) and self.accept(tokens[count]):
            count += 1
            if self._matcher.is_terminated():  # no row may follow an end: the row before it draws it
                self._matcher.rollback(count)
                return count - 1
        self._matcher.rollback(count)
        return count

    def fill_along(self, masks: torch.Tensor, row: int, draft: Sequence[int]) -> None:
        """Fill rows row .. row + len(draft) with the tokens allowed here and after each of draft's tokens
        (which `allows`); its place does not move."""
        for offset, token_id in enumerate(draft):
            self.fill(masks, row + offset)
            self.accept(token_id)
        self.fill(masks, row + len(draft))
        self._matcher.rollback(len(draft))

    @property
    def terminated(self) -> bool:
        """The grammar has ended and accepted a stop token: nothing may follow."""
        return bool(self._matcher.is_terminated())


class Grammars:
    """Compiles constraints for one model's tokenizer; safe to call from any thread."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0  # the kept grammars' size
        self.on_compile: Callable[[float], None] | None = None  # the seconds of each compile, failed or not
        # One thread: a schema that takes seconds to compile holds up neither the engine's steps nor the
        # requests without one.
        self._compiling = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def state(self, constraint: Constraint) -> GrammarState:
        """A new sequence's matcher; InvalidArgument with the compiler's message if it cannot compile."""
        return GrammarState(self.compiled(constraint))

    def state_later(self, constraint: Constraint) -> Future[GrammarState]:
        """A new sequence's matcher, compiled on the compiler's thread (at once when it is cached). It never
        waits for a compile: it runs on the worker's event loop, which must keep serving meanwhile."""
        compiled = self._cached(constraint)
        if compiled is None:
            return self._compiling.submit(self.state, constraint)
        ready: Future[GrammarState] = Future()
        ready.set_result(GrammarState(compiled))
        return ready

    def compiled(self, constraint: Constraint) -> xgr.CompiledGrammar:
        cached = self._cached(constraint)
        if cached is not None:
            return cached
        started = time.perf_counter()
        try:
            # Outside the lock: a schema may take a minute, and the lock guards only the cache.
            compiled = self._compile(constraint)
        except RuntimeError as exc:  # xgrammar's message ends with what it could not parse
            raise InvalidArgument(
                f"sampling.structured.{constraint.kind} does not compile: {_reason(exc)}"
            ) from None
        finally:
            if self.on_compile is not None:
                self.on_compile(time.perf_counter() - started)
        with self._lock:
            if constraint not in self._compiled:  # another thread may have compiled it meanwhile
                self._compiled[constraint] = compiled
                self._bytes += compiled.memory_size_bytes
                while self._bytes > CACHE_BYTES and len(self._compiled) > 1:
                    self._bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _cached(self, constraint: Constraint) -> xgr.CompiledGrammar | None:
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
            return compiled

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        # JSON without free whitespace, in which small models loop.
        if constraint.kind == "json_schema":
            return self._compiler.compile_json_schema(constraint.text, any_whitespace=False)
        if constraint.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if constraint.kind == "regex":
            return self._compiler.compile_regex(constraint.text)
        if constraint.kind == "grammar":
            return self._compiler.compile_grammar(constraint.text)
        # A choice: a grammar of string literals, which JSON's escapes spell as the EBNF reads them; other
        # characters stay as they are (EBNF would read a surrogate pair as two characters).
        return self._compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in constraint.choices)
        )


def fill_masks(
    states: Sequence[GrammarState | None], vocab_size: int, drafts: Sequence[Sequence[int]] = ()
) -> torch.Tensor | None:
    """The bitmask of the tokens each state allows (rows without a state allow all), a row per state and
    one more for each token of its draft (`GrammarState.fill_along`), if drafts are given; None when no
    state is given. It reads the states alone, so it may run while the model runs."""
    if all(state is None for state in states):
        return None
    drafts = drafts or [()] * len(states)
    masks = xgr.allocate_token_bitmask(sum(1 + len(draft) for draft in drafts), vocab_size)
    row = 0
    for state, draft in zip(states, drafts, strict=True):
        if state is not None:
            state.fill_along(masks, row, draft)
        row += 1 + len(draft)
    return masks


def mask_logits(
    logits: torch.Tensor, states: Sequence[GrammarState | None], masks: torch.Tensor | None = None
) -> list[int]:
    """Mask, in place, each row of logits [S, V] whose state is not None to the tokens its grammar allows,
    with masks from `fill_masks` if given (a draft's rows need them). Returns the rows that allow no token at
    all: their sequences can go no further."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return []
    if masks is None:
        masks = fill_masks(states, logits.shape[1])
    xgr.apply_token_bitmask_inplace(logits, masks.to(logits.device), indices=rows)  # type: ignore[union-attr]
    allowed = torch.isfinite(logits[rows]).any(dim=-1).tolist()
    return [row for row, ok in zip(rows, allowed, strict=True) if not ok]


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its C++ source location ("[time] file.cc:123: "), or a likely cause where
    it gave none."""
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    if sep and ".cc:" in head:
        text = rest
    text = text.removeprefix("Check failed: (error.empty()) is false: ")[:1000]
    # A number past float64's range (a bound of 1e400, read as infinity) fails with an empty message.
    return text or "xgrammar gave no reason; a number too large for a float64 (such as 1e400) is one cause"

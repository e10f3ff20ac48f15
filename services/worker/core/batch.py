"""Turning a step's schedule into the model's inputs: one flat batch of tokens, decodes first.

Copies between the host and the device that the host does not wait for go through pinned memory, which
torch's caching host allocator keeps from reuse until the copy is done (a copy from pageable memory may wait
for the device while the driver stages it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagedserve.kernels.backend import AttentionMetadata
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import Sequence


@dataclass(frozen=True)
class ForwardBatch:
    items: list[ScheduledSeq]  # in batch order: single-token chunks (decodes, drafted or not) first
    firsts: list[int]  # each item's first token in the batch
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metas: tuple[AttentionMetadata, ...]  # one for each group of layers: they differ in slots and tables
    # [N + P]: the rows that sample, then the scored prompt positions. A chunk that samples has one row, for
    # its last token, and one more for each draft token (the last new token's row comes first).
    logits_indices: torch.Tensor
    sampling: list[ScheduledSeq]  # the chunks that sample, in the order of their rows
    scored: list[tuple[Sequence, int]]  # P prompt positions to score: their sequence, and the next token

    @property
    def meta(self) -> AttentionMetadata:
        """Group 0's metadata: what every group's shares (lengths, positions) is read here."""
        return self.metas[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_batch(items: list[ScheduledSeq], page_size: int, device: torch.device) -> ForwardBatch:
    """The step's inputs, with the metadata of each group of the model's layers (services.worker.kv.groups),
    of which every sequence has a block table.

    Attention sees rows: a chunk is one row, and a decode with a draft (`speculation`) is a decode row for
    each of its positions, its last token's and each drafted token's, each attending to the KV up to its own
    position (which this step writes before attention reads it): each row then computes exactly what a
    plain decode at that position would."""
    ordered = sorted(items, key=lambda item: item.count != 1)  # stable: decodes first, in schedule order
    rows = [
        (item, start, count)
        for item in ordered
        for start, count in ([(p, 1) for p in item.positions] if item.draft else [(item.start, item.count)])
    ]
    groups = len(ordered[0].seq.tables)
    num_decodes = sum(count == 1 for _, _, count in rows)
    input_ids, positions, slots, firsts = _tokens(ordered, page_size, groups)
    seq_lens = [start + count for _, start, count in rows]
    query_start = list(itertools.accumulate((count for _, _, count in rows), initial=0))
    prefill = [
        (row, p)
        for row, (_, start, count) in enumerate(rows[num_decodes:], num_decodes)
        for p in range(start, start + count)
    ]
    prefill_seq, prefill_pos = [row for row, _ in prefill], [p for _, p in prefill]
    width = max(item.seq.num_pages for item in ordered)
    tables = [
        [page for item, _, _ in rows for page in item.seq.tables[group] + [0] * (width - item.seq.num_pages)]
        for group in range(groups)
    ]
    sampling = [(first, item) for first, item in zip(firsts, ordered, strict=True) if item.samples]
    scored, scored_at = _prompt_positions(ordered, firsts)
    # A sampling item's rows of logits: its last new token's, then each drafted token's.
    logits_indices = [
        token for first, item in sampling for token in range(first + item.count - 1, first + item.width)
    ]
    logits_indices += scored_at
    # One copy to the device for the whole step; each part is a view of it.
    parts = [
        input_ids,
        positions,
        seq_lens,
        query_start,
        prefill_seq,
        prefill_pos,
        logits_indices,
        *slots,
        *tables,
    ]
    flat = to_device([value for part in parts for value in part], torch.long, device)
    views = flat.split([len(part) for part in parts])
    metas = tuple(
        AttentionMetadata(
            slot_mapping=views[7 + group],
            block_tables=views[7 + groups + group].view(len(rows), width),
            seq_lens=views[2],
            query_start=views[3],
            num_decodes=num_decodes,
            seq_lens_host=tuple(seq_lens),
            query_start_host=tuple(query_start),
            prefill_seq=views[4],
            prefill_pos=views[5],
            decode_max_len=max(seq_lens[:num_decodes], default=0),
        )
        for group in range(groups)
    )
    return ForwardBatch(
        items=ordered,
        firsts=firsts,
        input_ids=views[0],
        positions=views[1],
        metas=metas,
        logits_indices=views[6],
        sampling=[item for _, item in sampling],
        scored=scored,
    )


def _tokens(
    ordered: list[ScheduledSeq], page_size: int, groups: int
) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """The items' tokens (new ones, then drafted ones), their positions, each group's slots for their KV,
    and each item's first token in the batch."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(groups)]
    firsts: list[int] = []
    for item in ordered:
        seq = item.seq
        firsts.append(len(input_ids))
        input_ids += seq.tokens[item.start : item.start + item.count]
        input_ids += item.draft
        positions += item.positions
        for group, table in enumerate(seq.tables):
            slots[group] += [table[p // page_size] * page_size + p % page_size for p in item.positions]
    return input_ids, positions, slots, firsts


def _prompt_positions(
    ordered: list[ScheduledSeq], firsts: list[int]
) -> tuple[list[tuple[Sequence, int]], list[int]]:
    """The prompt positions whose logits score the next prompt token, for sequences that asked for the
    prompt's log-probabilities, and their indices in the batch (firsts: each item's first token's). Position
    p scores token p + 1; positions scored before a preemption are not scored again."""
    scored: list[tuple[Sequence, int]] = []
    indices: list[int] = []
    for first, item in zip(firsts, ordered, strict=True):
        seq = item.seq
        if not seq.wants_prompt_logprobs:
            continue
        for position in range(
            max(item.start, len(seq.prompt_logprobs)), min(item.start + item.count, seq.prompt_len - 1)
        ):
            scored.append((seq, seq.tokens[position + 1]))
            indices.append(first + position - item.start)
    return scored, indices


def to_device(
    values: Seq[int] | Seq[float] | Seq[bool] | torch.Tensor,
    dtype: torch.dtype,
    like: torch.Tensor | torch.device,
) -> torch.Tensor:
    """values (a list, or a tensor on the host) on like's device (or on it, if a device), as dtype."""
    device = like.device if isinstance(like, torch.Tensor) else like
    pinned = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        return (host.pin_memory() if pinned else host).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
    """Copies of tensors on the host, started without waiting, and the event that marks them done (None on
    the CPU, where they are done already)."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = tuple(
        torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors
    )
    ready = torch.cuda.Event()
    ready.record()
    return host, ready

"""For the kernel tests: one engine step's attention metadata from hand-made chunks, and a model spec."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LlamaConfig

from pagedserve.kernels.backend import AttentionMetadata
from services.worker.models.spec import ModelSpec


@dataclass(frozen=True)
class Chunk:
    """One sequence's work in a step: `count` new tokens after `start` cached ones, its KV on `pages`."""

    pages: tuple[int, ...]
    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


def slots_of(pages: Sequence[int], positions: Sequence[int] | range, page_size: int) -> list[int]:
    return [pages[p // page_size] * page_size + p % page_size for p in positions]


def make_metadata(
    decodes: Sequence[Chunk],
    prefills: Sequence[Chunk],
    page_size: int,
    device: torch.device | str = "cpu",
    decode_max_len: int | None = None,
) -> AttentionMetadata:
    """The metadata of one step: the decodes (one new token each) first, then the prefill chunks."""
    assert all(chunk.count == 1 for chunk in decodes)

    def tensor(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)  # contiguous int64, as the wrappers ask

    chunks = [*decodes, *prefills]
    width = max(len(chunk.pages) for chunk in chunks)
    seq_lens = [chunk.end for chunk in chunks]
    query_start = [0, *itertools.accumulate(chunk.count for chunk in chunks)]
    prefill_rows = range(len(decodes), len(chunks))
    return AttentionMetadata(
        slot_mapping=tensor(
            [s for chunk in chunks for s in slots_of(chunk.pages, chunk.positions, page_size)]
        ),
        block_tables=tensor([[*chunk.pages] + [0] * (width - len(chunk.pages)) for chunk in chunks]),
        seq_lens=tensor(seq_lens),
        query_start=tensor(query_start),
        num_decodes=len(decodes),
        seq_lens_host=tuple(seq_lens),
        query_start_host=tuple(query_start),
        prefill_seq=tensor([row for row in prefill_rows for _ in chunks[row].positions]),
        prefill_pos=tensor([p for chunk in prefills for p in chunk.positions]),
        decode_max_len=max((c.end for c in decodes), default=0) if decode_max_len is None else decode_max_len,
    )


def llama_spec(head_dim: int, max_positions: int = 64) -> ModelSpec:
    """A one-layer Llama's spec: for the rotary table and the per-head norms."""
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=2 * head_dim,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
    )
    return ModelSpec.from_hf(config)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def generator(seed: int) -> torch.Generator:
    """A seeded CPU generator: every test draws fresh random inputs from one."""
    return torch.Generator().manual_seed(seed)

"""CUDA graphs of the decode step, for common batch sizes.

A decode-only step of S sequences replays the graph captured for the smallest size >= S, on static input
buffers: the rows past S are padding (slot -1, so their K and V are not written; the null page as their
block table). Attention is sized for the full context, so one graph serves every context length. Prefill
steps run eagerly; the largest graph is the scheduler's max_num_seqs, so no decode step is too large.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagedserve.kernels.backend import AttentionMetadata
from services.worker.core.batch import ForwardBatch
from services.worker.models import CausalLM

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture: every decode batch the scheduler makes (up to max_batch, its
    max_num_seqs) pads to one of them."""
    return sorted({size for size in BATCH_SIZES if size < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: torch.Tensor, max_batch: int, page_size: int) -> None:
        self.model = model
        self.kv = kv
        self.sizes = graph_sizes(max_batch)
        largest, device = self.sizes[-1], model.device
        self.max_len = model.spec.max_model_len
        pages = -(-self.max_len // page_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        groups = model.spec.kv_groups.count  # a slot mapping and block tables for each group of layers
        self.slot_mapping = torch.full((groups, largest), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(groups, largest, pages, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.long, device=device)
        self.rows = torch.arange(largest + 1, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool, once the first is captured

    def capture(self) -> None:
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            metas = self._metas(size)
            args = (self.input_ids[:size], self.positions[:size], metas, self.kv, self.rows[:size])
            self.model.forward(*args)  # warm up: kernels compiled and loaded outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.model.forward(*args)
            self._pool = graph.pool()
            self._graphs[size] = (graph, logits)
        log.info("captured decode graphs for batch sizes %s", self.sizes)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The logits of a decode-only batch by graph replay; None when the batch needs the eager path."""
        meta = batch.meta
        seqs = meta.num_seqs
        if (
            not self._graphs
            or meta.num_decodes != seqs
            or seqs > self.sizes[-1]
            or batch.logits_indices.shape[0] != seqs  # every row samples: a draft's rows are decodes too
        ):
            return None
        size = next(size for size in self.sizes if size >= seqs)
        width = meta.block_tables.shape[1]
        self.input_ids[:seqs].copy_(batch.input_ids)
        self.positions[:seqs].copy_(batch.positions)
        self.slot_mapping[:, seqs:size].fill_(-1)
        self.block_tables[:, :size].zero_()
        for group, group_meta in enumerate(batch.metas):
            self.slot_mapping[group, :seqs].copy_(group_meta.slot_mapping)
            self.block_tables[group, :seqs, :width].copy_(group_meta.block_tables)
        self.seq_lens[:seqs].copy_(meta.seq_lens)
        self.seq_lens[seqs:size].fill_(1)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:seqs]

    def _metas(self, size: int) -> tuple[AttentionMetadata, ...]:
        empty = self.rows[:0]
        return tuple(
            AttentionMetadata(
                slot_mapping=self.slot_mapping[group, :size],
                block_tables=self.block_tables[group, :size],
                seq_lens=self.seq_lens[:size],
                query_start=self.rows[: size + 1],
                num_decodes=size,
                seq_lens_host=(self.max_len,) * size,
                query_start_host=tuple(range(size + 1)),
                prefill_seq=empty,
                prefill_pos=empty,
                decode_max_len=self.max_len,
            )
            for group in range(len(self.slot_mapping))
        )

"""The model runner: a step's schedule in, one sampled token per finishing chunk out.

It builds the flat batch (`batch`), runs the forward pass, by CUDA graph replay where one fits (`cuda_graphs`)
and eagerly otherwise, and samples (`sampler`). It owns nothing about requests' lifecycles: the scheduler's
postprocess does the bookkeeping with what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.core.batch import build_batch
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.sampler import Samples, sample
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import Sequence
from services.worker.kv.base import KVCache
from services.worker.models import CausalLM


@dataclass(frozen=True)
class ModelOutput:
    sampled: list[Sequence]  # the sequences that got a token this step, in the order of samples
    samples: Samples
    num_tokens: int  # tokens the forward pass ran


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv = kv
        self.graphs = graphs

    def run(self, items: list[ScheduledSeq]) -> ModelOutput:
        batch = build_batch(items, self.kv.page_size, self.model.device)
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is None:  # a prefill, a batch larger than any graph, or no graphs
            logits = self.model.forward(
                batch.input_ids, batch.positions, batch.meta, self.kv.kv, batch.logits_indices
            )
        sampled = [item.seq for item in batch.sampling]
        return ModelOutput(sampled, sample(logits, sampled), batch.num_tokens)

    def rebind(self, kv: KVCache) -> None:
        """Run on another pool (the daemon came back): the graphs baked in the old pool's address."""
        self.kv = kv
        if self.graphs is not None:
            self.graphs.kv = kv.kv
            self.graphs.capture()

"""CUDA graphs of the decode step over the CUDA kernels: a replay matches the eager forward and writes
only this step's KV slots.

Needs a CUDA device and CuPy; skipped without them. The `backend` fixture is in tests/kernels/conftest.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from pathlib import Path

import pytest
import torch

from pagedserve.kernels.cupy_backend import CupyBackend
from services.common.request import EngineRequest
from services.common.sampling import SamplingOptions
from services.worker.core.batch import build_batch
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.engine import EngineCore
from services.worker.core.engine_config import EngineConfig
from services.worker.core.model_runner import StepInFlight
from services.worker.core.scheduler import ScheduledSeq
from services.worker.core.sequence import Sequence
from services.worker.kv.local import LocalKVCache
from services.worker.models import load_model
from tests.kernels.cases import DEVICE, assert_close, dtype_name, generator, randn, random_tables
from tests.models import make_model
from tests.pages import assert_pages_back

pytestmark = pytest.mark.gpu  # skipped without a CUDA device and CuPy: tests/conftest.py


# CUDA graphs --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head dim 64 over 2 KV heads, which the kernels take; a context of 2048 tokens, so that the graphs'
    # decode bound spans several partitions.
    return make_model(
        "llama",
        tmp_path_factory.mktemp("graph-model"),
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    )


def decode_item(gen: torch.Generator, key: int, length: int, pages: Seq[int], vocab: int) -> ScheduledSeq:
    """A running sequence of `length` tokens, all but the last one cached: its step is a decode."""
    tokens = torch.randint(3, vocab, (length,), generator=gen).tolist()
    seq = Sequence(key, EngineRequest(tuple(tokens), SamplingOptions()), arrival=key)
    seq.add_pages(list(pages), 1)
    seq.num_computed = length - 1  # as a running decode's
    return ScheduledSeq(seq, length - 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_decode_graphs_replay_the_eager_forward(
    backend: CupyBackend, graph_model_dir: Path, dtype: torch.dtype
) -> None:
    page_size = 16
    model = load_model(graph_model_dir, dtype=dtype, device=DEVICE, backend=backend)
    spec = model.spec
    part = backend.tuning.min_partition
    # 3 sequences run on the graph of 4 (one padding row); then 4 other sequences on the same graph.
    batches = [[part + 1, 1, 2 * part + 37], [17, spec.max_model_len, part, 3]]
    gen = generator(11)
    tables, num_pages = random_tables(gen, [n for lengths in batches for n in lengths], page_size)
    shape = (spec.num_layers, 2, num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    guard = 4096  # elements before the pool: a write to a negative slot of layer 0 lands here
    storage = randn(gen, guard + math.prod(shape), dtype=dtype)
    pool = storage[guard:].view(shape)
    storage_before = storage.clone()
    graphs = DecodeGraphs(model, pool, max_batch=4, page_size=page_size)
    graphs.capture()
    assert torch.equal(storage, storage_before), "capturing (padding rows only) wrote into the pool"

    pages = iter(tables)
    for lengths in batches:
        items = [decode_item(gen, key, n, next(pages), spec.vocab_size) for key, n in enumerate(lengths)]
        batch = build_batch(items, page_size, DEVICE)
        eager = model.forward(batch.input_ids, batch.positions, batch.metas, pool, batch.logits_indices)
        pool_before = pool.clone()

        replayed = graphs.run(batch)

        assert replayed is not None, "a decode batch within the largest graph replays"
        assert_close(replayed, eager, dtype, f"logits of the batch of lengths {lengths}")
        flat = pool.view(*shape[:2], -1, *shape[4:])  # [L, 2, P * B, Hkv, D]
        untouched = torch.ones(flat.shape[2], dtype=torch.bool, device=DEVICE)
        untouched[batch.meta.slot_mapping] = False
        assert torch.equal(flat[:, :, untouched], pool_before.view_as(flat)[:, :, untouched]), (
            "the replay wrote outside this step's slots"
        )
    assert torch.equal(storage[:guard], storage_before[:guard]), (
        "a padding row (slot -1) wrote before the pool"
    )


# A lean step ----------------------------------------------------------------------------------------------


def test_an_async_decode_step_launches_with_no_host_sync(backend: CupyBackend, graph_model_dir: Path) -> None:
    """Building a decode batch on the step in flight's tokens, the graph's replay and the draw never wait for
    the device; the tokens are those of steps run one by one."""
    model = load_model(graph_model_dir, dtype=torch.bfloat16, device=DEVICE, backend=backend)
    spec = model.spec
    shape = spec.pool_shape("bfloat16", 16)
    options = SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    gen = generator(12)
    prompts = [torch.randint(3, spec.vocab_size, (n,), generator=gen).tolist() for n in (5, 40, 130)]
    runs = {}
    for scheduling in ("off", "on"):
        kv = LocalKVCache(shape, 64, device=DEVICE)
        graphs = DecodeGraphs(model, kv.kv, max_batch=4, page_size=16)
        graphs.capture()
        engine = EngineCore(model, kv, EngineConfig(max_num_seqs=4, async_scheduling=scheduling), graphs)
        checked = no_sync_on_decodes_ahead(engine)
        for key, prompt in enumerate(prompts):
            engine.add(engine.new_sequence(key, EngineRequest(tuple(prompt), options)))
        outputs = engine.run_until_done()
        runs[scheduling] = sorted((o.key, o.token_ids, [lp.token_id for lp in o.logprobs]) for o in outputs)
        assert_pages_back(kv)
        assert (len(checked) > 10) == (scheduling == "on"), checked
    assert runs["on"] == runs["off"]


def no_sync_on_decodes_ahead(engine: EngineCore) -> list[int]:
    """Make the engine's launches of decode batches on a step in flight raise on any host sync; returns the
    list of their sizes, which grows as they run."""
    launch, checked = engine.runner.launch, []

    def strict(items: list[ScheduledSeq], number: int, previous: StepInFlight | None = None) -> StepInFlight:
        if previous is None or any(item.count != 1 for item in items):
            return launch(items, number, previous)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(items, number, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(items))

    engine.runner.launch = strict  # type: ignore[method-assign]
    return checked

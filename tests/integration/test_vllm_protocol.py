"""SMG's vLLM worker protocol (vllm.grpc.engine.VllmEngine) on a real stack's frontend, called with the
stubs of smg-grpc-proto as SMG calls it: generation token-exact with pagedserve.v1, the model and tokenizer
facts on the public port; aborts that free pages, and the node's KV events and cache flush from the memory
daemon on the gateway's own listener (--gateway-address), the only one that serves them
(tests/integration/test_control_surface.py shows the public port refusing them)."""

from __future__ import annotations

import hashlib
import io
import signal
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from tests.clients import pool_counts, wait_for_every_page
from tests.integration.streams import wait_for_idle_worker
from tests.procs import Stack, free_port, module_stack, start_stack
from tests.waiting import wait_until

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # several full pages


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with module_stack("--gateway-address", f"127.0.0.1:{free_port()}") as running:
        yield running


@pytest.fixture(scope="module")
def vllm(stack: Stack) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    """The protocol as SMG reaches it: on the gateway listener, with the node's control surface."""
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def ours(stack: Stack) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def tokens(ours: generation_pb2_grpc.GenerationStub, text: str) -> list[int]:
    return list(ours.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=True)).token_ids)


def generate(
    ids: list[int], stream: bool, request_id: str = "r", **sampling: object
) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
        stream=stream,
    )


def collect(events: Iterator[common_pb2.KvEventBatch], into: list[common_pb2.KvEventBatch]) -> None:
    """Every batch until the test cancels the stream."""
    try:
        into.extend(events)  # appends each as it comes
    except grpc.RpcError as ended:
        if ended.code() != grpc.StatusCode.CANCELLED:
            raise


def test_greedy_tokens_equal_pagedserves_own_streamed_or_not(vllm, ours) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(ours, PROMPT + "The capital of France is")
    own = ours.Complete(
        pb.GenerateRequest(
            prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=12, temperature=0, logprobs=2)
        )
    )
    (whole,) = vllm.Generate(generate(ids, False, max_tokens=12, temperature=0, logprobs=2))
    assert list(whole.complete.output_ids) == list(own.token_ids)
    assert whole.complete.finish_reason == "length" and whole.complete.completion_tokens == 12
    assert whole.complete.prompt_tokens == len(ids)
    # The second run reads the prompt's pages from the cache: the same tokens, logprobs within float error.
    assert list(whole.complete.output_logprobs.token_logprobs) == pytest.approx(
        [lp.logprob for lp in own.logprobs], abs=1e-4
    )
    assert all(len(top.token_ids) == 2 for top in whole.complete.output_logprobs.top_logprobs)
    messages = list(vllm.Generate(generate(ids, True, max_tokens=12, temperature=0)))
    chunks, (last,) = messages[:-1], messages[-1:]
    assert all(m.WhichOneof("response") == "chunk" for m in chunks)
    assert [t for m in chunks for t in m.chunk.token_ids] == list(own.token_ids)
    assert last.complete.finish_reason == "length" and last.complete.completion_tokens == 12
    assert last.complete.cached_tokens > 0  # the same prompt again: its full pages came from the cache


def test_a_stop_string_ends_the_request_and_is_named(vllm, ours) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(ours, "Count: 1, 2, 3,")
    (whole,) = vllm.Generate(generate(ids, False, max_tokens=30, temperature=0, stop=[" 6"]))
    assert whole.complete.finish_reason == "stop" and whole.complete.matched_stop_str == " 6"
    (whole,) = vllm.Generate(generate(ids, False, max_tokens=30, temperature=0, stop_token_ids=[ids[-1]]))
    assert whole.complete.finish_reason == "stop" and whole.complete.matched_token_id == ids[-1]  # "," soon


def test_n_samples_each_end_with_their_own_complete(vllm, ours) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(ours, "Once upon a time")
    messages = list(vllm.Generate(generate(ids, True, max_tokens=6, temperature=1.0, seed=3, n=3)))
    completes = sorted(m.complete.index for m in messages if m.WhichOneof("response") == "complete")
    assert completes == [0, 1, 2]
    by_index = {i: [t for m in messages if m.chunk.index == i for t in m.chunk.token_ids] for i in range(3)}
    assert all(len(t) == 6 for t in by_index.values())
    again = list(vllm.Generate(generate(ids, False, max_tokens=6, temperature=1.0, seed=3, n=3)))
    assert {
        m.complete.index: list(m.complete.output_ids) for m in again
    } == by_index  # same seed, same samples


def test_abort_ends_the_stream_and_frees_its_pages(stack: Stack, gateway, ours) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(ours, PROMPT)
    call = gateway.Generate(
        generate(ids, True, request_id="long", max_tokens=2000, ignore_eos=True, temperature=0)
    )
    first = next(call)
    assert first.chunk.token_ids
    gateway.Abort(vllm_engine_pb2.AbortRequest(request_ids=["long", "never-ran"]))
    last = list(call)[-1]
    assert last.complete.finish_reason == "abort"
    wait_for_idle_worker(stack)
    wait_for_every_page(stack.daemon_address)


def test_closing_the_stream_frees_its_pages(stack: Stack, vllm, ours) -> None:  # type: ignore[no-untyped-def]
    call = vllm.Generate(generate(tokens(ours, PROMPT), True, max_tokens=2000, ignore_eos=True))
    next(call)
    call.cancel()
    wait_for_idle_worker(stack)
    wait_for_every_page(stack.daemon_address)


def test_constraints_bias_and_prompt_logprobs_equal_pagedserves_own(vllm, ours) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(ours, "My favourite colour is")
    choice = vllm_engine_pb2.ChoiceConstraint(choices=[" red", " green", " blue"])
    (whole,) = vllm.Generate(
        generate(
            ids, False, max_tokens=8, temperature=0, choice=choice, logit_bias={2: 0.5}, prompt_logprobs=2
        )
    )
    own = ours.Complete(
        pb.GenerateRequest(
            prompt_token_ids=ids,
            sampling=pb.SamplingParams(
                max_tokens=8,
                temperature=0,
                structured=pb.StructuredOutput(
                    choice=pb.StructuredOutput.Choices(choices=list(choice.choices))
                ),
                logit_bias={2: 0.5},
                prompt_logprobs=2,
            ),
        )
    )
    assert list(whole.complete.output_ids) == list(own.token_ids) and whole.complete.finish_reason == "stop"
    scored = whole.complete.input_logprobs
    assert list(scored.token_ids) == ids and not scored.token_logprobs[0].HasField("value")  # vLLM's None
    assert [entry.value for entry in scored.token_logprobs[1:]] == pytest.approx(
        [entry.logprob for entry in own.prompt_logprobs], abs=1e-4
    )
    assert [list(top.token_ids) for top in scored.top_logprobs[1:]] == [
        [top.token_id for top in entry.top] for entry in own.prompt_logprobs
    ]


def test_what_pagedserve_does_not_do_is_refused_by_name(vllm, ours) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(ours, "Hello")
    refusals = {
        "structural tags": dict(structural_tag="{}"),
        "prompt truncation": dict(truncate_prompt_tokens=2),
    }
    for words, sampling in refusals.items():
        with pytest.raises(grpc.RpcError) as refused:
            list(vllm.Generate(generate(ids, True, **sampling)))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and words in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        vllm.Embed(vllm_engine_pb2.EmbedRequest(request_id="e"))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    for bad, words in (([10**6], "not a token"), ([5], "does not compile")):
        with pytest.raises(grpc.RpcError) as refused:
            list(vllm.Generate(generate(bad, True, regex="(" if words == "does not compile" else "")))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
    # vLLM's unsigned fields past pagedserve's signed range, and a JSON constraint turned off.
    invalid = {
        **{field: {field: 2**31} for field in ("max_tokens", "top_k", "min_tokens", "n")},
        "json_object": {"json_object": False},
    }
    for field, sampling in invalid.items():
        with pytest.raises(grpc.RpcError) as refused:
            list(vllm.Generate(generate(ids, True, **sampling)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert f"sampling_params.{field} is " in refused.value.details()
    # pagedserve's own checks, as they name the fields of the vLLM request sent.
    named = [
        (
            "sampling_params.temperature must be a finite number",
            generate(ids, True, temperature=float("nan")),
        ),
        ("sampling_params.stop_token_ids holds", generate(ids, True, stop_token_ids=[10**6])),
        ("sampling_params.regex does not compile", generate(ids, True, regex="(")),
        ("tokenized.input_ids holds", generate([10**6], True)),
        ("set tokenized.input_ids or text", generate([], True)),
        ("set tokenized.input_ids or text", vllm_engine_pb2.GenerateRequest(request_id="r", text="")),
    ]
    for words, request in named:
        with pytest.raises(grpc.RpcError) as refused:
            list(vllm.Generate(request))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert words in refused.value.details() and "sampling." not in refused.value.details()


def test_model_server_and_load_facts(vllm) -> None:  # type: ignore[no-untyped-def]
    model = vllm.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
    assert model.served_model_name.startswith("SmolLM2-135M-Instruct") and model.is_generation
    assert model.max_context_length == 8192 and model.vocab_size == 49152 and list(model.eos_token_ids) == [2]
    assert model.model_type == "llama" and list(model.architectures) == ["LlamaForCausalLM"]
    server = vllm.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.block_size == 16 and server.uptime_seconds > 0
    assert server.kv_cache_dtype == "auto" and server.model_dtype.startswith("torch.")
    loads = vllm.GetLoads(vllm_engine_pb2.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens > 0
    assert vllm.HealthCheck(vllm_engine_pb2.HealthCheckRequest()).healthy


def test_the_tokenizer_comes_as_a_zip_with_its_fingerprint(vllm) -> None:  # type: ignore[no-untyped-def]
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(chunk.data for chunk in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    assert not any(name.endswith(".safetensors") for name in names)


def test_kv_events_follow_the_daemons_index_and_flush_empties_it(stack: Stack, gateway, ours) -> None:  # type: ignore[no-untyped-def]
    vllm = gateway
    vllm.FlushCache(common_pb2.FlushCacheRequest())
    assert pool_counts(stack.daemon_address).cached_pages == 0
    events = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    state = next(events)
    assert [e.WhichOneof("data") for e in state.events] == ["cleared"]
    batches: list[common_pb2.KvEventBatch] = []
    threading.Thread(target=collect, args=(events, batches), daemon=True).start()
    ids = tokens(ours, PROMPT)
    list(vllm.Generate(generate(ids, False, max_tokens=1)))
    stored = lambda: [e.stored for b in batches for e in b.events if e.WhichOneof("data") == "stored"]  # noqa: E731
    wait_until(lambda: len(stored()) >= len(ids) // 16, 10, "the prompt's full pages to be announced")
    blocks = [block for s in stored() for block in s.blocks]
    assert [t for block in blocks[: len(ids) // 16] for t in block.token_ids] == ids[: len(ids) // 16 * 16]
    assert not stored()[0].HasField("parent_block_hash")
    # The stack has no disk tier: every block is in the pool, SMG's DEVICE tier.
    assert {(s.tier, s.medium) for s in stored()} == {(common_pb2.KV_CACHE_TIER_DEVICE, "pool")}
    assert [s.parent_block_hash for s in stored()[1:3]] == [b.block_hash for b in blocks[:2]]
    assert all(b.sequence_number == state.sequence_number + i + 1 for i, b in enumerate(batches))
    flushed = vllm.FlushCache(common_pb2.FlushCacheRequest())
    assert flushed.success and "dropped" in flushed.message
    assert pool_counts(stack.daemon_address).cached_pages == 0
    removed = lambda: {h for b in batches for e in b.events if e.WhichOneof("data") == "removed"  # noqa: E731
                       for h in e.removed.block_hashes}  # fmt: skip
    announced = {block.block_hash for block in [b for s in stored() for b in s.blocks]}
    wait_until(lambda: announced <= removed(), 10, "every announced block removed")
    events.cancel()
    with pytest.raises(grpc.RpcError) as refused:
        next(vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=5)))
    assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_a_stopping_frontend_ends_the_gateways_event_stream_saying_why(tmp_path: Path) -> None:
    """SubscribeKvEvents never ends on its own: the frontend's stop waited its whole grace (10 s) on SMG's
    stream, then cancelled it ("Cancelling all calls"); now it ends it first, UNAVAILABLE with the reason."""
    stack = start_stack(tmp_path, "--gateway-address", f"127.0.0.1:{free_port()}", "--kv-memory", "64MiB")
    try:
        with grpc.insecure_channel(stack.gateway_address) as channel:
            events = vllm_engine_pb2_grpc.VllmEngineStub(channel).SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(), timeout=60
            )
            assert next(events).events[0].WhichOneof("data") == "cleared"
            stack.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as ended:
                list(events)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ended.value.details().startswith("the frontend is shutting down")
    finally:
        assert stack.stop() == 0
    assert "Traceback" not in stack.log()

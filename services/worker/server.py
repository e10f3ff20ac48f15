"""The worker process: `pagedserve worker`. It loads the model, attaches to the daemon's pool, runs the
engine thread, and serves the Worker service and grpc.health.v1."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

from memory_daemon.shape import PoolShape
from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops
from pagedserve.kernels.cpu_features import cpu_features
from pagedserve.kernels.torch_ref import TorchBackend
from pagedserve.plumbing.auth import check_serving_address, secret_interceptor
from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.plumbing.logs import setup_logging
from pagedserve.plumbing.private import restrict_socket
from pagedserve.plumbing.rpc import run_process, start_server, stop_signal
from pagedserve.plumbing.sizes import format_bytes, physical_memory_bytes
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.default_model import model_identity, resolve_model
from services.worker.config import WorkerConfig
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.draft_model import DraftModelProposer
from services.worker.core.engine import EngineCore
from services.worker.core.grammar import Grammars
from services.worker.core.loop import Engine
from services.worker.kv.base import KVCache
from services.worker.kv.local import LocalKVCache
from services.worker.kv.remote import DaemonError, DaemonKVCache
from services.worker.metrics import instrument
from services.worker.models import CausalLM, ModelRefused, load_model
from services.worker.models.quantized import int8_activations
from services.worker.service import SERVICE_NAME, WorkerService

log = logging.getLogger(__name__)

CONFIG = WorkerConfig  # its fields are the command line


@dataclass
class LoadedWorker:
    engine: Engine
    model_dir: Path
    model_id: str
    kv_namespace: str  # what its pages are cached under in the daemon (kv_namespace)
    attach: Callable[[], KVCache] | None  # a fresh lease on the daemon's pool; None for an in-process pool
    attach_draft: Callable[[], KVCache] | None  # the same for the draft model's pool (--draft-model)
    dtype: str  # the model's, e.g. "bfloat16" (its pool's may be narrower: --kv-cache-dtype)

    def info(self, config: WorkerConfig) -> worker_pb2.WorkerInfo:
        """What GetInfo answers."""
        spec = self.engine.spec
        return worker_pb2.WorkerInfo(
            model_id=self.model_id,
            kv_namespace=self.kv_namespace,
            model_dir=str(self.model_dir),
            max_model_len=spec.max_model_len,
            vocab_size=spec.vocab_size,
            eos_token_ids=spec.eos_token_ids,
            dtype=self.dtype,
            device=config.device,
            page_size=config.page_size,
            worker_name=config.name,
            kv_cache_dtype=config.kv_cache_dtype,
        )


def kernel_backend(config: WorkerConfig, device: torch.device) -> KernelBackend:
    if config.kernel_backend == "cupy":
        from pagedserve.kernels.cupy_backend import CupyBackend

        return CupyBackend(device)
    if config.kernel_backend == "cpu" and (ops := cpu_ops()) is not None:
        return CpuBackend(ops, cpu_features())
    return TorchBackend()


def model_dtype(config: WorkerConfig, backend: KernelBackend) -> tuple[torch.dtype, str]:
    """The dtype the model runs in (and its pool, unless --kv-cache-dtype), and why: --dtype, or what auto
    picks for the device."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype), f"{config.dtype}, as --dtype says"
    if config.device != "cpu":
        return torch.bfloat16, "bfloat16, auto's choice on CUDA"
    if isinstance(backend, CpuBackend):
        return cpu_features().best_dtype()
    return torch.float32, "float32: auto tries bfloat16 only with the C++ CPU kernels"


def kv_namespace(model_id: str, model: CausalLM, quantization: str, kv_dtype: str) -> str:
    """The daemon's name for a worker's cached pages: the model's, and how its keys and values were computed
    and kept. A worker reuses only pages it would have written itself: a bfloat16 model's keys and values
    differ from a float32 model's, also where both keep them in a bfloat16 pool, an int8 model's differ from
    both (rounding the activations to int8 too, or not, differs again), and a float32 model's rounded to a
    bfloat16 pool differ from those kept whole."""
    dtype = str(model.dtype).removeprefix("torch.")
    precision = dtype
    if int8_activations(model.weights):  # int8 weights quantized at load or stored so, where vpdpbusd runs
        precision += "-w8a8"
    elif quantization == "int8":  # weight-only: the activations stay in the model's dtype
        precision += f"-w8a{model.dtype.itemsize * 8}"
    if kv_dtype != dtype:
        precision += f"-kv-{kv_dtype}"
    return f"{model_id}@{precision}"


def load_worker(config: WorkerConfig, on_lost: Callable[[], None] | None = None) -> LoadedWorker:
    """Load the model and attach its KV cache: everything but the server.

    on_lost is called, from a background thread, if the memory daemon goes away.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    model_dir = resolve_model(config.model)
    device = torch.device(config.device)
    backend = kernel_backend(config, device)
    log.info("kernels: %s, on %d torch threads", backend.name, torch.get_num_threads())
    dtype, why = model_dtype(config, backend)
    log.info("dtype: %s", why)
    model = load_model(
        model_dir,
        dtype=dtype,
        device=device,
        backend=backend,
        quantization=config.quantization,
        max_model_len=config.max_model_len,
    )
    spec = model.spec
    if config.max_model_len is not None and config.max_model_len > spec.max_model_len:
        raise ModelRefused(
            f"--max-model-len {config.max_model_len} is above {model_dir}'s max_position_embeddings "
            f"({spec.max_model_len}): the model was not trained on positions past it"
        )
    model_id = config.model_id or model_identity(model_dir)
    dtype_name = str(dtype).removeprefix("torch.")
    kv_dtype = dtype_name if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    if kv_dtype == "float32" and dtype_name != "float32":
        raise ModelRefused(
            f"--kv-cache-dtype float32 under a {dtype_name} model doubles the pool's bytes and keeps "
            f"nothing more: its keys and values are {dtype_name}'s; leave it auto, or run the model with "
            "--dtype float32"
        )
    shape = spec.pool_shape(kv_dtype, config.page_size)  # type: ignore[arg-type]
    namespace = kv_namespace(model_id, model, config.quantization, kv_dtype)
    kv, attach = _pool(config, shape, namespace, config.kv_memory_bytes, config.name, on_lost)
    where = "in-process" if attach is None else f"from the daemon at {config.daemon_address}"
    parameters = f"{spec.num_parameters / 1e6:.0f}M"
    weights = dtype_name
    w8a8 = int8_activations(model.weights)
    if config.quantization == "int8" or w8a8:
        weights += ", int8 linear layers"
        if w8a8:
            weights += " times activations rounded to int8 a row"
    log.info(
        "loaded %s (%s, %s parameters) on %s, %s; KV pool of %d pages in %s %s, its pages cached as %r",
        *(model_dir, spec.model_type, parameters, config.device, weights),
        *(kv.num_pages - 1, kv_dtype, where, namespace),
    )
    graphs = None
    if device.type == "cuda" and config.cuda_graphs and backend.name != "cupy":
        log.info("no CUDA graphs: the %s kernels read the step's lengths on the host", backend.name)
    elif device.type == "cuda" and config.cuda_graphs:
        graphs = DecodeGraphs(model, kv.kv, config.engine.max_num_seqs, config.page_size)
        graphs.capture()
    tokenizer = _tokenizer(model_dir)
    proposer, attach_draft = None, None
    if config.draft_model is not None:
        proposer, attach_draft = _load_draft(config, model, tokenizer, kv.num_pages, backend, kv_dtype)
    grammars = Grammars(tokenizer, spec.vocab_size, spec.eos_token_ids) if tokenizer is not None else None
    engine = Engine(EngineCore(model, kv, config.engine, graphs, grammars, proposer))
    return LoadedWorker(engine, model_dir, model_id, namespace, attach, attach_draft, dtype_name)


def _pool(
    config: WorkerConfig,
    shape: PoolShape,
    namespace: str,
    memory_bytes: int,
    name: str,
    on_lost: Callable[[], None] | None,
) -> tuple[KVCache, Callable[[], KVCache] | None]:
    """A KV pool of this shape, and how to lease it anew: the daemon's, or (without one) in-process."""
    if config.daemon_address is None:
        num_pages = memory_bytes // shape.page_bytes
        physical = physical_memory_bytes()
        if num_pages < 2 or (config.device == "cpu" and memory_bytes > physical):
            raise InvalidArgument(
                f"--kv-memory {format_bytes(memory_bytes)} makes {num_pages} pages of "
                f"{format_bytes(shape.page_bytes)}: an in-process pool takes 2 pages or more, and at most "
                f"this machine's {format_bytes(physical)} of memory"
            )
        device = torch.device(config.device)
        return LocalKVCache(shape, num_pages, model_id=namespace, device=device), None
    attach = functools.partial(
        DaemonKVCache,
        config.daemon_address,
        model_id=namespace,
        shape=shape,
        worker_name=name,
        memory_bytes=memory_bytes,
        device=config.device,
        secret=config.secret,
        on_lost=on_lost,
        shm_dir=config.shm_dir,
    )
    return attach(), attach


def _load_draft(
    config: WorkerConfig,
    target: CausalLM,
    tokenizer: PreTrainedTokenizerFast | None,
    num_pages: int,
    backend: KernelBackend,
    kv_dtype: str,
) -> tuple[DraftModelProposer, Callable[[], KVCache] | None]:
    """--draft-model: the draft model, loaded as the target is (dtype, device, quantization), checked to
    share its tokenizer, and its pool: as many pages as the target's, of its own shape in the target pool's
    dtype, under its own lease (its name is the worker's with /draft). The target's lease alone reports the
    daemon's loss."""
    draft_dir = resolve_model(config.draft_model)
    draft_tokenizer = _tokenizer(draft_dir)
    if tokenizer is None or draft_tokenizer is None or tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ModelRefused(
            f"the draft model {draft_dir} must have the target model's tokenizer: a draft's token ids are "
            "the target's"
        )
    model = load_model(
        draft_dir,
        dtype=target.dtype,
        device=target.device,
        backend=backend,
        quantization=config.quantization,
        max_model_len=target.spec.max_model_len,  # a draft proposes nothing past the target's context
    )
    if model.spec.vocab_size < target.spec.vocab_size:  # the target's ids past it would index nothing
        raise ModelRefused(
            f"the draft model {draft_dir} has a vocabulary of {model.spec.vocab_size}, smaller than the "
            f"target's {target.spec.vocab_size}"
        )
    shape = model.spec.pool_shape(kv_dtype, config.page_size)  # type: ignore[arg-type]
    namespace = kv_namespace(model_identity(draft_dir), model, config.quantization, kv_dtype)
    kv, attach = _pool(config, shape, namespace, num_pages * shape.page_bytes, f"{config.name}/draft", None)
    log.info(
        "draft model %s (%.0fM parameters): %d tokens a draft; KV pool of %d pages",
        *(draft_dir, model.spec.num_parameters / 1e6, config.engine.num_speculative_tokens, kv.num_pages - 1),
    )
    engine = config.engine
    proposer = DraftModelProposer(
        model, kv, engine.num_speculative_tokens, engine.max_batched_tokens, target.spec.vocab_size
    )
    return proposer, attach


def _tokenizer(model_dir: Path) -> PreTrainedTokenizerFast | None:
    """The model's tokenizer; None (structured outputs are refused, and a draft model) without one."""
    try:
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        log.warning("no structured outputs: %s has no usable tokenizer (%s)", model_dir, exc)
        return None


async def keep_attached(
    engine: Engine,
    loaded: LoadedWorker,
    lost: asyncio.Event,
    refresh: Callable[[], Awaitable[None]],
) -> None:
    """When the daemon goes away (it ended the lease, or a step's call to it failed), fail what runs
    (UNAVAILABLE) and report NOT_SERVING, then lease anew once it is back (the draft model's pool too) and
    end the old lease. refresh tells health and the frontends each change."""
    assert loaded.attach is not None
    while True:
        await lost.wait()
        lost.clear()
        log.warning("the memory daemon went away: failing running requests, waiting to re-attach")
        await asyncio.wrap_future(engine.suspend("the KV memory daemon went away; retry"))
        await refresh()
        old = [engine.kv, engine.draft_kv]
        kv = await _lease_again(loaded.attach)
        draft_kv = await _lease_again(loaded.attach_draft) if loaded.attach_draft is not None else None
        await asyncio.wrap_future(engine.resume(kv, draft_kv))
        for pool in old:
            if pool is not None:
                await asyncio.to_thread(pool.close)
        await refresh()
        log.info("re-attached to the memory daemon: %d pages", kv.num_pages - 1)


async def _lease_again(attach: Callable[[], KVCache]) -> KVCache:
    """A new lease, once the daemon is back."""
    refused = ""
    while True:
        try:
            return await asyncio.to_thread(attach)
        except DaemonError as exc:
            if exc.rpc_code.name != "UNAVAILABLE":  # refused, not just gone: say why, once
                log.log(logging.WARNING if str(exc) != refused else logging.DEBUG, "%s", exc)
                refused = str(exc)
            await asyncio.sleep(0.5)  # the daemon is not back yet


async def serve(config: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    lost = asyncio.Event()

    def on_lost() -> None:  # from the KV cache's listener thread, or the engine's (Engine.on_pool_lost)
        loop.call_soon_threadsafe(lost.set)

    # One thread loads the model and runs every step. OpenMP keeps a team of threads for each thread that
    # runs torch's parallel ops, and once a process has more of them than cores libgomp stops spinning
    # between parallel ops: with a loading thread's team beside the engine's, a decode step's threads slept
    # and woke at each of its hundreds of ops, and steps took 1.5x as long on 2 cores.
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    try:
        loaded = await loop.run_in_executor(compute, load_worker, config, on_lost)
        # A step whose daemon call failed (a paused daemon's timeout, say) has suspended the engine, but the
        # lease's stream may live on: re-attach all the same, or the worker stays suspended.
        loaded.engine.on_pool_lost = on_lost
        await serve_loaded(config, loaded, compute, lost)
    finally:
        compute.shutdown(wait=False, cancel_futures=True)


async def serve_loaded(
    config: WorkerConfig, loaded: LoadedWorker, compute: ThreadPoolExecutor, lost: asyncio.Event
) -> None:
    engine = loaded.engine
    info = loaded.info(config)
    service = WorkerService(engine, info, asyncio.get_running_loop(), config.stall_timeout_s)
    if config.metrics.port:
        instrument(engine)
        config.metrics.serve()
    engine.start(compute)
    heartbeat = reattach = running = None
    try:
        running = await start_server(
            config.address,
            lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(service, server),
            [SERVICE_NAME],
            interceptors=secret_interceptor(config.secret, config.address),
        )
        restrict_socket(running.address)
        service.health = running.health
        heartbeat = asyncio.create_task(service.beat(), name="heartbeat")
        if loaded.attach is not None:
            reattach = asyncio.create_task(keep_attached(engine, loaded, lost, service.refresh))
        stop = stop_signal()
        log.info("worker %r serving on %s", config.name, running.address)
        await stop.wait()
        log.info("shutting down")
        await service.drain()
        await running.stop(grace_s=5.0)
    finally:
        for task in (heartbeat, reattach):
            if task is not None:
                task.cancel()
        await asyncio.to_thread(engine.stop)
        for pool in (engine.kv, engine.draft_kv):
            if pool is not None:
                pool.close()


def run(config: WorkerConfig) -> int:
    check_serving_address("pagedserve worker", config.secret, config.address)
    setup_logging(f"worker[{config.name}]", config.log_level)
    # At start: the daemon refused or is not there, or the model is refused.
    return run_process(serve(config), log, (DaemonError, ModelRefused, FileNotFoundError, InvalidArgument))

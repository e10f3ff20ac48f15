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

from pagedserve.kernels import KernelBackend, TorchBackend
from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops
from pagedserve.kernels.cpu_features import cpu_features
from pagedserve.plumbing.auth import check_serving_address, secret_interceptor
from pagedserve.plumbing.logs import setup_logging
from pagedserve.plumbing.private import restrict_socket
from pagedserve.plumbing.rpc import start_server, stop_signal
from pagedserve.worker.v1 import worker_pb2_grpc
from services.common.default_model import model_identity, resolve_model
from services.worker.config import WorkerConfig
from services.worker.core.cuda_graphs import DecodeGraphs
from services.worker.core.engine import EngineCore
from services.worker.core.grammar import Grammars
from services.worker.core.loop import Engine
from services.worker.kv.base import KVCache
from services.worker.kv.local import LocalKVCache
from services.worker.kv.remote import DaemonError, DaemonKVCache
from services.worker.metrics import instrument
from services.worker.models import load_model
from services.worker.models.quantized import int8_activations
from services.worker.models.spec import ModelSpec
from services.worker.service import SERVICE_NAME, WorkerService, worker_info

log = logging.getLogger(__name__)

CONFIG = WorkerConfig  # its fields are the command line


@dataclass
class LoadedWorker:
    engine: Engine
    model_dir: Path
    model_id: str
    attach: Callable[[], KVCache] | None  # a fresh lease on the daemon's pool; None for an in-process pool
    dtype: str  # the model's and the pool's, e.g. "bfloat16"


def kernel_backend(config: WorkerConfig, device: torch.device) -> KernelBackend:
    if config.kernel_backend == "cupy":
        from pagedserve.kernels.cupy_backend import CupyBackend

        return CupyBackend(device)
    if config.kernel_backend == "cpu" and (ops := cpu_ops()) is not None:
        return CpuBackend(ops, cpu_features())
    return TorchBackend()


def model_dtype(config: WorkerConfig, backend: KernelBackend) -> tuple[torch.dtype, str]:
    """The dtype the model and its pool run in, and why: --dtype, or what auto picks for the device."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype), f"{config.dtype}, as --dtype says"
    if config.device != "cpu":
        return torch.bfloat16, "bfloat16, auto's choice on CUDA"
    if isinstance(backend, CpuBackend):
        return cpu_features().best_dtype()
    return torch.float32, "float32: auto tries bfloat16 only with the C++ CPU kernels"


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
        model_dir, dtype=dtype, device=device, backend=backend, quantization=config.quantization
    )
    spec = model.spec
    model_id = config.model_id or model_identity(model_dir)
    dtype_name = str(dtype).removeprefix("torch.")
    shape = spec.pool_shape(dtype_name, config.page_size)  # type: ignore[arg-type]
    attach = None
    if config.daemon_address is None:
        kv: KVCache = LocalKVCache(
            shape, config.kv_memory_bytes // shape.page_bytes, model_id=model_id, device=device
        )
    else:
        attach = functools.partial(
            DaemonKVCache,
            config.daemon_address,
            model_id=model_id,
            shape=shape,
            worker_name=config.name,
            memory_bytes=config.kv_memory_bytes,
            device=config.device,
            secret=config.secret,
            on_lost=on_lost,
            shm_dir=config.shm_dir,
        )
        kv = attach()
    where = "in-process" if attach is None else f"from the daemon at {config.daemon_address}"
    parameters = f"{spec.num_parameters / 1e6:.0f}M"
    weights = dtype_name
    if config.quantization == "int8":
        weights += ", int8 linear layers"
        if int8_activations(model.weights):
            weights += " times activations rounded to int8 a row"
    log.info(
        "loaded %s (%s, %s parameters) on %s, %s; KV pool of %d pages %s",
        *(model_dir, spec.model_type, parameters, config.device, weights, kv.num_pages - 1, where),
    )
    graphs = None
    if device.type == "cuda" and config.cuda_graphs and backend.name != "cupy":
        log.info("no CUDA graphs: the %s kernels read the step's lengths on the host", backend.name)
    elif device.type == "cuda" and config.cuda_graphs:
        graphs = DecodeGraphs(model, kv.kv, config.engine.max_num_seqs, config.page_size)
        graphs.capture()
    engine = Engine(EngineCore(model, kv, config.engine, graphs, _grammars(model_dir, spec)))
    return LoadedWorker(engine, model_dir, model_id, attach, dtype_name)


def _grammars(model_dir: Path, spec: ModelSpec) -> Grammars | None:
    """Structured outputs' compiler for the model's tokenizer; None (they are refused) without a tokenizer."""
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        log.warning("no structured outputs: %s has no usable tokenizer (%s)", model_dir, exc)
        return None
    return Grammars(tokenizer, spec.vocab_size, spec.eos_token_ids)


async def keep_attached(
    engine: Engine,
    attach: Callable[[], KVCache],
    lost: asyncio.Event,
    refresh: Callable[[], Awaitable[None]],
) -> None:
    """When the daemon goes away, fail what runs (UNAVAILABLE) and report NOT_SERVING, then lease anew once
    it is back. refresh tells health and the frontends each change."""
    while True:
        await lost.wait()
        lost.clear()
        log.warning("the memory daemon went away: failing running requests, waiting to re-attach")
        await asyncio.wrap_future(engine.suspend("the KV memory daemon went away; retry"))
        await refresh()
        old, refused = engine.kv, ""
        while True:
            try:
                kv = await asyncio.to_thread(attach)
                break
            except DaemonError as exc:
                if exc.rpc_code.name != "UNAVAILABLE":  # refused, not just gone: say why, once
                    log.log(logging.WARNING if str(exc) != refused else logging.DEBUG, "%s", exc)
                    refused = str(exc)
                await asyncio.sleep(0.5)  # the daemon is not back yet
        await asyncio.wrap_future(engine.resume(kv))
        await asyncio.to_thread(old.close)
        await refresh()
        log.info("re-attached to the memory daemon: %d pages", kv.num_pages - 1)


async def serve(config: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    lost = asyncio.Event()

    def on_lost() -> None:  # from the KV cache's listener thread
        loop.call_soon_threadsafe(lost.set)

    # One thread loads the model and runs every step. OpenMP keeps a team of threads for each thread that
    # runs torch's parallel ops, and once a process has more of them than cores libgomp stops spinning
    # between parallel ops: with a loading thread's team beside the engine's, a decode step's threads slept
    # and woke at each of its hundreds of ops, and steps took 1.5x as long on 2 cores.
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    try:
        loaded = await loop.run_in_executor(compute, load_worker, config, on_lost)
        await serve_loaded(config, loaded, compute, lost)
    finally:
        compute.shutdown(wait=False, cancel_futures=True)


async def serve_loaded(
    config: WorkerConfig, loaded: LoadedWorker, compute: ThreadPoolExecutor, lost: asyncio.Event
) -> None:
    engine = loaded.engine
    info = worker_info(config, loaded.model_dir, loaded.model_id, engine.spec, loaded.dtype)
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
            reattach = asyncio.create_task(keep_attached(engine, loaded.attach, lost, service.refresh))
        stop = stop_signal()
        log.info("worker %r serving on %s", config.name, running.address)
        await stop.wait()
        log.info("shutting down")
        await running.stop(grace_s=5.0)
    finally:
        for task in (heartbeat, reattach):
            if task is not None:
                task.cancel()
        await asyncio.to_thread(engine.stop)
        engine.kv.close()


def run(config: WorkerConfig) -> int:
    check_serving_address("pagedserve worker", config.secret, config.address)
    setup_logging(f"worker[{config.name}]", config.log_level)
    try:
        asyncio.run(serve(config))
    except DaemonError as exc:  # at start: the daemon refused, or is not there
        log.error("cannot start: %s", exc)
        return 1
    return 0

"""The worker process: `pagedserve worker`. It loads the model, attaches to the daemon's pool, runs the
engine thread, and serves the Worker service and grpc.health.v1."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kernels import KernelBackend, TorchBackend
from memory_daemon.shape import PoolShape
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.auth import read_secret, secret_interceptor
from services.common.default_model import resolve_model
from services.common.logs import setup_logging
from services.common.metrics import add_metrics_arguments, serve_metrics
from services.common.rpc import start_server
from services.common.sizes import parse_bytes
from services.worker.config import WorkerConfig
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.engine import Engine, EngineConfig
from services.worker.kv import DaemonKVCache, KVCache, LocalKVCache
from services.worker.kv.remote import DaemonError
from services.worker.metrics import instrument
from services.worker.models import CausalLM
from services.worker.models.spec import model_identity
from services.worker.service import SERVICE_NAME, WorkerService

log = logging.getLogger(__name__)


@dataclass
class LoadedWorker:
    engine: Engine
    info: worker_pb2.WorkerInfo
    attach: Callable[[], KVCache] | None  # a fresh lease on the daemon's pool; None for an in-process pool


def kernel_backend(config: WorkerConfig, device: torch.device) -> KernelBackend:
    if config.kernel_backend == "cupy":
        from kernels.cupy_backend import CupyBackend

        return CupyBackend(device)
    return TorchBackend()


def load_worker(config: WorkerConfig, on_lost: Callable[[], None] | None = None) -> LoadedWorker:
    """Load the model and attach its KV cache: everything but the server.

    on_lost is called, from a background thread, if the memory daemon goes away.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    model_dir = resolve_model(config.model)
    device = torch.device(config.device)
    model = CausalLM.from_pretrained(
        model_dir, dtype=config.torch_dtype, device=device, backend=kernel_backend(config, device)
    )
    spec = model.spec
    model_id = config.model_id or model_identity(model_dir)
    dtype_name = str(config.torch_dtype).removeprefix("torch.")
    shape = PoolShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_name, config.page_size)  # type: ignore[arg-type]
    attach = None
    if config.daemon is None:
        kv: KVCache = LocalKVCache(
            shape, config.kv_memory_bytes // shape.page_bytes, model_id=model_id, device=device
        )
    else:
        attach = functools.partial(
            DaemonKVCache,
            config.daemon,
            model_id=model_id,
            shape=shape,
            worker_name=config.name,
            memory_bytes=config.kv_memory_bytes,
            device=config.device,
            secret=config.secret,
            on_lost=on_lost,
        )
        kv = attach()
    log.info(
        "loaded %s (%s, %s parameters) on %s, %s; KV pool of %d pages %s",
        model_dir, spec.model_type, f"{spec.num_parameters / 1e6:.0f}M", config.device, dtype_name,
        kv.num_pages - 1, "in-process" if config.daemon is None else f"from the daemon at {config.daemon}",
    )  # fmt: skip
    info = worker_pb2.WorkerInfo(
        model_id=model_id,
        model_dir=str(model_dir),
        max_model_len=spec.max_model_len,
        vocab_size=spec.vocab_size,
        eos_token_ids=spec.eos_token_ids,
        dtype=dtype_name,
        device=config.device,
        page_size=config.page_size,
        worker_name=config.name,
    )
    graphs = None
    if device.type == "cuda" and config.cuda_graphs:
        graphs = DecodeGraphs(model, kv.kv, config.engine.max_num_seqs, config.page_size)
        graphs.capture()
    return LoadedWorker(Engine(model, kv, config.engine, graphs=graphs), info, attach)


async def keep_attached(
    engine: Engine,
    attach: Callable[[], KVCache],
    lost: asyncio.Event,
    health: health_aio.HealthServicer,
    announce: Callable[[], None],
) -> None:
    """When the daemon goes away, fail what runs (UNAVAILABLE) and report NOT_SERVING, then lease anew once
    it is back. announce tells the frontends each change."""
    while True:
        await lost.wait()
        lost.clear()
        log.warning("the memory daemon went away: failing running requests, waiting to re-attach")
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.wrap_future(engine.suspend("the KV memory daemon went away; retry"))
        announce()
        old = engine.kv
        while True:
            try:
                kv = await asyncio.to_thread(attach)
                break
            except DaemonError:
                await asyncio.sleep(0.5)
        await asyncio.wrap_future(engine.resume(kv))
        await asyncio.to_thread(old.close)
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        announce()
        log.info("re-attached to the memory daemon: %d pages", kv.num_pages - 1)


async def serve(config: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    lost = asyncio.Event()
    loaded = await asyncio.to_thread(load_worker, config, lambda: loop.call_soon_threadsafe(lost.set))
    engine = loaded.engine
    service = WorkerService(engine, loaded.info, asyncio.get_running_loop())
    if config.metrics_port:
        instrument(engine)
        serve_metrics(config.metrics_port, config.metrics_host)
    engine.start()
    running = await start_server(
        config.address,
        lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(service, server),
        [SERVICE_NAME],
        interceptors=secret_interceptor(config.secret, config.address),
    )
    reattach = None
    if loaded.attach is not None:
        reattach = asyncio.create_task(
            keep_attached(engine, loaded.attach, lost, running.health, service.announce_load)
        )
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info("worker %r serving on %s", config.name, running.address)
    try:
        await stop.wait()
        log.info("shutting down")
        await running.stop(grace_s=5.0)
    finally:
        if reattach is not None:
            reattach.cancel()
        await asyncio.to_thread(engine.stop)
        engine.kv.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkerConfig()
    engine = defaults.engine
    parser.add_argument("--model", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--model-id", help="the prefix cache's name for the model (default: from the folder)")
    parser.add_argument("--name", default=defaults.name, help="this worker's name in logs and statistics")
    parser.add_argument(
        "--address", default=defaults.address, help="host:port or unix:/path (default: %(default)s)"
    )
    parser.add_argument("--daemon", default=defaults.daemon, help="the memory daemon (default: %(default)s)")
    parser.add_argument(
        "--kv",
        choices=["daemon", "local"],
        default="daemon",
        help="lease the pool from the daemon, or keep one in this process",
    )
    parser.add_argument(
        "--device", default=defaults.device, help="cpu, cuda or cuda:N (default: %(default)s)"
    )
    parser.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--kv-memory",
        type=parse_bytes,
        default=defaults.kv_memory_bytes,
        help="the pool's size if this worker creates it (default: 1GiB)",
    )
    parser.add_argument("--page-size", type=int, default=defaults.page_size, choices=[8, 16, 32])
    parser.add_argument("--max-batched-tokens", type=int, default=engine.max_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--kernels",
        choices=["auto", "torch", "cupy"],
        default="auto",
        help="attention and fused kernels: auto takes CuPy's on CUDA, torch's on the CPU",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    add_metrics_arguments(parser)
    parser.add_argument("--secret-file", help="the stack's shared secret (default: $PAGEDSERVE_SECRET)")
    parser.add_argument("--log-level", default="INFO")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        model=args.model,
        model_id=args.model_id,
        name=args.name,
        address=args.address,
        daemon=None if args.kv == "local" else args.daemon,
        device=args.device,
        dtype=args.dtype,
        kv_memory_bytes=args.kv_memory,
        page_size=args.page_size,
        threads=args.threads,
        kernels=args.kernels,
        cuda_graphs=not args.no_cuda_graphs,
        engine=EngineConfig(
            max_batched_tokens=args.max_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            prefix_caching=not args.no_prefix_caching,
        ),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        secret=read_secret(args.secret_file),
    )


def run(args: argparse.Namespace, config: WorkerConfig) -> int:
    setup_logging(f"worker[{args.name}]", args.log_level)
    asyncio.run(serve(config))
    return 0

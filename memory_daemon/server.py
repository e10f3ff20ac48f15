"""The daemon process: `pagedserve daemon` or `python -m memory_daemon`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from memory_daemon.config import DaemonConfig
from memory_daemon.export import remove_stale_files
from memory_daemon.metrics import start_metrics
from memory_daemon.refill import RefillSettings
from memory_daemon.service import SERVICE_NAME, MemoryDaemonService
from pagedserve.memory.v1 import memory_pb2_grpc
from services.common.auth import read_secret, secret_interceptor
from services.common.logs import setup_logging
from services.common.metrics import add_metrics_arguments
from services.common.rpc import start_server
from services.common.sizes import parse_bytes

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DaemonConfig()
    parser.add_argument(
        "--address", default=defaults.address, help="host:port or unix:/path (default: %(default)s)"
    )
    parser.add_argument(
        "--device", default=defaults.device, help="cpu, cuda or cuda:N (default: %(default)s)"
    )
    parser.add_argument(
        "--shm-dir", default=defaults.shm_dir, help="where CPU pools live (default: %(default)s)"
    )
    parser.add_argument(
        "--max-memory",
        type=parse_bytes,
        default=defaults.max_memory_bytes,
        help="budget for all pools, e.g. 8GiB (default: 8GiB)",
    )
    parser.add_argument(
        "--pool-memory",
        type=parse_bytes,
        default=defaults.pool_bytes,
        help="a pool's size when its first worker gives none (default: 1GiB)",
    )
    parser.add_argument(
        "--watermark",
        type=float,
        default=defaults.watermark,
        help="fraction of each pool kept free by evicting idle cached pages (default: %(default)s)",
    )
    parser.add_argument(
        "--min-refill",
        type=int,
        default=defaults.refill.min_pages,
        help="smallest refill in pages (default: %(default)s)",
    )
    parser.add_argument(
        "--max-refill",
        type=int,
        default=defaults.refill.max_pages,
        help="largest refill in pages (default: %(default)s)",
    )
    add_metrics_arguments(parser)
    parser.add_argument("--secret-file", help="the stack's shared secret (default: $PAGEDSERVE_SECRET)")
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    return DaemonConfig(
        address=args.address,
        device=args.device,
        shm_dir=args.shm_dir,
        max_memory_bytes=args.max_memory,
        pool_bytes=args.pool_memory,
        watermark=args.watermark,
        refill=RefillSettings(min_pages=args.min_refill, max_pages=args.max_refill),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        secret=read_secret(args.secret_file),
    )


async def serve(config: DaemonConfig) -> None:
    """Serve until SIGINT or SIGTERM, then close every lease and remove the pools."""
    for path in remove_stale_files(Path(config.shm_dir)):
        log.info("removed %s, left by a daemon that is gone", path)
    service = MemoryDaemonService(config)
    snapshots = (
        start_metrics(service, config.metrics_port, config.metrics_host) if config.metrics_port else None
    )
    running = await start_server(
        config.address,
        lambda server: memory_pb2_grpc.add_MemoryDaemonServicer_to_server(service, server),
        [SERVICE_NAME],
        interceptors=secret_interceptor(config.secret, config.address),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info("memory daemon serving on %s, device %s", running.address, config.device)
    try:
        await stop.wait()
        log.info("shutting down")
        await running.stop(config.shutdown_grace_s)
    finally:
        if snapshots is not None:
            snapshots.cancel()
        service.close()


def run(args: argparse.Namespace, config: DaemonConfig) -> int:
    setup_logging("daemon", args.log_level)
    asyncio.run(serve(config))
    return 0

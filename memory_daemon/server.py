"""The daemon process: `pagedserve daemon` or `python -m memory_daemon`."""

from __future__ import annotations

import logging
from pathlib import Path

from memory_daemon.config import DaemonConfig
from memory_daemon.export import remove_stale_files
from memory_daemon.metrics import start_metrics
from memory_daemon.service import SERVICE_NAME, MemoryDaemonService
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.plumbing.auth import check_serving_address, secret_interceptor
from pagedserve.plumbing.logs import setup_logging
from pagedserve.plumbing.private import restrict_socket
from pagedserve.plumbing.rpc import run_process, start_server, stop_signal

log = logging.getLogger(__name__)

CONFIG = DaemonConfig  # its fields are the command line


async def serve(config: DaemonConfig) -> None:
    """Serve until SIGINT or SIGTERM, then close every lease and remove the pools."""
    for path in remove_stale_files(Path(config.shm_dir)):
        log.info("removed %s, left by a daemon that is gone", path)
    service = MemoryDaemonService(config)
    snapshots = start_metrics(service, config.metrics) if config.metrics.port else None
    running = await start_server(
        config.address,
        lambda server: memory_pb2_grpc.add_MemoryDaemonServicer_to_server(service, server),
        [SERVICE_NAME],
        interceptors=secret_interceptor(config.secret, config.address),
    )
    restrict_socket(running.address)
    stop = stop_signal()
    log.info("memory daemon serving on %s, device %s", running.address, config.device)
    try:
        await stop.wait()
        log.info("shutting down")
        service.end_streams()
        await running.stop(config.shutdown_grace_s)
    finally:
        if snapshots is not None:
            snapshots.cancel()
        service.close()


def run(config: DaemonConfig) -> int:
    check_serving_address("pagedserve daemon", config.secret, config.address)
    setup_logging("daemon", config.log_level)
    return run_process(serve(config), log)

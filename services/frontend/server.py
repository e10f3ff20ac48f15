"""The frontend process: `pagedserve frontend`. It serves pagedserve.v1.Generation, SMG's vLLM worker
protocol (vllm.grpc.engine.VllmEngine, so that SMG's gateway can route to it), grpc.health.v1 and server
reflection, in front of the workers given with --worker. It never loads torch or the model's code: it
tokenizes, and the workers report the model's limits.

With --gateway-address it also listens for the gateway alone: a second server with SMG's protocol whole,
the node's control surface included (`vllm_service`), which answers a caller from this machine only when it
runs as this user or root (`peers.LocalUsersOnly`). SMG presents no credential to its workers, so the
listener is what tells the gateway apart: loopback, a network namespace shared with SMG (compose), or a port
a NetworkPolicy opens to SMG's pods alone (Kubernetes)."""

from __future__ import annotations

import asyncio
import logging
import resource
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

from pagedserve.plumbing.auth import bearer_interceptor
from pagedserve.plumbing.logs import setup_logging
from pagedserve.plumbing.peers import LocalUsersOnly
from pagedserve.plumbing.rpc import (
    CannotListen,
    RunningServer,
    bind_error_reason,
    run_process,
    start_server,
    stop_signal,
)
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.common.default_model import model_identity, resolve_model
from services.frontend.admission import Admission
from services.frontend.config import EVERY_WORKER_HEALTH, FrontendConfig
from services.frontend.generation import RequestPipeline
from services.frontend.h2_guard import GuardedPort
from services.frontend.identity import ClientIdentity
from services.frontend.metrics import track_admission
from services.frontend.node_cache import NodeCache
from services.frontend.router import Router
from services.frontend.service import GenerationService
from services.frontend.validation import RequestBuilder
from services.frontend.vllm_info import ModelFacts
from services.frontend.vllm_service import VllmEngineService

log = logging.getLogger(__name__)

CONFIG = FrontendConfig  # its fields are the command line
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# SMG's worker protocol
VLLM_SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
_PUBLIC = (SERVICE_NAME, VLLM_SERVICE_NAME)  # what the public port's health tells
MAX_METADATA_BYTES = 16 * 1024  # a request's headers, as HPACK decodes them
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def serve(config: FrontendConfig) -> None:
    # gRPC's own listener, behind the HTTP/2 guard that takes the public port, in a folder of this process's:
    # gone at exit, also when the start fails (the public port taken, say).
    with tempfile.TemporaryDirectory(prefix="pagedserve-frontend-", ignore_cleanup_errors=True) as inner:
        await _serve(config, inner)


class NoTokenizer(ValueError):
    """The model folder has no tokenizer this frontend can load: it stops at start and says why."""


async def _serve(config: FrontendConfig, inner: str) -> None:
    try:
        model_dir = resolve_model(config.model)
        # transformers' tokenizers backend, not AutoTokenizer, which loads torch.
        tokenizer = await asyncio.to_thread(PreTrainedTokenizerFast.from_pretrained, model_dir)
    except (OSError, ValueError) as exc:  # no folder, no tokenizer, or a broken one
        raise NoTokenizer(f"no tokenizer from {config.model or 'the default model'}: {exc}") from None
    model_id = config.model_id or model_identity(model_dir)
    workers_changed = asyncio.Event()
    guard = GuardedPort(
        f"{inner}/grpc.sock",
        max_block_bytes=2 * MAX_METADATA_BYTES,
        max_connections=config.max_connections or connections_the_file_limit_allows(),
        max_client_connections=config.max_client_connections,
        tls=config.tls_context(),
    )
    pipeline = _pipeline(
        config, tokenizer, model_id, workers_changed.set, ClientIdentity(config.api_tokens, guard.peer_of)
    )
    router, admission, tokenizing = pipeline.router, pipeline.admission, pipeline.tokenizing
    service = GenerationService(pipeline, model_id, config.drain_timeout_s)
    facts = await asyncio.to_thread(ModelFacts, model_dir, model_id, tokenizer)
    if config.metrics.port:
        track_admission(admission)
        config.metrics.serve()

    public = await _start_public_port(config, service, _vllm_service(config, pipeline, facts), guard)
    servers: list[tuple[RunningServer, tuple[str, ...]]] = [(public, _PUBLIC)]
    gateway = None
    if config.gateway_address:
        gateway = _vllm_service(config, pipeline, facts, gateway=True)
        servers.append((await _start_gateway_listener(config, gateway), (VLLM_SERVICE_NAME,)))

    async def track_health() -> None:
        """Generation (and SMG's protocol) is SERVING while at least one worker is up, and
        EVERY_WORKER_HEALTH while all are."""
        while True:
            up = router.any_up
            for running, names in servers:
                for name in names:
                    await running.health.set(name, _SERVING if up else _NOT_SERVING)
            await public.health.set(EVERY_WORKER_HEALTH, _SERVING if router.all_up else _NOT_SERVING)
            await workers_changed.wait()
            workers_changed.clear()

    health_task = asyncio.create_task(track_health())
    router.start()
    stop = stop_signal()
    where = servers[0][0].address + "".join(
        f" (the gateway's on {running.address})" for running, _ in servers[1:]
    )
    log.info("frontend serving %s on %s, workers %s", model_id, where, ", ".join(config.workers))
    try:
        await stop.wait()
        log.info("shutting down: draining requests for up to %.0fs", config.shutdown_grace_s)
        guard.stop()  # no new connections; those open drain through it
        if gateway is not None:
            gateway.end_event_streams()
        await asyncio.gather(*(running.stop(config.shutdown_grace_s) for running, _ in servers))
    finally:
        health_task.cancel()
        await router.stop()
        tokenizing.shutdown(cancel_futures=True)


def _pipeline(
    config: FrontendConfig,
    tokenizer: PreTrainedTokenizerFast,
    model_id: str,
    on_change: Callable[[], None],
    clients: ClientIdentity,
) -> RequestPipeline:
    """What every request runs through; on_change: called when a worker comes or goes."""
    router = Router(
        config.workers, model_id, on_change, secret=config.secret, timeout_s=config.worker_timeout_s
    )
    builder = RequestBuilder(
        tokenizer,
        default_max_tokens=config.default_max_tokens,
        priorities=(config.min_priority, config.max_priority),
    )
    admission = Admission(config.max_running, config.max_waiting, config.client_share)
    tokenizing = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
    return RequestPipeline(router, admission, builder, tokenizing, clients, config.max_failovers)


async def _start_public_port(
    config: FrontendConfig, service: GenerationService, vllm_service: VllmEngineService, guard: GuardedPort
) -> RunningServer:
    """pagedserve.v1, SMG's protocol without the control surface, health and reflection on --address,
    through the HTTP/2 guard (and its TLS), and on --local-address straight."""

    def register(server: object) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm_service, server)
        names = (
            *_PUBLIC,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)

    # Each client's bounds: calls at once on a connection, and the bytes gRPC reads before a message (and
    # its headers) is refused, not parsed.
    bounds = [
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ]
    running = await start_server(
        f"unix:{guard.inner_path}",
        register,
        [],
        interceptors=bearer_interceptor(config.api_tokens),
        local_address=config.local_address,
        options=bounds,
    )
    try:
        bound = await guard.start(config.address)
    except OSError as exc:
        await running.server.stop(None)  # else it goes at exit, after the event loop, with a traceback
        raise CannotListen(config.address, bind_error_reason(exc)) from exc
    return RunningServer(running.server, running.health, bound)


def _vllm_service(
    config: FrontendConfig, pipeline: RequestPipeline, facts: ModelFacts, *, gateway: bool = False
) -> VllmEngineService:
    """SMG's worker protocol; for the gateway, with the node's cached pages from the daemon, when the
    frontend knows it."""
    node_cache = None
    if gateway and config.daemon:
        node_cache = NodeCache(config.daemon, config.secret, pipeline.router.worker_infos)
    return VllmEngineService(pipeline, facts, node_cache, config.drain_timeout_s, gateway=gateway)


async def _start_gateway_listener(config: FrontendConfig, service: VllmEngineService) -> RunningServer:
    """SMG's protocol whole, control surface included, on --gateway-address: no token, no TLS (SMG sends
    neither to its workers), and no caller from this machine but this user's and root's processes."""
    assert config.gateway_address is not None
    port = int(config.gateway_address.rsplit(":", 1)[1])
    guard = LocalUsersOnly(port, f"the gateway listener {config.gateway_address}")
    if not _is_loopback(config.gateway_address):
        log.warning(
            "the gateway listener %s answers whoever the network lets reach it: keep it on a network "
            "only the gateway joins",
            config.gateway_address,
        )
    return await start_server(
        config.gateway_address,
        lambda server: vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(service, server),
        [],
        interceptors=[guard],
    )


def connections_the_file_limit_allows() -> int:
    """Public connections this process has files for: its open-file limit, raised towards the hard one (up
    to 65536, as vLLM raises it), at three files a connection (`h2_guard`), less 1024 for everything else
    (workers' links, the model's files). Past some 20,000 connections, memory is the bound, not files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass  # the limit as it is
    return max(16, (min(soft, wanted) - 1024) // 3)


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def run(config: FrontendConfig) -> int:
    setup_logging("frontend", config.log_level)
    return run_process(serve(config), log, (NoTokenizer,))

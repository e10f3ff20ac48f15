"""The frontend process: `pagedserve frontend`. It serves pagedserve.v1.Generation, grpc.health.v1 and
server reflection, in front of the workers given with --worker."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection
from transformers import AutoTokenizer

from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.common.auth import API_TOKEN_ENV, bearer_interceptor, read_secret
from services.common.default_model import resolve_model
from services.common.logs import setup_logging
from services.common.metrics import add_metrics_arguments, serve_metrics
from services.common.rpc import start_server
from services.frontend.admission import Admission
from services.frontend.config import FrontendConfig
from services.frontend.metrics import track_admission
from services.frontend.router import Router
from services.frontend.service import GenerationService
from services.frontend.validation import RequestBuilder
from services.worker.models.spec import ModelSpec, model_identity

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def serve(config: FrontendConfig) -> None:
    model_dir = resolve_model(config.model)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_dir)
    spec = ModelSpec.from_pretrained(model_dir)
    model_id = model_identity(model_dir)
    workers_changed = asyncio.Event()
    router = Router(config.workers, model_id, workers_changed.set, secret=config.secret)
    builder = RequestBuilder(
        tokenizer,
        vocab_size=spec.vocab_size,
        max_model_len=spec.max_model_len,
        default_max_tokens=config.default_max_tokens,
    )
    model_info = generation_pb2.ModelInfo(
        model_id=model_id,
        max_context_length=spec.max_model_len,
        vocab_size=spec.vocab_size,
        eos_token_ids=spec.eos_token_ids,
    )
    admission = Admission(config.max_running, config.max_waiting)
    service = GenerationService(router, admission, builder, model_info)
    if config.metrics_port:
        track_admission(admission)
        serve_metrics(config.metrics_port, config.metrics_host)

    def register(server: object) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)

    running = await start_server(
        config.address,
        register,
        [],
        interceptors=bearer_interceptor(config.api_token),
        credentials=config.server_credentials(),
        local_address=config.local_address,
    )

    async def track_health() -> None:
        """Generation is SERVING while at least one worker is up."""
        while True:
            up = router.any_up
            await running.health.set(SERVICE_NAME, _SERVING if up else _NOT_SERVING)
            await workers_changed.wait()
            workers_changed.clear()

    health_task = asyncio.create_task(track_health())
    router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info("frontend serving %s on %s, workers %s", model_id, running.address, ", ".join(config.workers))
    try:
        await stop.wait()
        log.info("shutting down: draining requests for up to %.0fs", config.shutdown_grace_s)
        await running.stop(config.shutdown_grace_s)
    finally:
        health_task.cancel()
        await router.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FrontendConfig()
    parser.add_argument(
        "--address", default=defaults.address, help="host:port to serve (default: %(default)s)"
    )
    parser.add_argument(
        "--worker",
        action="append",
        dest="workers",
        metavar="ADDRESS",
        help="a worker's address; repeat for several (default: 127.0.0.1:50053)",
    )
    parser.add_argument(
        "--model", help="the model folder, for its tokenizer (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-running", type=int, default=defaults.max_running)
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting)
    parser.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens)
    add_metrics_arguments(parser)
    parser.add_argument("--api-token-file", help="require this bearer token (default: $PAGEDSERVE_API_TOKEN)")
    parser.add_argument("--tls-cert", help="a PEM certificate chain: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="the PEM private key of --tls-cert")
    parser.add_argument(
        "--local-address", help="also serve on this unix socket (unix:/path), without TLS, for local tools"
    )
    parser.add_argument("--secret-file", help="the stack's shared secret (default: $PAGEDSERVE_SECRET)")
    parser.add_argument("--log-level", default="INFO")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        address=args.address,
        workers=tuple(args.workers or FrontendConfig().workers),
        model=args.model,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        default_max_tokens=args.default_max_tokens,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        secret=read_secret(args.secret_file),
        api_token=read_secret(args.api_token_file, API_TOKEN_ENV),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        local_address=args.local_address,
    )


def run(args: argparse.Namespace, config: FrontendConfig) -> int:
    setup_logging("frontend", args.log_level)
    asyncio.run(serve(config))
    return 0

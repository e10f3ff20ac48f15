"""What another local user runs in the attack tests (as `nobody`, see tests/second_user.py).

python -m tests.integration.other_user impostor ADDRESS [POOL_PATH POOL_PAGES]
    Serve gRPC at ADDRESS as a stand-in for a daemon or a worker, printing one JSON line per call with
    its method and metadata: a secret sent to it shows up there. Attach gets a pool descriptor that
    names POOL_PATH as the pool file, with POOL_PAGES pages of the shape the worker asked for; it makes
    that file, the right size, if it is missing.
python -m tests.integration.other_user intrude ADDRESS TOKEN...
    Attach to a daemon without any secret, lease every free page, and publish pages under the cache keys
    of the prompt TOKEN...; print what it got as one JSON line.
python -m tests.integration.other_user call-worker ADDRESS
    Call a worker's GetInfo without any secret; print what it answered as one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from memory_daemon.prefix import page_keys
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc

ATTACH = "/pagedserve.memory.v1.MemoryDaemon/Attach"
SHAPE = memory_pb2.PoolShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


class Impostor(grpc.GenericRpcHandler):
    def __init__(self, pool_path: str | None, pool_pages: int) -> None:
        self.pool_path = pool_path
        self.pool_pages = pool_pages

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        metadata = {key: str(value) for key, value in details.invocation_metadata or ()}
        say(method=details.method, metadata=metadata)
        if details.method.startswith("/grpc.health.v1."):
            return None
        if details.method == ATTACH:
            return grpc.unary_stream_rpc_method_handler(
                self.attach,
                request_deserializer=memory_pb2.AttachRequest.FromString,
                response_serializer=memory_pb2.AttachEvent.SerializeToString,
            )
        return grpc.unary_unary_rpc_method_handler(self.refuse)

    def attach(self, request: memory_pb2.AttachRequest, context: grpc.ServicerContext) -> Any:
        shape = request.shape
        page_bytes = 2 * shape.num_layers * shape.page_size * shape.num_kv_heads * shape.head_dim
        page_bytes *= ITEM_BYTES[shape.dtype]
        pool = memory_pb2.PoolDescriptor(
            pool_id=1, shape=shape, num_pages=self.pool_pages, nbytes=self.pool_pages * page_bytes
        )
        pool.shm.path = self.pool_path or "/dev/shm/nothing"
        if self.pool_path:
            with contextlib.suppress(FileExistsError, PermissionError):  # a pool file of this user's own
                fd = os.open(self.pool_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, pool.nbytes)
                os.close(fd)
        attached = memory_pb2.Attached(lease_id="forged", worker_id=1, pool=pool, refill_pages=1)
        yield memory_pb2.AttachEvent(attached=attached)
        ended = threading.Event()
        context.add_callback(ended.set)
        ended.wait()  # keep the "lease" open, as a daemon would

    def refuse(self, request: bytes, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "an impostor")


def impostor(address: str, pool_path: str | None = None, pool_pages: str = "4") -> None:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([Impostor(pool_path, int(pool_pages))])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    server.start()
    say(listening=address)
    server.wait_for_termination()


def intrude(address: str, *tokens: str) -> None:
    """Drain the pool, and poison the prompt's cache entries; report what worked."""
    try:
        with grpc.insecure_channel(address) as channel:
            stub = memory_pb2_grpc.MemoryDaemonStub(channel)
            request = memory_pb2.AttachRequest(worker_name="intruder", model_id="test-model", shape=SHAPE)
            stream = stub.Attach(request, timeout=20, wait_for_ready=False)
            attached = next(stream).attached
            free = stub.Lease(memory_pb2.LeaseRequest(lease_id=attached.lease_id, need=1), timeout=10)
            pages = list(free.pages)
            more = stub.Lease(
                memory_pb2.LeaseRequest(lease_id=attached.lease_id, need=free.free_pages), timeout=10
            )
            pages += list(more.pages)
            keys = page_keys([int(t) for t in tokens], SHAPE.page_size)
            publish = [memory_pb2.PublishedPage(key=k, page=p) for k, p in zip(keys, pages, strict=False)]
            stub.Update(memory_pb2.UpdateRequest(lease_id=attached.lease_id, publish=publish), timeout=10)
            say(attached=True, leased=len(pages), published=len(publish))
            stream.cancel()
    except grpc.RpcError as exc:
        say(attached=False, error=f"{exc.code().name}: {exc.details()}")


def call_worker(address: str) -> None:
    try:
        with grpc.insecure_channel(address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=20)
            say(answered=True, model_id=info.model_id)
    except grpc.RpcError as exc:
        say(answered=False, error=f"{exc.code().name}: {exc.details()}")


if __name__ == "__main__":
    commands = {"impostor": impostor, "intrude": intrude, "call-worker": call_worker}
    commands[sys.argv[1]](*sys.argv[2:])

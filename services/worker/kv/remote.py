"""The KV cache leased from the memory daemon: the pool mapped zero-copy, the books kept over gRPC.

Three threads touch it. The engine thread allocates and frees locally and only calls the daemon when its
idle list is empty. A sender thread carries queued publishes, unrefs and releases in one Update at a time,
merging whatever piled up while the previous call was in flight, and fetches refills ahead of need. A
listener thread holds the Attach stream, which is the lease: it hands idle pages back when the daemon asks.

The secret goes to a daemon on a unix socket only after `check_unix_peer` found this user (or root) behind
it, and the pool the daemon names is mapped only if `map_pool` finds it under --shm-dir, a file this user
made for it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from memory_daemon.export import SHM_DIR, map_pool
from memory_daemon.ledger import PinRequest
from memory_daemon.prefix import Published
from memory_daemon.shape import PoolShape
from memory_daemon.stats import PoolCounts
from memory_daemon.wire import counts_from_pb, descriptor_from_pb, shape_to_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.auth import secret_metadata
from pagedserve.plumbing.errors import PermissionDenied, ResourceExhausted, StatusError
from pagedserve.plumbing.private import check_unix_peer
from pagedserve.plumbing.rpc import CHANNEL_OPTIONS
from services.worker.kv.base import KVCache, PoolLost

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0


class DaemonError(PoolLost):
    """The memory daemon refused a call or could not be reached."""

    def __init__(self, what: str, code: grpc.StatusCode, details: str) -> None:
        self.rpc_code = code  # the daemon's answer; as a StatusError, this is UNAVAILABLE to callers
        super().__init__(f"{what}: {code.name}: {details}")

    @classmethod
    def from_rpc(cls, what: str, error: grpc.RpcError) -> DaemonError:
        return cls(what, error.code(), error.details())


@dataclass
class _Batch:
    publish: list[Published] = field(default_factory=list)
    pin: list[PinRequest] = field(default_factory=list)
    unref: list[int] = field(default_factory=list)
    release: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.publish or self.pin or self.unref or self.release)

    def to_pb(self, lease_id: str, idle: int) -> memory_pb2.UpdateRequest:
        return memory_pb2.UpdateRequest(
            lease_id=lease_id,
            publish=[
                memory_pb2.PublishedPage(key=p.key, page=p.page, parent=p.parent, token_ids=p.token_ids)
                for p in self.publish
            ],
            pin=[memory_pb2.PinRequest(keys=p.keys, ttl_seconds=p.ttl_s, tenant=p.tenant) for p in self.pin],
            unref=self.unref,
            release=self.release,
            idle=idle,
        )


class DaemonKVCache(KVCache):
    def __init__(
        self,
        address: str,
        *,
        model_id: str,
        shape: PoolShape,
        worker_name: str = "worker",
        num_pages: int | None = None,
        memory_bytes: int | None = None,
        device: str = "cpu",
        connect_timeout_s: float = 10.0,
        secret: str | None = None,
        on_lost: Callable[[], None] | None = None,
        shm_dir: str = SHM_DIR,
    ) -> None:
        """on_lost is called (from a background thread) if the daemon ends the lease: it went away.

        shm_dir: where the daemon's CPU pool files may lie; a pool elsewhere is refused.
        """
        self.address = address
        self._metadata = secret_metadata(secret)
        self.rpc_counts: Counter[str] = Counter()  # calls made after Attach, by method
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = memory_pb2_grpc.MemoryDaemonStub(self._channel)
        request = memory_pb2.AttachRequest(
            worker_name=worker_name,
            model_id=model_id,
            shape=shape_to_pb(shape),
            device=device,
            num_pages=num_pages,
            memory_bytes=memory_bytes,
        )
        attached = self._attach_to(request, connect_timeout_s)
        self.lease_id = attached.lease_id
        self.worker_id = attached.worker_id
        self.pool_id = attached.pool.pool_id
        self.lower_tier = attached.lower_tier
        self.pin_budget_pages = attached.pin_budget_pages
        # One thread sends the warm-ups, in arrival order, so that none waits on the engine's path.
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="kv-warm") if self.lower_tier else None
        super().__init__(self._map(attached.pool, shape, shm_dir), shape, attached.refill_pages)
        self._cond = threading.Condition(self._lock)
        self._pending = _Batch()
        self._want_refill = False
        self._sending = False
        self._delivered = 0  # published pages the daemon has taken in
        self._closing = False
        self._error: DaemonError | None = None
        self._on_lost = on_lost
        self._sender = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        self._listener = threading.Thread(target=self._listen, name="kv-listener", daemon=True)
        self._sender.start()
        self._listener.start()

    def _attach_to(self, request: memory_pb2.AttachRequest, timeout_s: float) -> memory_pb2.Attached:
        """Open the lease: the Attach stream and its first event; DaemonError if that cannot be."""
        what = f"attach to {self.address}"
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
            check_unix_peer(self.address)  # before the secret goes out
            self._attach = self._stub.Attach(request, metadata=self._metadata)
            return next(self._attach).attached
        except PermissionDenied as exc:
            self._channel.close()
            raise DaemonError(what, grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise DaemonError(what, grpc.StatusCode.UNAVAILABLE, f"no answer within {timeout_s}s") from None
        except grpc.RpcError as exc:
            self._channel.close()
            raise DaemonError.from_rpc(what, exc) from None

    def _map(self, pool: memory_pb2.PoolDescriptor, shape: PoolShape, shm_dir: str) -> Any:
        """The pool as a tensor, if it has the shape asked for and passes map_pool's checks; else the lease
        ends at once, before anything is written."""
        try:
            descriptor = descriptor_from_pb(pool)
            if descriptor.shape != shape:
                raise PermissionDenied(f"refusing the pool: it has shape ({descriptor.shape}), not ({shape})")
            return map_pool(descriptor, shm_dir)
        except (StatusError, ValueError) as exc:  # a bad shape, storage, size, file
            self._attach.cancel()
            self._channel.close()
            what = f"map the pool from {self.address}"
            raise DaemonError(what, grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None

    def warm(self, keys: Sequence[bytes]) -> None:
        if self._warmer is not None and keys:
            self._warmer.submit(self._warm_quietly, list(keys))

    def promote(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Bring keys' pages that the lower tier holds into the pool now: (pages promoted, the chain's
        leading pages in the pool after)."""
        request = memory_pb2.PrefetchRequest(lease_id=self.lease_id, keys=keys)
        reply = self._call("PrefetchPrefix", self._stub.PrefetchPrefix, request)
        return reply.promoted, reply.cached

    def check_pins(self, tenant: str, keys: Sequence[bytes]) -> None:
        request = memory_pb2.CheckPinsRequest(
            lease_id=self.lease_id, tenant=tenant, pages=len(keys), keys=keys
        )
        try:
            self._stub.CheckPins(request, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise DaemonError.from_rpc("CheckPins", exc) from None
            raise ResourceExhausted(exc.details()) from None

    def _warm_quietly(self, keys: list[bytes]) -> None:
        """A warm-up is an optimisation: the lookup promotes what it did not, so a failure is only logged."""
        try:
            self.promote(keys)
        except DaemonError as exc:
            log.debug("warming %d pages failed: %s", len(keys), exc)

    def stats(self) -> PoolCounts:
        reply = self._call("GetStats", self._stub.GetStats, memory_pb2.GetStatsRequest())
        return next(counts_from_pb(pool) for pool in reply.pools if pool.pool_id == self.pool_id)

    def flush(self, timeout_s: float = RPC_TIMEOUT_S) -> None:
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._error or not (self._pending or self._sending or self._want_refill), timeout_s
            )
            if self._error:
                raise self._error
            if not done:
                raise TimeoutError(
                    f"updates to the memory daemon at {self.address} still queued after {timeout_s}s"
                )

    def close(self) -> None:
        """Send what is queued, then end the lease: the daemon takes back every page."""
        try:
            self.flush()
        except (DaemonError, TimeoutError) as exc:
            log.warning("closing the KV lease with updates unsent: %s", exc)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._warmer is not None:
            self._warmer.shutdown(cancel_futures=True)
        self._attach.cancel()
        self._sender.join()
        self._listener.join()
        self._channel.close()

    # Hooks -----------------------------------------------------------------------------------------

    def _lease(self, need: int, consumed: int, idle: int) -> tuple[list[int], int]:
        request = memory_pb2.LeaseRequest(lease_id=self.lease_id, need=need, consumed=consumed, idle=idle)
        reply = self._call("Lease", self._stub.Lease, request)
        return list(reply.pages), reply.refill_pages

    def _submit(
        self,
        idle: int,
        *,
        publish: Sequence[Published] = (),
        pin: Sequence[PinRequest] = (),
        unref: Sequence[int] = (),
        release: Sequence[int] = (),
    ) -> None:
        self._pending.publish.extend(publish)
        self._pending.pin.extend(pin)
        self._pending.unref.extend(unref)
        self._pending.release.extend(release)
        self._cond.notify_all()

    def delivered(self, mark: int) -> bool:
        with self._cond:
            return self._error is not None or self._delivered >= mark

    def _lookup(self, keys: Sequence[bytes]) -> list[int]:
        request = memory_pb2.LookupRequest(lease_id=self.lease_id, keys=keys)
        return list(self._call("LookupPrefix", self._stub.LookupPrefix, request).pages)

    def _request_refill(self) -> None:
        with self._cond:
            self._want_refill = True
            self._cond.notify_all()

    # Threads ---------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._want_refill or self._closing)
                if self._closing:
                    return
                batch, self._pending = self._pending, _Batch()
                refill, self._want_refill = self._want_refill, False
                idle = len(self._idle)
                self._sending = True
            try:
                if batch and not self._error:
                    self._call("Update", self._stub.Update, batch.to_pb(self.lease_id, idle))
                    with self._cond:
                        self._delivered += len(batch.publish)
                if refill and not self._error:
                    self._prefetch()
            except DaemonError as exc:
                # The lease is gone with the daemon, and with it every page this batch named.
                log.error("lost the memory daemon: %s", exc)
                self._error = exc
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _listen(self) -> None:
        try:
            for event in self._attach:
                if event.HasField("reclaim"):
                    returned = self._return_idle(event.reclaim.pages)
                    log.info("returned %d idle pages at the daemon's request", returned)
        except grpc.RpcError as exc:
            if not self._closing:
                log.error("the memory daemon ended the lease: %s", exc.details())
                with self._cond:
                    self._error = DaemonError.from_rpc("Attach", exc)
                    self._cond.notify_all()
                if self._on_lost is not None:
                    self._on_lost()

    def _call(self, name: str, method: Callable[..., Any], request: Message) -> Any:
        self.rpc_counts[name] += 1
        try:
            return method(request, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise DaemonError.from_rpc(name, exc) from None

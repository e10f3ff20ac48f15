"""The node's prefix cache as a gateway sees it, from the memory daemon: KV events and flushing.

The daemon is the one authority on what this node has cached, and it outlives worker restarts, so the
events come from it, not from the workers: each daemon batch becomes one `smg.grpc.common.KvEventBatch`
with its sequence number. A page is a block: its hash is the first 8 bytes of its chain key (as a signed
64-bit integer), its parent's likewise, and it carries its tokens, so that a gateway can follow prefixes by
content; a page of a salted prompt is not announced. Each block names its tier: DEVICE for the daemon's
pool, HOST for its host-memory tier, DISK for its disk tier (a page may be in several). When the daemon
goes away the stream ends with UNAVAILABLE and the gateway subscribes again from its last sequence number,
which a restarted daemon refuses with OUT_OF_RANGE: a gateway must then drop what it knew of this node and
start over from the whole state (SMG 1.13 does not: it asks again from the same number, each time).

A worker's pages are cached under its kv_namespace, the model and the precision that computed them; the events
are those of the first serving worker's namespace (one stream has one sequence of numbers), and a flush
drops the idle pages of every serving worker's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from smg_grpc_proto.generated import common_pb2

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.auth import secret_metadata
from pagedserve.plumbing.errors import StatusError, Unavailable
from pagedserve.plumbing.rpc import CHANNEL_OPTIONS, check_peer_before_secret
from pagedserve.worker.v1 import worker_pb2

_LOCAL = common_pb2.KV_CACHE_LOCALITY_LOCAL
# The daemon's media as SMG's tiers, and the raw medium string each comes from.
_TIERS = {
    memory_pb2.MEDIUM_POOL: (common_pb2.KV_CACHE_TIER_DEVICE, "pool"),
    memory_pb2.MEDIUM_HOST: (common_pb2.KV_CACHE_TIER_HOST, "host"),
    memory_pb2.MEDIUM_DISK: (common_pb2.KV_CACHE_TIER_DISK, "disk"),
}


STOPPING = "the frontend is shutting down; subscribe again once it is back, or to another"


def block_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "little", signed=True)


class NodeCache:
    def __init__(
        self,
        address: str,
        secret: str | None,
        worker_infos: Callable[[], Sequence[worker_pb2.WorkerInfo]],
    ) -> None:
        self.address = address
        self._metadata = secret_metadata(secret)
        self._worker_infos = worker_infos
        self._watches: set[grpc.aio.UnaryStreamCall] = set()  # the daemon's streams `events` relays
        self._stopping = False

    async def flush(self) -> int:
        """Drop the model's cached pages that no request uses, at every precision its workers run; returns
        how many."""
        pages = 0
        async with self._channel() as channel:
            stub = memory_pb2_grpc.MemoryDaemonStub(channel)
            for namespace in dict.fromkeys(info.kv_namespace for info in self._serving()):
                request = memory_pb2.FlushPrefixIndexRequest(model_id=namespace)
                try:
                    response = await stub.FlushPrefixIndex(request, metadata=self._metadata, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    raise self._unavailable(exc) from None
                pages += response.pages
        return pages

    async def events(self, after: int) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The batches after sequence number `after` (0: the whole state first), then each new one."""
        if self._stopping:
            raise Unavailable(STOPPING)
        first = self._serving()[0]
        async with self._channel() as channel:
            stub = memory_pb2_grpc.MemoryDaemonStub(channel)
            request = memory_pb2.WatchPrefixIndexRequest(model_id=first.kv_namespace, after_sequence=after)
            watch = stub.WatchPrefixIndex(request, metadata=self._metadata)
            self._watches.add(watch)
            try:
                async for batch in watch:
                    yield self._to_smg(batch, first.page_size)
            except grpc.aio.AioRpcError as exc:
                raise self._unavailable(exc) from None
            except asyncio.CancelledError:
                if not self._stopping:
                    raise
                # end_watches cancelled the watch: a CancelledError out of a handler ends no call, and
                # grpc would hold it open until the server's stop had waited out its grace.
                raise Unavailable(STOPPING) from None
            finally:
                self._watches.discard(watch)

    def end_watches(self) -> None:
        """At shutdown: end every `events` stream with UNAVAILABLE saying why, and refuse new ones: they
        never end on their own, so the server's stop waited out its grace on them, then cancelled them."""
        self._stopping = True
        for watch in list(self._watches):
            watch.cancel()

    def _serving(self) -> Sequence[worker_pb2.WorkerInfo]:
        """The serving workers' reports: each names the namespace its pages are cached under."""
        infos = self._worker_infos()
        if not infos:
            raise Unavailable("no worker has said yet how it caches the model's pages; retry")
        return infos

    def _channel(self) -> _CheckedChannel:
        return _CheckedChannel(self.address)

    def _unavailable(self, exc: grpc.aio.AioRpcError) -> StatusError:
        """The daemon's refusal of a sequence number as it is (the gateway acts on it), else UNAVAILABLE."""
        if exc.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DATA_LOSS):
            return StatusError.of(exc.code().name, str(exc.details()))
        return Unavailable(f"the node's memory daemon at {self.address}: {exc.code().name}: {exc.details()}")

    def _to_smg(self, batch: memory_pb2.PrefixIndexBatch, page_size: int) -> common_pb2.KvEventBatch:
        out = common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp)
        for event_id, change in enumerate(batch.changes, start=1):
            event = out.events.add(event_id=event_id)
            kind = change.WhichOneof("change")
            if kind == "stored":
                page = change.stored
                stored = event.stored
                stored.blocks.add(
                    block_hash=block_hash(page.key), token_ids=page.token_ids, block_size=page_size
                )
                if page.parent:
                    stored.parent_block_hash = block_hash(page.parent)
                stored.tier, stored.medium = _TIERS[change.medium]
                stored.locality = _LOCAL
            elif kind == "removed":
                event.removed.block_hashes.append(block_hash(change.removed))
                event.removed.tier, event.removed.medium = _TIERS[change.medium]
                event.removed.locality = _LOCAL
            else:
                event.cleared.SetInParent()
        return out


class _CheckedChannel:
    """An insecure channel to the daemon's unix socket, after checking who listens on it."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> grpc.aio.Channel:
        try:
            await check_peer_before_secret(self._address)  # no other user's process behind the socket
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"the node's memory daemon at {self._address}: {exc.details()}") from None
        self._channel = grpc.aio.insecure_channel(self._address, options=CHANNEL_OPTIONS)
        return self._channel

    async def __aexit__(self, *exc_info: object) -> None:
        if self._channel is not None:
            await self._channel.close()

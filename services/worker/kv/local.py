"""The in-process KV cache: the daemon's ledger and a pool tensor in this process, with no RPC at all.

It serves unit tests, and measures what the daemon costs: the same bookkeeping, minus the transport.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memory_daemon.ledger import PageLedger, PinRequest
from memory_daemon.prefix import Published
from memory_daemon.refill import RefillSettings
from memory_daemon.shape import PoolShape
from memory_daemon.stats import PoolCounts
from services.worker.kv.base import KVCache


class LocalKVCache(KVCache):
    def __init__(
        self,
        shape: PoolShape,
        num_pages: int,
        *,
        model_id: str = "local",
        device: str | torch.device = "cpu",
        low_watermark: int = 0,
        refill: RefillSettings | None = None,
    ) -> None:
        self.ledger = PageLedger(num_pages, low_watermark=low_watermark, refill=refill)
        self._lease_record = self.ledger.open_lease("in-process", model_id)
        self.pin_budget_pages = self.ledger.pins.budget
        kv = torch.zeros(shape.tensor_shape(num_pages), dtype=getattr(torch, shape.dtype), device=device)
        super().__init__(kv, shape, refill_pages=self._lease_record.refill.pages)

    def stats(self) -> PoolCounts:
        return self.ledger.counts()

    def check_pins(self, tenant: str, keys: Sequence[bytes]) -> None:
        self.ledger.check_pins(tenant, len(keys), 1, self._lease_record.model_id, keys)

    def flush(self) -> None:
        pass  # every update is applied when it is made

    def close(self) -> None:
        if self._lease_record.lease_id in self.ledger.leases:
            self.ledger.close_lease(self._lease_record)

    def _lease(self, need: int, consumed: int, idle: int) -> tuple[list[int], int]:
        pages = self.ledger.refill(self._lease_record, need, consumed, idle)
        return pages or [], self._lease_record.refill.pages

    def _submit(
        self,
        idle: int,
        *,
        publish: Sequence[Published] = (),
        pin: Sequence[PinRequest] = (),
        unref: Sequence[int] = (),
        release: Sequence[int] = (),
    ) -> None:
        self.ledger.update(self._lease_record, publish=publish, pin=pin, unref=unref, release=release)
        self.ledger.report_idle(self._lease_record, idle)

    def _lookup(self, keys: Sequence[bytes]) -> list[int]:
        return self.ledger.lookup(self._lease_record, keys)

    def _request_refill(self) -> None:
        self._prefetch()

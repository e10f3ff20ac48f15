"""The worker's KV cache: the pool as a tensor, and pages sub-allocated locally from a bulk lease.

`KVCache` holds the local bookkeeping. `DaemonKVCache` leases from the memory daemon over gRPC and maps its
pool zero-copy; `LocalKVCache` runs the same ledger in-process, for unit tests and to measure what the
daemon costs.
"""

from services.worker.kv.base import KVCache
from services.worker.kv.local import LocalKVCache
from services.worker.kv.remote import DaemonKVCache

__all__ = ["DaemonKVCache", "KVCache", "LocalKVCache"]

"""The worker's KV cache: the pool as a tensor, and pages sub-allocated locally from a bulk lease.

`base.KVCache` holds the local bookkeeping, and is all the engine core sees. `remote.DaemonKVCache` leases
from the memory daemon over gRPC and maps its pool zero-copy; `local.LocalKVCache` runs the same ledger
in-process, for unit tests and to measure what the daemon costs. Import them from their modules: this
package imports nothing, so that the engine core never loads gRPC.
"""

"""The KV memory daemon: one paged KV pool per model shape, in its own process, shared by every worker.

Design. A pool is one allocation holding every layer's K and V, laid out as
`[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`, so one page id names the same slot in
every layer. On the CPU it is a file in /dev/shm that workers map zero-copy; on CUDA it is a plain cudaMalloc
exported as a CUDA IPC handle. The daemon never touches the data. It keeps the books (`ledger`): a free
list, leases, reference-counted shared pages and a prefix index whose unreferenced pages are evicted LRU
first below a watermark. Workers lease pages in bulk, sized from their recent consumption (`refill`), and
sub-allocate locally, so the daemon stays off the per-token path. A worker's lease lives as long as its
Attach stream: when the stream ends, a crash included, its pages come back, while the prefix pages it
published stay cached for the next worker.

Modules: `shape` (pool geometry), `ledger` (page accounting), `prefix` (hash chain and LRU index),
`publishers` (who published each cached page), `refill` (pre-allocation from history), `stats`, `export`
(shm and CUDA IPC, both sides), `pool`, `service` (the gRPC servicer), `config` and `server` (the process).
"""

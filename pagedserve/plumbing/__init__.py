"""Cross-process plumbing, the bottom layer: it imports nothing of pagedserve.kernels, memory_daemon or
services.

- `errors`: the error types a caller can act on, each naming its gRPC status.
- `status`: the interceptor that turns them (and anything unexpected, as INTERNAL) into statuses.
- `rpc`: gRPC server start, channel options, health checks.
- `auth`: the stack's shared secret and public bearer tokens.
- `settings`: config dataclass fields that declare their own command-line flags.
- `metrics`, `logs`, `sizes`, `paths`: the metrics server, log format, byte sizes, the cache folder.
"""

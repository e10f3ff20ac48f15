"""pagedserve's processes above the memory layer: the frontend, the compute worker, and what they share.

`services.cli` is the `pagedserve` command; `services.common` holds the gRPC plumbing every process uses
(the error interceptor, health, server and channel options) and the logging set-up.
"""

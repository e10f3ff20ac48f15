"""The bottom of pagedserve: the generated contracts, and the plumbing every process shares.

`pagedserve.v1` is the public Generation service, `pagedserve.memory.v1` the KV memory daemon's internal
contract and `pagedserve.worker.v1` the compute worker's; they are protobuf and gRPC stubs generated from
protos/ (do not edit; regenerate with `python scripts/gen_protos.py`). `pagedserve.plumbing` is the layer
that `pagedserve.kernels`, `memory_daemon` and `services` all stand on, and that imports none of them.

`pagedserve.kernels` holds the compute worker's kernels. It lives under this package's name, not as a
top-level `kernels`, because that import name is Hugging Face's kernels package, which transformers imports.
"""

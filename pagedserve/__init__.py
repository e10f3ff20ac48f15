"""Generated protobuf and gRPC stubs for the contracts in protos/; do not edit.

`pagedserve.v1` is the public Generation service; `pagedserve.memory.v1` is the KV memory daemon's
internal contract. Regenerate with `python scripts/gen_protos.py`.
"""

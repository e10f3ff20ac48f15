"""The compute worker: it maps the daemon's KV pool and runs continuous batching on it.

`kv` is the worker's side of the memory layer: pages sub-allocated from a bulk lease, with no RPC on the
per-token path.
"""

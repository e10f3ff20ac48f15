"""The compute worker: it maps the daemon's KV pool and runs continuous batching on it.

- `core/` is the engine core, plain Python and torch with no gRPC or protobuf: the scheduler, the model
  runner, the sampler, the engine step and the thread that loops it.
- `kv/` is the worker's side of the memory layer: pages sub-allocated from a bulk lease, with no RPC on the
  per-token path.
- `models/` is the worker's own model code for the Llama family.
- `service` is the Worker gRPC servicer, where the core's values meet protobuf; `server` and `config` are
  the process; `metrics` its Prometheus collector.
"""

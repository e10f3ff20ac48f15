"""The engine core: continuous batching in plain Python and torch, with no gRPC or protobuf.

A request's path through it: `loop.Engine.submit` checks an `EngineRequest` (`engine.EngineCore.new_sequence`
builds its `sequence.Sequence`) and queues it for the engine thread, which runs `EngineCore.step` in a loop:
the `scheduler` picks what runs (token budget, chunked prefill, prefix-cache admission, preemption), the
`model_runner` builds the batch (`batch`), runs the model (by `cuda_graphs` replay where one fits) and samples
(`sampler`), and `Scheduler.postprocess` applies stop rules and frees finished sequences' pages. What each
step produced goes out as `sequence.RequestOutput`s to one callback; the servicer converts them. Outside this
package, the worker's servicer and metrics use `loop`'s facade alone, and its server builds the engine
(`EngineCore`, `DecodeGraphs`, `Grammars`) for it; import-linter contracts hold both. Tests and benchmarks
drive the core directly.
"""

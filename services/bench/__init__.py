"""`pagedserve bench`: a gRPC load generator against a running stack, and the same load through Hugging Face
transformers in-process, side by side.

`workloads` draws the requests (the source document's fixed 512-in/1024-out load, random lengths, or many
requests behind one shared system prompt) and their arrival times (all at once under a fixed concurrency,
or Poisson at a rate). `load` sends them over gRPC and times every token; `baseline` runs them through
transformers' static-batch `generate` and its continuous-batching manager; `scrape` reads KV fragmentation,
prefix hits and preemptions from the daemon's and workers' Prometheus metrics; `results` turns timings into
percentiles, throughput and goodput; `report` writes the JSON, the plot and the table.
"""

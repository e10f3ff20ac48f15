"""The frontend: the public pagedserve.v1.Generation service, in front of one or more workers.

It is the access and result layers. `validation` turns a request into an `EngineRequest` of prompt token
ids and checked sampling options (chat templates included); `admission` bounds how many requests run and
wait, best priority first; `router` keeps one multiplexed Connect stream per worker and sends each request
to the least-loaded worker that is up; `detokenizer` turns token ids into text deltas that never split a
character and never show a stop string; `generation` runs a request's samples through them, and `call` is
the frame both protocols' servicers (`service`, `vllm_service`) run a call in, where a cancelled call or a
passed deadline aborts the request in its worker.
"""

"""`python -m tests.openai_adapter GRPC_ADDRESS PORT`: an OpenAI-compatible front (streaming /v1/completions
and /v1/models) over a pagedserve stack, so that the bench's OpenAI target is tested against a real server.

Only what the bench sends is served: token-id prompts, max_tokens, min_tokens, ignore_eos, temperature,
stream with usage. Each engine step's tokens go out as one server-sent event, as vLLM streams them.
"""

from __future__ import annotations

import json
import sys

import grpc
from aiohttp import web

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc

MODEL = "pagedserve-under-test"


def make_app(grpc_address: str) -> web.Application:
    app = web.Application()

    async def channel(app: web.Application):  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(grpc_address) as opened:
            app["stub"] = generation_pb2_grpc.GenerationStub(opened)
            yield

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["model"] != MODEL or body.get("min_tokens") not in (None, 0, body["max_tokens"]):
            return web.json_response({"error": "unsupported"}, status=400)
        sampling = pb.SamplingParams(
            max_tokens=body["max_tokens"], temperature=body["temperature"], ignore_eos=body["ignore_eos"]
        )
        generate = pb.GenerateRequest(prompt_token_ids=body["prompt"], sampling=sampling)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        async for response in app["stub"].Generate(generate):
            choice = {"index": 0, "text": response.text, "finish_reason": None}
            await reply.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if response.HasField("usage"):
                usage = {"prompt_tokens": response.usage.prompt_tokens,
                         "completion_tokens": response.usage.completion_tokens}  # fmt: skip
                await reply.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        return reply

    app.cleanup_ctx.append(channel)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


if __name__ == "__main__":
    web.run_app(make_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), print=None)

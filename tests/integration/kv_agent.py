"""A worker stand-in for integration tests: a DaemonKVCache in its own process, driven by JSON lines.

Usage: python -m tests.integration.kv_agent ADDRESS NAME MODEL_ID NUM_PAGES DEVICE DTYPE
Each line on stdin is {"op": ..., ...}; each reply on stdout is {"ok": ...} or {"error": ...}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from memory_daemon.prefix import page_keys
from memory_daemon.shape import PoolShape
from pagedserve.plumbing.auth import SECRET_ENV
from services.worker.kv.remote import DaemonKVCache

SHAPE = PoolShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)


def page_value(cache: DaemonKVCache, page: int) -> float | None:
    """The value every element of the page holds in every layer, or None if they differ."""
    values = torch.unique(cache.kv[:, :, page])
    return values.item() if values.numel() == 1 else None


def handle(cache: DaemonKVCache, command: dict) -> object:
    op = command["op"]
    if op == "info":
        return {"lease_id": cache.lease_id, "worker_id": cache.worker_id, "shape": list(cache.kv.shape)}
    if op == "allocate":
        return cache.allocate(command["n"])
    if op == "write":
        for page in command["pages"]:
            cache.kv[:, :, page] = command["value"]
        if cache.kv.is_cuda:
            torch.cuda.synchronize()  # the reader is another process
        return True
    if op == "read":
        return [page_value(cache, page) for page in command["pages"]]
    if op == "publish":
        tokens = command["tokens"]  # with its tokens, so that the index's events announce it
        count = cache.publish(page_keys(tokens, SHAPE.page_size), command["pages"], tokens=tokens)
        cache.flush()
        return count
    if op == "promote":
        return cache.promote(page_keys(command["tokens"], SHAPE.page_size))
    if op == "lookup":
        return cache.lookup(page_keys(command["tokens"], SHAPE.page_size))
    if op == "free":
        cache.free(command["pages"])
        cache.flush()
        return True
    if op == "usage":
        return vars(cache.usage())
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    address, name, model_id, num_pages, device, dtype = sys.argv[1:]
    shape = dataclasses.replace(SHAPE, dtype=dtype)
    cache = DaemonKVCache(
        address, model_id=model_id, shape=shape, worker_name=name, num_pages=int(num_pages), device=device,
        secret=os.environ.get(SECRET_ENV),
    )  # fmt: skip
    print(json.dumps({"ok": "attached"}), flush=True)
    for line in sys.stdin:
        try:
            reply = {"ok": handle(cache, json.loads(line))}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    cache.close()


if __name__ == "__main__":
    main()

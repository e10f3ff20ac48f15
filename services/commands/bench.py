"""`pagedserve bench`: load running servers and report latency percentiles, throughput, goodput, errors,
and, for pagedserve, KV fragmentation, prefix hits and preemptions. The targets are pagedserve's frontend
(gRPC) and any OpenAI-compatible server (--target vllm=http://host:port): each gets the same requests, one
target after another, and they land in one table, one bench.json and one bench.png in --out. With
--baseline hf, the same workload also runs through transformers in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from memory_daemon.shape import DEFAULT_PAGE_SIZE
from services.bench import report
from services.bench.load import drive, flush_prefix_cache, grpc_target
from services.bench.openai import openai_target
from services.bench.results import Slo, summarize
from services.bench.scrape import KvSampler
from services.bench.texts import text_requests
from services.bench.workloads import (
    TEXT_WORKLOADS,
    WorkloadSpec,
    ideal_prefix_hit_rate,
    make_requests,
    with_text,
    word_tokens,
)
from services.client import DEFAULT_ADDRESS, Client

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _levels(text: str) -> list[float]:
    return [float(value) for value in text.split(",")]


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the frontend (default: %(default)s)")
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=ADDRESS",
        help="a server to load, repeatable: NAME=host:port for pagedserve's frontend, NAME=http://host:port "
        "for an OpenAI-compatible one (default: pagedserve=--address)",
    )
    parser.add_argument(
        "--workload",
        choices=["fixed", "random", "shared-prefix", "multi-turn", *TEXT_WORKLOADS],
        default="random",
        help="random token ids (fixed, random, shared-prefix, multi-turn), or text through the model's chat "
        "template: copy (repeat or lightly edit a passage) and chat (open questions)",
    )
    parser.add_argument(
        "--requests", type=int, default=32, help="requests per run (multi-turn: sessions, of --turns each)"
    )
    parser.add_argument(
        "--turns", type=int, help="multi-turn: turns a session, each sending the whole history (default 6)"
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_levels, help="requests in flight, e.g. 1,4,16 (one run each)")
    load.add_argument("--rate", type=_levels, help="Poisson arrivals per second, e.g. 0.5,1 (one run each)")
    parser.add_argument(
        "--input-len", type=_range, help="prompt lengths, e.g. 64-512 (the workload's default)"
    )
    parser.add_argument("--output-len", type=_range, help="output lengths, e.g. 16-512")
    parser.add_argument("--prefix-len", type=int, help="the shared system prompt's length (shared-prefix)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompts",
        choices=["ids", "text"],
        default="ids",
        help="how OpenAI targets get a prompt: as token ids, or as text for servers that take no ids (SMG); "
        "text prompts are words of the model's tokenizer that tokenize back to the same ids",
    )
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput's TTFT bound in seconds")
    parser.add_argument(
        "--slo-tpot", type=float, default=0.5, help="goodput's time-per-token bound in seconds"
    )
    parser.add_argument(
        "--endpoints",
        type=Path,
        help="endpoints.json from `pagedserve up`: metrics to read, and the gateway listener that flushes "
        "the node's prefix cache before each run",
    )
    parser.add_argument("--metrics", action="append", default=[], help="a worker's /metrics URL (repeatable)")
    parser.add_argument("--baseline", choices=["hf"], help="also run the workload through transformers")
    parser.add_argument(
        "--model",
        help="the model folder, for the baseline and the vocabulary when no pagedserve target is loaded "
        "(default: SmolLM2-135M-Instruct); an OpenAI target's model name (default: its first model)",
    )
    parser.add_argument(
        "--hf-batch-size", type=int, help="static batch size (default: the concurrency, or 16)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for bench.json, bench.png"
    )
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the stack to come up")
    parser.add_argument("--token", help="the frontend's bearer token (default: $PAGEDSERVE_API_TOKEN)")
    parser.add_argument("--tls-ca", help="a PEM CA file: reach a frontend that serves TLS")


def run(args: argparse.Namespace) -> int:
    targets = dict(_target(text) for text in args.target) or {"pagedserve": args.address}
    nodes = [address for address in targets.values() if not _is_http(address)]
    vocab_size, model_id, connection = _pagedserve_facts(args, nodes[0] if nodes else None)
    spec = WorkloadSpec.named(args.workload, args.input_len, args.output_len, args.prefix_len, args.turns)
    by_rate = args.rate is not None
    levels = args.rate or args.concurrency or [4.0]
    load_name = "rate (req/s)" if by_rate else "concurrency"
    tokenizer = _tokenizer(args.model) if args.prompts == "text" else None
    vocab = word_tokens(tokenizer) if tokenizer else range(min(100, vocab_size - 1), vocab_size)
    # A seed per level: a later run must not find the earlier one's prompts in a cache the bench cannot flush.
    workloads = {
        level: make_requests(
            spec, args.requests, vocab=vocab, rate=level if by_rate else None, seed=args.seed + i
        )
        for i, level in enumerate(levels)
    }
    if tokenizer:
        workloads = {level: with_text(requests, tokenizer) for level, requests in workloads.items()}
    if spec.name in TEXT_WORKLOADS:
        chat = _chat_tokenizer(args.model)
        workloads = {
            level: text_requests(spec.name, args.requests, chat, spec.output_len, seed=args.seed + i)
            for i, level in enumerate(levels)
        }
    endpoints = _endpoints(args.endpoints, args.wait)
    metrics = list(args.metrics) + _worker_metrics(endpoints)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    runs: list[dict] = []
    records = {}
    for name, address in targets.items():
        for level, requests in workloads.items():
            sampler = KvSampler([] if _is_http(address) else metrics)
            concurrency = None if by_rate else int(level)
            # Cold caches for each run: a pagedserve node may be loaded twice (directly and behind a
            # gateway), and a rerun of the bench sends the same prompts.
            for node in nodes:
                said = asyncio.run(_flush(node, nodes, endpoints))
                print(f"{node}'s prefix cache: {said}", file=sys.stderr, flush=True)
            recs = asyncio.run(
                _measure(address, args.model, requests, concurrency, sampler, f"{name} {level:g}", connection)
            )
            runs.append(
                {"system": name, "load": level, "summary": summarize(recs, slo), "kv": sampler.summary()}
            )
            records[(name, level)] = recs
    if args.baseline == "hf":
        runs += _baselines(args, workloads, slo, records, by_rate)
    args.out.mkdir(parents=True, exist_ok=True)
    ideal = {
        level: ideal_prefix_hit_rate(requests, DEFAULT_PAGE_SIZE) for level, requests in workloads.items()
    }
    config = {
        "workload": vars(spec),
        "requests": args.requests,
        "load": load_name,
        "levels": levels,
        "model_id": model_id,
        "targets": targets,
        # per level: the share of prompt tokens a cache that forgets nothing would hit (multi-turn)
        "ideal_prefix_hit_rate": {f"{level:g}": rate for level, rate in ideal.items()},
    }
    report.write_json(args.out / "bench.json", config, runs)
    report.plot(args.out / "bench.png", runs, records, load_name)
    print(report.table(runs, load_name))
    for line in report.ratios(runs):
        print(line)
    for level, rate in ideal.items():
        if rate is not None:
            print(f"at {level:g}, a cache that forgets nothing would hit {rate:.1%} of the prompt tokens")
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0 if all(not run["summary"]["errors"] for run in runs) else 1


def _target(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name or not address:
        raise SystemExit(f"pagedserve bench: error: --target takes NAME=ADDRESS, got {text!r}")
    return name, address


def _is_http(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def _tokenizer(model: str | None) -> Tokenizer:
    from services.common.default_model import resolve_model

    return Tokenizer.from_file(str(resolve_model(model) / "tokenizer.json"))


def _chat_tokenizer(model: str | None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    from services.common.default_model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


def _pagedserve_facts(args: argparse.Namespace, address: str | None) -> tuple[int, str, dict]:
    """The vocabulary size, model id and connection settings, from pagedserve's frontend if one is loaded,
    else from the model folder."""
    if address is None:
        from transformers import AutoConfig

        from services.common.default_model import model_identity, resolve_model

        folder = resolve_model(args.model)
        return int(AutoConfig.from_pretrained(folder).vocab_size), model_identity(folder), {}
    with Client(address, token=args.token, tls_ca=args.tls_ca) as client:
        if args.wait:
            client.wait_ready(args.wait)
        info = client.model_info()
        return (
            info.vocab_size,
            info.model_id,
            {"credentials": client.credentials, "metadata": client.metadata},
        )


async def _measure(
    address: str,
    model: str | None,
    requests: list,
    concurrency: int | None,
    sampler: KvSampler,
    label: str,
    connection: dict,
) -> list:
    target = openai_target(address, model) if _is_http(address) else grpc_target(address, **connection)
    async with target as send, sampler.running():
        return await drive(requests, send, concurrency=concurrency, label=label)


async def _flush(node: str, nodes: list[str], endpoints: dict) -> str:
    """Flush node's prefix cache through its stack's gateway listener, which endpoints.json names (the
    public port refuses FlushCache to every client)."""
    frontend = endpoints.get("frontend", {})
    listener = frontend.get("gateway_address")
    if listener is None or (frontend["address"] != node and len(nodes) > 1):
        return (
            "not flushed: only a stack's gateway listener flushes it; start the stack with "
            "--gateway-address (or --gateway) and pass its endpoints.json with --endpoints"
        )
    return await flush_prefix_cache(listener)


def _endpoints(path: Path | None, wait_s: float) -> dict:
    """endpoints.json's contents, {} without --endpoints. `pagedserve up` writes it once every process is
    up, which can be after the frontend answers a first request: a file not there yet is waited for, as
    long as --wait allows."""
    if path is None:
        return {}
    deadline = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not path.exists():
        raise SystemExit(
            f"pagedserve bench: error: --endpoints {path} does not exist: `pagedserve up --run-dir DIR` "
            "writes DIR/endpoints.json once its stack is up (--wait SECONDS waits for it)"
        )
    return json.loads(path.read_text())


def _worker_metrics(endpoints: dict) -> list[str]:
    return [worker["metrics"] for worker in endpoints.get("workers", []) if worker.get("metrics")]


def _baselines(
    args: argparse.Namespace, workloads: dict, slo: Slo, records: dict, by_rate: bool
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from services.bench.baseline import hf_continuous, hf_static
    from services.common.default_model import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
    eos = [int(token) for token in _as_list(model.generation_config.eos_token_id)]
    runs = []
    pad = eos[0] if eos else 0
    # Static first: the continuous-batching manager may switch the model's attention implementation.
    for system in ("hf-static", "hf-continuous"):
        for level, requests in workloads.items():
            print(f"{system} at {level:g}...", file=sys.stderr, flush=True)
            if system == "hf-static":
                batch = args.hf_batch_size or (16 if by_rate else int(level))
                recs = hf_static(model, requests, batch, eos, pad, closed_loop=not by_rate)
            else:
                recs = hf_continuous(model, requests, eos, None if by_rate else int(level))
            runs.append({"system": system, "load": level, "summary": summarize(recs, slo), "kv": None})
            records[(system, level)] = recs
    return runs


def _as_list(value: object) -> list:
    return list(value) if isinstance(value, list | tuple) else ([] if value is None else [value])

"""`pagedserve bench`: load a running stack over gRPC and report latency percentiles, throughput, goodput,
errors, KV fragmentation, prefix hits and preemptions; with --baseline hf, run the same workload through
transformers in this process and print them side by side. Writes bench.json and bench.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pagedserve.v1 import generation_pb2
from services.bench import report
from services.bench.load import run_load
from services.bench.results import Slo, summarize
from services.bench.scrape import KvSampler
from services.bench.workloads import WorkloadSpec, make_requests
from services.client import DEFAULT_ADDRESS, Client


def _levels(text: str) -> list[float]:
    return [float(value) for value in text.split(",")]


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the frontend (default: %(default)s)")
    parser.add_argument("--workload", choices=["fixed", "random", "shared-prefix"], default="random")
    parser.add_argument("--requests", type=int, default=32, help="requests per run")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_levels, help="requests in flight, e.g. 1,4,16 (one run each)")
    load.add_argument("--rate", type=_levels, help="Poisson arrivals per second, e.g. 0.5,1 (one run each)")
    parser.add_argument(
        "--input-len", type=_range, help="prompt lengths, e.g. 64-512 (the workload's default)"
    )
    parser.add_argument("--output-len", type=_range, help="output lengths, e.g. 16-512")
    parser.add_argument("--prefix-len", type=int, help="the shared system prompt's length (shared-prefix)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput's TTFT bound in seconds")
    parser.add_argument(
        "--slo-tpot", type=float, default=0.5, help="goodput's time-per-token bound in seconds"
    )
    parser.add_argument("--endpoints", type=Path, help="endpoints.json from `pagedserve up`: metrics to read")
    parser.add_argument("--metrics", action="append", default=[], help="a worker's /metrics URL (repeatable)")
    parser.add_argument("--baseline", choices=["hf"], help="also run the workload through transformers")
    parser.add_argument("--model", help="the model folder for the baseline (default: SmolLM2-135M-Instruct)")
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
    with Client(args.address, token=args.token, tls_ca=args.tls_ca) as client:
        if args.wait:
            client.wait_ready(args.wait)
        info = client.model_info()
        connection = {"credentials": client.credentials, "metadata": client.metadata}
    spec = WorkloadSpec.named(args.workload, args.input_len, args.output_len, args.prefix_len)
    by_rate = args.rate is not None
    levels = args.rate or args.concurrency or [4.0]
    load_name = "rate (req/s)" if by_rate else "concurrency"
    vocab = range(min(100, info.vocab_size - 1), info.vocab_size)  # past the special tokens at the start
    # A seed per level: a later run must not find the earlier one's prompts in the prefix cache.
    workloads = {
        level: make_requests(
            spec, args.requests, vocab=vocab, rate=level if by_rate else None, seed=args.seed + i
        )
        for i, level in enumerate(levels)
    }
    metrics = list(args.metrics) + _worker_metrics(args.endpoints)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    runs: list[dict] = []
    records = {}
    for level, requests in workloads.items():
        sampler = KvSampler(metrics)
        concurrency = None if by_rate else int(level)
        label = f"pagedserve {level:g}"
        recs = asyncio.run(_measure(args.address, requests, concurrency, sampler, label, connection))
        runs.append(
            {"system": "pagedserve", "load": level, "summary": summarize(recs, slo), "kv": sampler.summary()}
        )
        records[("pagedserve", level)] = recs
    if args.baseline == "hf":
        runs += _baselines(args, workloads, info, slo, records, by_rate)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"workload": vars(spec), "requests": args.requests, "load": load_name, "levels": levels,
              "model_id": info.model_id, "address": args.address}  # fmt: skip
    report.write_json(args.out / "bench.json", config, runs)
    report.plot(args.out / "bench.png", runs, records, load_name)
    print(report.table(runs, load_name))
    for line in report.ratios(runs):
        print(line)
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0 if all(not run["summary"]["errors"] for run in runs) else 1


async def _measure(
    address: str, requests: list, concurrency: int | None, sampler: KvSampler, label: str, connection: dict
) -> list:
    async with sampler.running():
        return await run_load(address, requests, concurrency=concurrency, label=label, **connection)


def _worker_metrics(endpoints: Path | None) -> list[str]:
    if endpoints is None:
        return []
    described = json.loads(endpoints.read_text())
    return [worker["metrics"] for worker in described.get("workers", []) if worker.get("metrics")]


def _baselines(
    args: argparse.Namespace,
    workloads: dict,
    info: generation_pb2.ModelInfo,
    slo: Slo,
    records: dict,
    by_rate: bool,
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from services.bench.baseline import hf_continuous, hf_static
    from services.common.default_model import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
    eos = list(info.eos_token_ids)
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

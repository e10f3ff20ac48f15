"""The bench's outputs: a JSON file, a PNG plot (latency CDF, throughput against load) and a table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from services.bench.results import RequestRecord


def write_json(path: Path, config: dict, runs: list[dict]) -> None:
    path.write_text(json.dumps({"config": config, "runs": runs}, indent=2))


def plot(
    path: Path, runs: list[dict], records: dict[tuple[str, float], list[RequestRecord]], load_name: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cdf, throughput) = plt.subplots(1, 2, figsize=(11, 4.2))
    systems = list(dict.fromkeys(system for system, _ in records))
    loads = list(dict.fromkeys(load for _, load in records))
    colors = {system: f"C{i}" for i, system in enumerate(systems)}
    styles = {load: ("-", "--", ":", "-.")[i % 4] for i, load in enumerate(loads)}
    for (system, load), recs in records.items():
        ttft = np.sort([r.ttft for r in recs if r.ttft is not None])
        if len(ttft):
            fraction = np.arange(1, len(ttft) + 1) / len(ttft)
            label = f"{system}, {load_name} {load:g}"
            cdf.step(ttft, fraction, where="post", color=colors[system], linestyle=styles[load], label=label)
    cdf.set(xlabel="time to first token (s)", ylabel="fraction of requests", title="TTFT CDF")
    cdf.set_xscale("log")
    cdf.grid(alpha=0.3)
    cdf.legend(fontsize=7)
    for system in dict.fromkeys(run["system"] for run in runs):
        points = sorted(
            (run["load"], run["summary"]["output_tokens_per_s"]) for run in runs if run["system"] == system
        )
        throughput.plot(*zip(*points, strict=True), marker="o", label=system)
    throughput.set(xlabel=load_name, ylabel="output tokens/s", title=f"throughput against {load_name}")
    throughput.grid(alpha=0.3)
    throughput.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def table(runs: list[dict], load_name: str) -> str:
    """A Markdown table: times in milliseconds, goodput in requests/s within the SLO."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    def share(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}%}"

    header = [
        "system",
        load_name,
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "TPOT p50",
        "ITL p99",
        "goodput",
        "errors",
        "KV frag",
        "prefix hits",
        "preemptions",
    ]
    rows = []
    for run in runs:
        s, kv = run["summary"], run.get("kv") or {}
        rate = f"{s['output_tokens_per_s']:.1f}"
        rows.append(
            [
                run["system"],
                f"{run['load']:g}",
                f"{s['requests_per_s']:.2f}",
                rate,
                ms(s["ttft_s"]["p50"]),
                ms(s["ttft_s"]["p90"]),
                ms(s["ttft_s"]["p99"]),
                ms(s["tpot_s"]["p50"]),
                ms(s["itl_s"]["p99"]),
                f"{s['goodput_requests_per_s']:.2f}",
                str(sum(s["errors"].values())),
                share(kv.get("kv_fragmentation"), 1),
                share(_hit_rate(s, kv), 1),
                str(int(kv["preemptions"])) if "preemptions" in kv else "-",
            ]
        )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _hit_rate(summary: dict, kv: dict) -> float | None:
    """Cached prompt tokens over prompt tokens, as the replies' usage counts them (pagedserve's, and an
    OpenAI server's that reports cached tokens), else as the workers' metrics do."""
    if summary.get("cached_prompt_tokens") and summary.get("prompt_tokens"):
        return summary["cached_prompt_tokens"] / summary["prompt_tokens"]
    return kv.get("prefix_hit_rate")


def ratios(runs: list[dict]) -> list[str]:
    """pagedserve beside each baseline at the same load: output tokens/s and p99 TTFT."""
    ours = {run["load"]: run["summary"] for run in runs if run["system"] == "pagedserve"}
    lines = []
    for run in runs:
        base = ours.get(run["load"]) if run["system"] != "pagedserve" else None
        if base is None:
            continue
        theirs = run["summary"]
        speed = base["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        p99, their_p99 = base["ttft_s"]["p99"], theirs["ttft_s"]["p99"]
        ttft = f"p99 TTFT {p99:.2f}s against {their_p99:.2f}s" if p99 is not None and their_p99 else ""
        lines.append(f"pagedserve / {run['system']} at {run['load']:g}: {speed:.2f}x output tokens/s; {ttft}")
    return lines

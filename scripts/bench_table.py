"""The table of a scripts/bench_cpu_peers.sh run: for each workload, every system's output tokens/s, TTFT
and TPOT, and pagedserve's best configuration against the best peer.

    python scripts/bench_table.py docs/bench/cpu-peers > table.md

The folder holds SYSTEM/WORKLOAD/bench.json, one run each; a system whose name starts with "pagedserve" is
one of ours, any other a peer. "Best" is the most output tokens/s."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORKLOADS = {
    "at-once-32": "32 at once, 64-512 in, 16-256 out",
    "512-in-1024-out": "12 at once, 512 in, 256-1024 out",
    "poisson-1": "Poisson 1 req/s, 60 requests, 64-512 in, 16-256 out",
}


def summaries(folder: Path, workload: str) -> dict[str, dict]:
    """Each system's summary of the workload, by system name, in the folder's order."""
    found = {}
    for path in sorted(folder.glob(f"*/{workload}/bench.json")):
        (run,) = json.loads(path.read_text())["runs"]
        found[path.parent.parent.name] = run["summary"]
    return found


def row(name: str, s: dict) -> str:
    errors = sum(s["errors"].values())
    completed = f"{s['completed']}/{s['requests']}" + (f" ({errors} errors)" if errors else "")
    ttft, tpot = s["ttft_s"], s["tpot_s"]
    return (
        f"| {name} | {s['output_tokens_per_s']:.1f} | {ttft['p50']:.2f} s | {ttft['p99']:.2f} s | "
        f"{tpot['p50'] * 1e3:.0f} ms | {completed} |"
    )


def table(folder: Path) -> str:
    lines = []
    for workload, title in WORKLOADS.items():
        found = summaries(folder, workload)
        if not found:
            continue
        lines += [f"### {title}", "", "| system | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | completed |"]
        lines += ["|---|---|---|---|---|---|"] + [row(name, s) for name, s in found.items()]
        ours = {n: s for n, s in found.items() if n.startswith("pagedserve")}
        peers = {n: s for n, s in found.items() if not n.startswith("pagedserve")}
        if ours and peers:
            best = max(ours, key=lambda n: ours[n]["output_tokens_per_s"])
            peer = max(peers, key=lambda n: peers[n]["output_tokens_per_s"])
            a, b = ours[best], peers[peer]
            lines += [
                "",
                f"{best} against {peer}: output tokens/s "
                f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x, "
                f"TPOT p50 {a['tpot_s']['p50'] / b['tpot_s']['p50']:.2f}x, "
                f"TTFT p99 {a['ttft_s']['p99'] / b['ttft_s']['p99']:.2f}x "
                "(above 1 is better for tokens/s, below 1 for latencies).",
            ]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    print(table(parser.parse_args().folder))


if __name__ == "__main__":
    main()

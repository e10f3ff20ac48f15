"""The soak's memory watch (scripts/soak.py): each stack process's resident set sampled over the run, and
whether it stopped growing."""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from pathlib import Path

MIB = 1 << 20


def stack_processes(run_dir: Path) -> dict[int, str]:
    """pid -> role (launcher, daemon, frontend, worker-N) of each process whose command line names run_dir."""
    found: dict[int, str] = {}
    for entry in Path("/proc").glob("[0-9]*"):  # the processes' folders
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or one that just ended
            continue
        if str(run_dir) in args and (role := re.search(r"services\.cli (\w+)", args)):
            name = re.search(r"--name (\S+)", args)
            found[int(entry.name)] = "launcher" if role[1] == "up" else name[1] if name else role[1]
    return found


Point = tuple[float, int, int]  # seconds into the run, VmRSS, and RssShmem (the KV pool it has touched)
Series = dict[int, tuple[str, list[Point]]]  # pid -> (role, points)


def sample_loop(run_dir: Path, every_s: float, series: Series, stop: threading.Event, t0: float) -> None:
    while True:
        for pid, role in stack_processes(run_dir).items():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:  # it just ended
                continue
            rss, shm = (re.search(rf"{name}:\s+(\d+) kB", status) for name in ("VmRSS", "RssShmem"))
            if rss and shm:
                point = (time.monotonic() - t0, int(rss[1]) * 1024, int(shm[1]) * 1024)
                series.setdefault(pid, (role, []))[1].append(point)
        if stop.wait(every_s):
            return


def level(points: list[Point], lo: float, hi: float, stat: str, private: bool = False) -> float:
    """The median or max RSS (less shm if private) between fractions lo and hi of a series' own span."""
    first, span = points[0][0], (points[-1][0] - points[0][0]) or 1.0
    values = [rss - (shm if private else 0) for t, rss, shm in points if lo <= (t - first) / span <= hi]
    values = values or [0]
    return statistics.median(values) if stat == "median" else max(values)


def judge_memory(series: Series, run_s: float, args: argparse.Namespace) -> list[dict]:
    """Per series: RSS at its start and in its middle and last thirds, and the growth of its private part
    from one to the other (judged if the series is long enough)."""
    rows = []
    for pid, (role, points) in series.items():
        span, thirds = points[-1][0] - points[0][0], ((1 / 3, 2 / 3), (2 / 3, 1))
        middle, end = (level(points, lo, hi, args.stat) for lo, hi in thirds)
        private_middle, private_end = (level(points, lo, hi, args.stat, private=True) for lo, hi in thirds)
        growth = private_end - private_middle
        allowed = max(private_middle * args.max_growth_pct / 100, args.max_growth_mib * MIB)
        judged = span >= args.judge_fraction * run_s and private_middle > 0
        mib = {"start": points[0][1], "middle": middle, "end": end, "shm_end": points[-1][2]}
        mib |= {"growth": growth, "allowed": allowed}
        row = {"process": role, "pid": pid, "span_s": round(span), "judged": judged}
        row |= {f"{k}_mib": round(v / MIB, 1) for k, v in mib.items()}
        rows.append(row | {"ok": not judged or growth < allowed})
    return rows

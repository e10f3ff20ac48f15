"""Soak a real stack: mixed traffic for a while, workers killed on a schedule, then nothing may be left over.

    .venv/bin/python scripts/soak.py --minutes 30 [--concurrency 6] [--kill-every 180] [--dtype float32]
        [--json soak.json]

It starts `pagedserve up` itself (two workers, the default model in --dtype, float32 unless named, a KV pool
of 256 MiB in float32 or its tokens' worth in bfloat16) in a new private folder, with a fresh shared secret
so that it can ask the daemon and the workers for their state. Client threads send the public API a mix of
requests: greedy and sampled, with stop strings and stop tokens,
priorities, logprobs, cancelled, past their deadline, and bad inputs. Each kind has the final gRPC statuses it
may end with; any other, UNAVAILABLE included (with failover no client sees a worker die), is an error. Every
--kill-every seconds one worker gets SIGKILL, worker-0 and worker-1 in turn, once the frontend has reached
both again (its pagedserve.frontend.EveryWorker health); `up` restarts it. Just before,
two greedy and two seeded probe calls start, and the kill waits until each is streaming. After the traffic,
every greedy or seeded call (probes, and the greedy, sampled and stops kinds) that a kill came during, as it
came during every call that moved, is rerun on the quiet stack: it must give the same tokens.

Every --sample-every seconds it records the resident memory (VmRSS) of each process of the stack; a
restarted worker starts a new series. A series that lasted --judge-fraction of the run must have stopped
growing: after its first third (the warm-up), the median of its last third may exceed the median of its
middle third by less than max(--max-growth-pct, --max-growth-mib). Judged without shared memory (RssShmem):
a worker's RSS grows with each page of the KV pool it touches, up to the pool's size, leak or not. And
medians, as the frontend's RSS swings by tens of MiB with each burst of 10 MB prompts, which a peak would
take for growth (--stat max compares peaks).

At the end the workers must go idle, every page of the daemon's pool must be free, leased idle or
evictable, with the daemon's own invariant check passing, and `up` must stop on SIGINT with status 0
within 60 s, leaving no process behind. It prints a summary (and --json writes it); it exits 0 only if all
of this holds, else it says why and shows the stack's log tail.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from argparse import RawDescriptionHelpFormatter
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from prometheus_client.parser import text_string_to_metric_families
from soak_memory import Series, judge_memory, sample_loop, stack_processes
from soak_traffic import KINDS, Done, client_loop, rerun_moved, start_probes

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.auth import SECRET_ENV, secret_metadata
from pagedserve.plumbing.private import check_unix_peer
from pagedserve.plumbing.rpc import wait_for_health
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.default_model import default_model_dir
from services.frontend.config import EVERY_WORKER_HEALTH
from services.launcher import spawn

ROOT = Path(__file__).resolve().parents[1]


def kill_loop(run_dir: Path, address: str, every_s: float, kills: list[dict], before: Callable[[int], None],
              stop: threading.Event, t0: float) -> None:  # fmt: skip
    """SIGKILL worker-0, then worker-1, and so on, every every_s seconds, each once the frontend at address
    has reached every worker again and after before(kill number). A kill while the last one's worker is
    still starting would leave none up, where UNAVAILABLE is the right answer: on a loaded machine a
    restart took 43 s, past a --kill-every of 40."""
    while not stop.wait(every_s):
        while not stop.is_set():
            try:
                wait_for_health(address, 5.0, service=EVERY_WORKER_HEALTH)
                break
            except TimeoutError:
                continue
        if stop.is_set():
            return
        before(len(kills))
        name = f"worker-{len(kills) % 2}"
        pids = [pid for pid, role in stack_processes(run_dir).items() if role == name]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        kills.append({"t_s": round(time.monotonic() - t0, 1), "worker": name, "pids": pids})


def internal(address: str) -> grpc.Channel:
    """A channel to the daemon or a worker, whose calls carry the stack's secret."""
    check_unix_peer(address)  # the secret goes only to a socket of this user's
    return grpc.insecure_channel(address)


def settled(secret: str, endpoints: dict) -> dict:
    """The workers' load and the pool's counts, and whether all is idle and back; raises grpc.RpcError."""
    state: dict[str, Any] = {}
    calls = {"metadata": secret_metadata(secret), "timeout": 10}
    for worker in endpoints["workers"]:
        with internal(worker["address"]) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), **calls)
        state[worker["name"]] = {"running": load.running, "kv_pages_in_use": load.kv_pages_in_use}
    idle = all(load["running"] == 0 and load["kv_pages_in_use"] == 0 for load in state.values())
    request = memory_pb2.GetStatsRequest(check_invariants=True)  # INTERNAL if the books do not balance
    with internal(endpoints["daemon"]["address"]) as channel:
        stats = memory_pb2_grpc.MemoryDaemonStub(channel).GetStats(request, **calls)
    names = ("total_pages", "free_pages", "leased_pages", "evictable_pages", "shared_pages", "cached_pages")
    state["pools"] = pools = [{name: getattr(pool, name) for name in names} for pool in stats.pools]
    back = all(p["free_pages"] + p["leased_pages"] + p["evictable_pages"] == p["total_pages"] for p in pools)
    return state | {"idle": idle, "every_page_back": back}


def wait_settled(secret: str, endpoints: dict, timeout_s: float = 60) -> dict:
    """Wait until the workers are idle and every page is back; the state last seen, or the last error."""
    deadline, state = time.monotonic() + timeout_s, dict[str, Any]()
    while time.monotonic() < deadline and not (state.get("idle") and state.get("every_page_back")):
        try:
            state = settled(secret, endpoints)
        except grpc.RpcError as exc:
            state = {"error": f"{exc.code().name}: {exc.details()}"}
            if exc.code() == grpc.StatusCode.INTERNAL:  # the daemon's invariant check failed
                break
        time.sleep(0.5)
    return state


def scrape(url: str) -> dict[str, dict[str, float]]:
    """pagedserve_requests_total by code, and pagedserve_failovers_total where the frontend counts them."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("pagedserve_requests_total", "pagedserve_failovers_total"):
                label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) or "all"
                found.setdefault(sample.name, {})[label.removeprefix("code=")] = sample.value
    return found


class Stack(NamedTuple):
    folder: Path  # private (0700): holds the run folder and the log
    proc: subprocess.Popen[bytes]


def start_stack(secret: str, concurrency: int, dtype: str) -> Stack:
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    # The dtype named, whatever this CPU would pick: a call a kill came during resumes by recomputing some of
    # its tokens in a prefill, which gives the uninterrupted decodes' tokens exactly where the two compute
    # alike (README, "Failover"): float32, and bfloat16 on vdpbf16ps without AMX. The pool holds as many
    # tokens either way: the "over the pool" requests are sized for it.
    kv_memory = {"float32": "256MiB", "bfloat16": "128MiB"}[dtype]
    command = [sys.executable, "-m", "services.cli", "up", "--workers", "2", "--port", "0", "--kv-memory",
               kv_memory, "--dtype", dtype, "--max-waiting", str(8 * concurrency),
               "--run-dir", str(folder / "run")]  # fmt: skip
    with open(folder / "up.log", "wb") as log:
        # Ctrl-C reaches only this script, which stops the stack in order; if this script dies, `up` gets
        # SIGTERM (spawn) and stops the stack all the same.
        env = {**os.environ, SECRET_ENV: secret}
        proc = spawn(command, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return Stack(folder, proc)


def wait_up(stack: Stack, timeout_s: float = 300) -> dict:
    """endpoints.json, once `up` has written it and the frontend serves."""
    path, deadline = stack.folder / "run" / "endpoints.json", time.monotonic() + timeout_s
    while not path.exists():
        if stack.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pagedserve up did not come up (status {stack.proc.poll()})")
        time.sleep(0.2)
    endpoints: dict = json.loads(path.read_text())
    wait_for_health(endpoints["frontend"]["address"], 30, service="pagedserve.v1.Generation")
    return endpoints


def stop_stack(stack: Stack) -> dict:
    """SIGINT to `up`: it must exit 0 within 60 s, leaving no process of its run folder behind."""
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGINT)
    try:
        status: int | str = stack.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        stack.proc.kill()
        status = f"still running after 60 s (then killed: {stack.proc.wait()})"
    deadline = time.monotonic() + 5
    while (survivors := stack_processes(stack.folder / "run")) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return {"status": status, "survivors": [f"{role} (pid {pid})" for pid, role in survivors.items()]}


def soak(args: argparse.Namespace, stack: Stack, endpoints: dict, secret: str, report: dict) -> None:
    """Traffic, kills and samples for args.minutes; then the stack's state and metrics, into report."""
    stop, done, series, t0 = threading.Event(), Done(), Series(), time.monotonic()
    run_dir, address = stack.folder / "run", endpoints["frontend"]["address"]
    loops: list[tuple[Callable[..., None], tuple]] = [(sample_loop, (run_dir, args.sample_every, series))]
    loops += [(client_loop, (address, args.seed + i, done)) for i in range(args.concurrency)]
    probes: list[threading.Thread] = []
    probe = functools.partial(start_probes, address, done, args.seed + 1000, t0, probes)
    kill = (run_dir, address, args.kill_every, report["kills"], probe)
    loops += [(kill_loop, kill)] if args.kill_every > 0 else []
    threads = [threading.Thread(target=loop, args=(*rest, stop, t0), daemon=True) for loop, rest in loops]
    for thread in threads:
        thread.start()
    try:
        stop.wait(args.minutes * 60)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
        for thread in probes:  # started by the kill loop, which has ended
            thread.join(timeout=180)
    report["requests"] = {name: dict(Counter(out.code for k, out in done if k == name)) for name in KINDS}
    report["unexpected"] = [
        f"{out.at_s:7.1f}s {name}: {out.code}: {out.problem or out.details}"[:300]
        for name, out in done
        if out.code not in KINDS[name].expected or out.problem
    ]
    report["memory"] = judge_memory(series, args.minutes * 60, args)
    report["rss_series"] = {f"{role} {pid}": [(round(t), rss, shm) for t, rss, shm in points]
                            for pid, (role, points) in series.items()}  # fmt: skip
    report["pages"] = wait_settled(secret, endpoints)
    report["reruns"] = rerun_moved(address, done, [kill["t_s"] for kill in report["kills"]])
    report["metrics"] = scrape(endpoints["frontend"]["metrics"])


def failures(report: dict) -> list[str]:
    pages, stop = report.get("pages", {}), report["stop"]
    found = [f"crashed: {report['crash']}"] if "crash" in report else []
    found += [f"{len(report['unexpected'])} unexpected outcomes"] if report.get("unexpected") else []
    differ = report.get("reruns", {}).get("differ")
    found += [f"{len(differ)} calls a kill came during differ from an uninterrupted rerun"] if differ else []
    found += [f"{row['process']} (pid {row['pid']}) grew {row['growth_mib']} MiB, over {row['allowed_mib']}"
              for row in report.get("memory", []) if not row["ok"]]  # fmt: skip
    if "crash" not in report and not (pages.get("idle") and pages.get("every_page_back")):
        found.append(f"the stack did not settle within 60 s: {pages}")
    internal = report.get("metrics", {}).get("pagedserve_requests_total", {}).get("INTERNAL", 0)
    found += [f"the frontend answered {internal:g} calls with INTERNAL (see its log)"] if internal else []
    found += [f"pagedserve up ended with {stop['status']}"] if stop["status"] != 0 else []
    found += [f"processes left behind: {stop['survivors']}"] if stop["survivors"] else []
    return found


def print_summary(report: dict) -> None:
    print("\nrequests by kind and final status:")
    for name, codes in report.get("requests", {}).items():
        print(f"  {name:24} {sum(codes.values()):6}   " + ", ".join(f"{c} {n}" for c, n in codes.items()))
    print(f"unexpected outcomes: {len(report.get('unexpected', []))}")
    for line in report.get("unexpected", [])[:20]:
        print(f"  {line}")
    kills = [f"{kill['worker']} {kill['pids']} at {kill['t_s']}s" for kill in report["kills"]]
    print(f"worker kills: {len(kills)} {', '.join(kills)}")
    reruns = report.get("reruns", {"checked": {}, "differ": []})
    print(f"calls a kill came during, rerun: {sum(reruns['checked'].values())} {reruns['checked']}; differ:")
    for line in reruns["differ"][:20]:
        print(f"  {line}"[:600])
    columns = ("span_s", "start_mib", "middle_mib", "end_mib", "shm_end_mib", "growth_mib")
    print(f"\n  {'VmRSS, MiB':16} {'pid':>8}" + "".join(f"{c.removesuffix('_mib'):>9}" for c in columns))
    for row in report.get("memory", []):
        verdict = ("ok" if row["ok"] else "GROWING") if row["judged"] else "not judged: a short series"
        figures = "".join(f"{row[c]:9}" for c in columns)
        print(f"  {row['process']:16} {row['pid']:8}{figures}  {verdict}")
    stat = report["args"]["stat"]
    print(f"  (middle, end: the {stat} of a series' thirds; growth: of its {stat}s less shm, the KV pool's)")
    print(f"\npages and load at the end: {json.dumps(report.get('pages'))}")
    print(f"frontend metrics: {json.dumps(report.get('metrics'))}")
    print(f"stop: {report['stop']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30, help="how long the traffic runs")
    parser.add_argument("--concurrency", type=int, default=6, help="client threads")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's")
    parser.add_argument("--kill-every", type=float, default=180, help="seconds between worker kills; 0: none")
    parser.add_argument("--sample-every", type=float, default=5, help="seconds between RSS samples")
    parser.add_argument("--stat", choices=("median", "max"), default="median", help="of each third's RSS")
    parser.add_argument("--max-growth-pct", type=float, default=5, help="RSS growth allowed, in percent")
    parser.add_argument("--max-growth-mib", type=float, default=32, help="RSS growth allowed, in MiB")
    parser.add_argument("--judge-fraction", type=float, default=0.6, help="judge series lasting this share")
    parser.add_argument("--seed", type=int, default=0, help="the first client thread's random seed")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops the stack too, as Ctrl-C does
    default_model_dir()  # converted once, before two workers race for it
    secret = secrets.token_urlsafe(32)
    stack = start_stack(secret, args.concurrency, args.dtype)
    report: dict[str, Any] = {"args": vars(args), "kills": []}
    try:
        soak(args, stack, wait_up(stack), secret, report)
    except (Exception, KeyboardInterrupt) as exc:
        if not isinstance(exc, KeyboardInterrupt):
            traceback.print_exc()
        report["crash"] = f"{type(exc).__name__}: {exc}"
    finally:
        report["stop"] = stop_stack(stack)
    report["failures"] = failures(report)
    print_summary(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if report["failures"]:
        print("\nFAILED:\n" + "\n".join(f"  {why}" for why in report["failures"]))
        log = (stack.folder / "up.log").read_text(errors="replace").splitlines()[-80:]
        print(f"\nthe last lines of {stack.folder / 'up.log'}:\n" + "\n".join(log))
        return 1
    shutil.rmtree(stack.folder, ignore_errors=True)
    print("\nPASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())

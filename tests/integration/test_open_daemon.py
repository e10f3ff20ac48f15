"""A daemon or worker started by hand without a secret, against another local user (`nobody`, see
tests/second_user.py); and dropping the cache entries a worker published."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.plumbing.auth import SECRET_ENV
from pagedserve.plumbing.rpc import wait_for_health
from services.common.default_model import default_model_dir
from tests.clients import internal_channel, pool_counts
from tests.procs import REPO, DaemonProcess, KVAgent, free_port
from tests.second_user import python_as_second_user
from tests.waiting import wait_until

VICTIM_PROMPT = list(range(100, 116))  # four full pages of SHAPE


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pagedserve-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_without_secret(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    env = {key: value for key, value in os.environ.items() if key != SECRET_ENV}
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def serving_or_exited(proc: subprocess.Popen[bytes], address: str) -> str | None:
    if proc.poll() is not None:
        return "exited"
    try:
        wait_for_health(address, 0.5)
        return "serving"
    except TimeoutError:
        return None


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.terminate()
    return proc.wait(timeout=60)


def as_other_user(*args: str) -> dict:
    """Run tests/integration/other_user.py as the other user; its one JSON line."""
    command = [*python_as_second_user(), "-m", "tests.integration.other_user", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def refused_at_start(proc: subprocess.Popen[bytes], log_path: Path, prog: str) -> None:
    last_line = log_path.read_text().splitlines()[-1]
    assert proc.returncode == 2 and last_line.startswith(f"pagedserve {prog}: error: "), log_path.read_text()
    assert "no shared secret" in last_line and "unix:" in last_line, last_line


@pytest.mark.parametrize("where", ["default address", "loopback port"])
def test_a_daemon_without_a_secret_is_not_open_to_other_users(
    tmp_path: Path, shm_dir: Path, where: str
) -> None:
    """Before: another user attached to it over loopback, leased every free page, and published pages under
    the victim's prompt keys, which outlived their disconnect."""
    python_as_second_user()
    address = "127.0.0.1:50052" if where == "default address" else f"127.0.0.1:{free_port()}"
    flags = [] if where == "default address" else ["--address", address]
    log_path = tmp_path / "daemon.log"
    proc = start_without_secret(
        [sys.executable, "-m", "memory_daemon", "--shm-dir", str(shm_dir), *flags], log_path
    )
    try:
        wait_until(lambda: serving_or_exited(proc, address), 60, "the daemon to serve or refuse")
        intruder = as_other_user("intrude", address, *map(str, VICTIM_PROMPT))
    finally:
        stop(proc)
    assert not intruder["attached"], f"another user got into the daemon: {intruder}"
    refused_at_start(proc, log_path, "daemon")


def test_a_worker_without_a_secret_is_not_open_to_other_users(tmp_path: Path) -> None:
    python_as_second_user()
    default_model_dir()
    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "worker.log"
    worker = [sys.executable, "-m", "services.cli", "worker", "--kv", "local", "--address", address]
    proc = start_without_secret([*worker, "--kv-memory", "64MiB"], log_path)
    try:
        wait_until(lambda: serving_or_exited(proc, address), 120, "the worker to serve or refuse")
        caller = as_other_user("call-worker", address)
    finally:
        stop(proc)
    assert not caller["answered"], f"another user called the worker: {caller}"
    refused_at_start(proc, log_path, "worker")


def test_a_daemon_without_a_secret_serves_its_own_user_on_a_private_socket(
    tmp_path: Path, run_dir: Path, shm_dir: Path
) -> None:
    python_as_second_user()
    folder = run_dir / "sockets"  # missing: the daemon makes it, 0700
    address = f"unix:{folder}/daemon.sock"
    log_path = tmp_path / "daemon.log"
    proc = start_without_secret([sys.executable, "-m", "memory_daemon", "--address", address,
                                 "--shm-dir", str(shm_dir)], log_path)  # fmt: skip
    try:
        assert wait_until(lambda: serving_or_exited(proc, address), 60, "the daemon") == "serving"
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(folder / "daemon.sock").st_mode) == 0o600
        os.chmod(run_dir, 0o755)  # the other user may reach the folder, not the socket in it
        intruder = as_other_user("intrude", address, *map(str, VICTIM_PROMPT))
        assert not intruder["attached"] and "Permission denied" in intruder["error"], intruder
        agent = KVAgent(address, "mine")  # this user needs no secret
        assert len(agent("allocate", n=2)) == 2
        assert agent.close() == 0
    finally:
        assert stop(proc) == 0, log_path.read_text()


def test_a_daemon_without_a_secret_refuses_a_socket_folder_others_can_enter(
    tmp_path: Path, run_dir: Path, shm_dir: Path
) -> None:
    os.chmod(run_dir, 0o755)
    log_path = tmp_path / "daemon.log"
    address = f"unix:{run_dir}/daemon.sock"
    proc = start_without_secret([sys.executable, "-m", "memory_daemon", "--address", address,
                                 "--shm-dir", str(shm_dir)], log_path)  # fmt: skip
    assert proc.wait(timeout=60) == 2, log_path.read_text()
    last_line = log_path.read_text().splitlines()[-1]
    assert last_line.startswith("pagedserve daemon: error: ") and "mode 755" in last_line, last_line


def test_the_entries_a_worker_published_can_be_dropped(daemon: DaemonProcess) -> None:
    """A worker that published bad pages (a bug, a bad model build) leaves them cached after it goes; the
    daemon knows who published each page, and drops them on request."""
    poisoner, victim = KVAgent(daemon.address, "poisoner"), KVAgent(daemon.address, "victim")
    try:
        pages = poisoner("allocate", n=4)
        poisoner("write", pages=pages, value=-1.0)
        assert poisoner("publish", tokens=VICTIM_PROMPT, pages=pages) == 4
        assert poisoner.close() == 0
        counts = wait_until(
            lambda: c if len((c := pool_counts(daemon.address)).workers) == 1 else None,
            10,
            "the poisoner to detach",
        )
        (publisher,) = [p for p in counts.publishers if p.name == "poisoner"]
        assert publisher.cached_pages == 4 and publisher.model_id == "test-model"
        held = victim("lookup", tokens=VICTIM_PROMPT)
        assert held == pages  # the poisoned entries outlived their publisher
        with internal_channel(daemon.address) as channel:
            stub = memory_pb2_grpc.MemoryDaemonStub(channel)
            dropped = stub.DropPublished(memory_pb2.DropPublishedRequest(worker_name="poisoner"))
            Drop = memory_pb2.DropPublishedRequest
            bad = [
                (Drop(), grpc.StatusCode.INVALID_ARGUMENT),
                (Drop(worker_id=1, pool_id=9), grpc.StatusCode.NOT_FOUND),
            ]
            for request, code in bad:
                with pytest.raises(grpc.RpcError) as caught:
                    stub.DropPublished(request)
                assert caught.value.code() == code, caught.value.details()
        assert dropped.pages == 4
        assert victim("lookup", tokens=VICTIM_PROMPT) == []
        victim("free", pages=held)  # the pages it still held go free, not back to the cache
        after = pool_counts(daemon.address)
        assert after.cached_pages == 0 and not after.publishers
        assert after.free_pages + after.leased_pages == after.total_pages
    finally:
        victim.kill()

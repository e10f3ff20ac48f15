"""Another local user against a root-run stack: a run folder they made, a symlink of theirs on the way to
root's own folder, a socket they swapped in, a pool file their fake daemon names. Real `pagedserve`
processes, real sockets, and `nobody` as the other user (tests/second_user.py; skipped, saying why,
without root or setpriv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.default_model import default_model_dir
from tests.procs import REPO, SECRET, free_port, start_daemon, terminate
from tests.second_user import (
    folder_of_second_user,
    python_as_second_user,
    remove_folder_of_second_user,
    run_as_second_user,
    start_as_second_user,
)
from tests.waiting import wait_until


@pytest.fixture
def their_folder() -> Iterator[Path]:
    folder = folder_of_second_user()
    yield folder
    remove_folder_of_second_user(folder)


def start(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """A pagedserve process as this (root) user, with the stack's secret in its environment."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def exited_or(proc: subprocess.Popen[bytes], log_path: Path, *signs: str) -> str | None:
    """'exited' once proc has, a sign once its log shows one, else None: a condition for wait_until."""
    if proc.poll() is not None:
        return "exited"
    text = log_path.read_text(errors="replace")
    return next((sign for sign in signs if sign in text), None)


def pagedserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def test_up_refuses_a_run_folder_another_user_made(tmp_path: Path, their_folder: Path) -> None:
    """Before: `up` took the folder, and its endpoints.json.partial, a symlink the other user planted,
    made it overwrite a file of root's with the stack's endpoints."""
    default_model_dir()
    precious = tmp_path / "precious"  # root's, in a folder only root can enter
    precious.write_text("root's own data\n")
    run_as_second_user("ln", "-s", str(precious), str(their_folder / "endpoints.json.partial"))
    log_path = tmp_path / "up.log"
    up = pagedserve("up", "--port", str(free_port()), "--run-dir", str(their_folder), "--kv-memory", "64MiB")
    proc = start(up, log_path)
    try:
        wait_until(lambda: exited_or(proc, log_path, "pagedserve is up"), 300, "up to stop or come up")
    finally:
        status = terminate(proc, 60)
    assert precious.read_text() == "root's own data\n", "up wrote through another user's symlink"
    last_line = log_path.read_text().splitlines()[-1]
    assert status == 2 and last_line.startswith("pagedserve up: error: --run-dir "), log_path.read_text()
    assert f"belongs to uid {os.stat(their_folder).st_uid}" in last_line, last_line


@pytest.mark.parametrize("command", ["up --run-dir", "daemon --address"])
def test_a_run_folder_reached_through_another_users_symlink_is_refused(
    tmp_path: Path, their_folder: Path, command: str
) -> None:
    """The way to a folder of root's goes through the other user's folder and symlink, which they can point
    elsewhere at any time. Before: `up` and the daemon took it and served there."""
    default_model_dir()
    private = tmp_path / "private"
    (private / "sockets").mkdir(parents=True, mode=0o700)
    run_as_second_user("ln", "-s", str(private), str(their_folder / "link"))
    prog, flag = command.split()
    where = {"up": f"{their_folder}/link/run", "daemon": f"unix:{their_folder}/link/sockets/daemon.sock"}
    extra = ["--port", str(free_port()), "--kv-memory", "64MiB"] if prog == "up" else []
    log_path = tmp_path / "refused.log"
    proc = start(pagedserve(prog, flag, where[prog], *extra), log_path)
    try:
        wait_until(lambda: exited_or(proc, log_path, "pagedserve is up", "serving on"), 300, "a refusal")
    finally:
        status = terminate(proc, 60)
    last_line = log_path.read_text().splitlines()[-1]
    assert status == 2 and last_line.startswith(f"pagedserve {prog}: error: {flag} "), last_line
    assert f"{their_folder}, above {their_folder}/link/" in last_line, last_line
    assert f"belongs to uid {os.stat(their_folder).st_uid}" in last_line, last_line
    assert sorted(os.listdir(private)) == ["sockets"] and not os.listdir(private / "sockets")


def test_a_worker_refuses_its_daemon_reached_through_another_users_symlink(
    tmp_path: Path, run_dir: Path, their_folder: Path
) -> None:
    """Root's own daemon, through the other user's symlink: the secret would go wherever they point it
    between the worker's check and its connection. Before: the worker attached."""
    default_model_dir()
    (run_dir / "sockets").mkdir(0o700)
    daemon = start_daemon(run_dir, address=f"unix:{run_dir}/sockets/daemon.sock")
    run_as_second_user("ln", "-s", str(run_dir), str(their_folder / "link"))
    address = f"unix:{their_folder}/link/sockets/daemon.sock"
    log_path = tmp_path / "worker.log"
    proc = start(
        pagedserve("worker", "--address", f"unix:{run_dir}/worker.sock", "--daemon", address), log_path
    )
    try:
        wait_until(lambda: exited_or(proc, log_path, "serving on", "refusing to send"), 300,
                   lambda: f"the worker to attach or give up:\n{log_path.read_text()}")  # fmt: skip
    finally:
        terminate(proc, 60)
        assert daemon.stop() == 0
    log = log_path.read_text()
    assert "serving on" not in log, "the worker attached to a daemon reached through another user's symlink"
    assert f"refusing to send the stack's secret to {address}: {their_folder}, above " in log, log


def impostor(tmp_path: Path, address: str, *pool: str) -> tuple[subprocess.Popen[bytes], Path]:
    """The other user's fake daemon or worker at address, logging every call it gets."""
    log_path = tmp_path / "impostor.log"
    proc = start_as_second_user("tests.integration.other_user", "impostor", address, *pool, log_path=log_path)
    wait_until(lambda: exited_or(proc, log_path, '"listening"'), 60, "the impostor to listen")
    assert proc.poll() is None, log_path.read_text()
    return proc, log_path


def calls_to(log_path: Path) -> list[dict]:
    lines = log_path.read_text().splitlines()
    return [call for line in lines if line.startswith("{") and "method" in (call := json.loads(line))]


def secrets_received(log_path: Path) -> list[str]:
    return [call["method"] for call in calls_to(log_path) if SECRET in call["metadata"].values()]


def test_a_worker_sends_no_secret_to_a_socket_another_user_put_there(
    tmp_path: Path, run_dir: Path, their_folder: Path
) -> None:
    """Before: a worker attaching to the daemon's address sent the stack's secret to whatever listened
    there, here the other user's socket in a folder they can write."""
    default_model_dir()
    address = f"unix:{their_folder}/daemon.sock"
    fake, fake_log = impostor(tmp_path, address)
    log_path = tmp_path / "worker.log"
    worker = pagedserve("worker", "--address", f"unix:{run_dir}/worker.sock", "--daemon", address)
    proc = start(worker, log_path)
    try:
        wait_until(lambda: exited_or(proc, log_path, "serving on") or secrets_received(fake_log), 120,
                   lambda: f"the worker to attach or give up:\n{log_path.read_text()}")  # fmt: skip
    finally:
        terminate(proc, 60)
        terminate(fake, 60)
    assert not secrets_received(fake_log), "the worker sent the stack's secret to another user's socket"
    assert "refusing to send the stack's secret to " + address in log_path.read_text()
    assert f"belongs to uid {os.stat(their_folder).st_uid}" in log_path.read_text()


def test_the_frontend_sends_no_secret_to_a_socket_another_user_put_there(
    tmp_path: Path, their_folder: Path
) -> None:
    default_model_dir()
    address = f"unix:{their_folder}/worker-0.sock"
    fake, fake_log = impostor(tmp_path, address)
    log_path = tmp_path / "frontend.log"
    proc = start(
        pagedserve("frontend", "--address", f"127.0.0.1:{free_port()}", "--worker", address), log_path
    )
    try:
        sign = f"worker {address} is not up"
        wait_until(lambda: exited_or(proc, log_path, sign) or secrets_received(fake_log), 120,
                   lambda: f"the frontend to reach its worker:\n{log_path.read_text()}")  # fmt: skip
    finally:
        terminate(proc, 60)
        terminate(fake, 60)
    assert not secrets_received(fake_log), "the frontend sent the stack's secret to another user's socket"
    assert f"worker {address} is not up: PERMISSION_DENIED: refusing to send" in log_path.read_text()


@pytest.fixture
def their_pool_file() -> Iterator[Path]:
    """Where the other user's fake daemon makes a pool file of its own, named as the daemon names one."""
    path = Path(f"/dev/shm/pagedserve-kv-{os.getpid()}-77-{os.urandom(16).hex()}.bin")
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("target", ["a file of root's", "a pool file of the other user's"])
def test_a_worker_maps_no_file_a_fake_daemon_names(
    tmp_path: Path, run_dir: Path, their_pool_file: Path, target: str
) -> None:
    """Before: the worker mapped whatever path the daemon named: it grew a file of root's to the pool's
    size, or shared its KV (the prompts' keys and values) with a file the other user can read."""
    python_as_second_user()
    default_model_dir()
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"root's own bytes\n")
    pool = precious if target == "a file of root's" else their_pool_file
    address = f"127.0.0.1:{free_port()}"  # a port the other user took first: TCP has no owner to check
    fake, _ = impostor(tmp_path, address, str(pool), "4")
    log_path = tmp_path / "worker.log"
    worker = pagedserve("worker", "--address", f"unix:{run_dir}/worker.sock", "--daemon", address)
    proc = start(worker, log_path)
    try:
        wait_until(lambda: exited_or(proc, log_path, "serving on"), 120, "the worker to serve or give up")
    finally:
        terminate(proc, 60)
        terminate(fake, 60)
    log = log_path.read_text()
    assert precious.read_bytes() == b"root's own bytes\n", "the worker resized a file of root's"
    assert "serving on" not in log, "the worker mapped a pool file the daemon has no business naming"
    assert "refusing the pool file " + str(pool) in log, log

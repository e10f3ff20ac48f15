"""Pool files another local user planted first (`nobody`, see tests/second_user.py): a real daemon in a
folder open to all, as /dev/shm is, makes its pools beside them and never touches them."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import DaemonProcess, KVAgent, start_daemon
from tests.second_user import run_as_second_user

POOL_NAME = re.compile(r"^pagedserve-kv-(\d+)-(\d+)-[0-9a-f]{32}\.bin$")


@pytest.fixture
def open_daemon(run_dir: Path) -> Iterator[DaemonProcess]:
    """A daemon whose --shm-dir every user can write in, sticky, as /dev/shm."""
    shm_dir = Path(tempfile.mkdtemp(prefix="pagedserve-test-", dir="/dev/shm"))
    shm_dir.chmod(0o1777)
    process = start_daemon(run_dir, shm_dir=shm_dir)
    yield process
    process.stop()
    shutil.rmtree(shm_dir, ignore_errors=True)


def footprint(path: str) -> tuple[int, ...]:
    info = os.lstat(path)
    return info.st_ino, info.st_uid, info.st_mode, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def test_pool_files_planted_under_every_predictable_name_stop_nothing(open_daemon: DaemonProcess) -> None:
    """Before: a pool file's name was the daemon's pid and the pool's number, so the other user, who can
    see the pid, planted it first, and registering the pool failed with an unhandled FileExistsError."""
    shm_dir, pid = open_daemon.shm_dir, open_daemon.proc.pid
    planted = [str(shm_dir / f"pagedserve-kv-{pid}-{n}.bin") for n in range(64)]
    run_as_second_user("touch", *planted)
    before = {path: footprint(path) for path in planted}
    agents: list[KVAgent] = []
    try:
        for dtype in ("float32", "float16"):  # two shapes: two pools
            agents.append(agent := KVAgent(open_daemon.address, dtype, model_id=dtype, dtype=dtype))
            pages = agent("allocate", n=2)
            agent("write", pages=pages, value=3.0)
            assert agent("read", pages=pages) == [3.0, 3.0]
        pools = sorted(set(os.listdir(shm_dir)) - {os.path.basename(p) for p in planted})
        assert [POOL_NAME.findall(name) for name in pools] == [[(str(pid), "1")], [(str(pid), "2")]], pools
        for name in pools:
            info = os.lstat(shm_dir / name)
            assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), 0o600)
    finally:
        for agent in agents:
            agent.kill()
    assert open_daemon.stop() == 0, open_daemon.log()
    assert sorted(os.listdir(shm_dir)) == sorted(os.path.basename(p) for p in planted)
    assert {path: footprint(path) for path in planted} == before, "the daemon touched the planted files"
